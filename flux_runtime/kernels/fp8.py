"""FP8 (e4m3) activations: the quantization, the scaled GEMM, and activations quantized where they are made.

An FP8 linear computes `y = (x_q * s_x) @ (W_q * s_w)^T + b` with `x_q = e4m3(clamp(x * (1 / s_x), ±448))`.
`quantize_reference` is that quantization in plain PyTorch, and it *is* the FP8 model's math:

- static (a checkpoint's calibrated `input_scale`, one fp32 value per layer): `x.float() * inv_scale`,
  with `inv_scale = 1 / input_scale` computed once at load;
- dynamic (no calibration): one scale per token row, `s = max(amax(|row|), 1e-12) * fl32(1 / 448)`,
  then `x.float() * (1 / s)`.

Each producer below (`quantize` of a strided view, tanh-GELU, SwiGLU) computes its bf16/fp16 value
exactly as its eager op rounds it and then quantizes that value (never the unrounded fp32), so it is
`torch.equal` to "eager op, then `quantize_reference`" and lives in the `lossless` tier. The e4m3
rounding is done with integer bit operations (round to nearest even, exact on the GPU and in the
Triton interpreter alike). `fp8_linear` is the one GEMM call both paths share; `use_fast_accum`
(Hopper's reduced-precision accumulation) rounds differently and is only used in the `high` tier.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, fused_tier, run_op
from flux_runtime.kernels.gelu import K_BETA, K_KAPPA, _gelu_tanh, shortcut_consts
from flux_runtime.kernels.launch import EXACT, check_inputs, check_no_overlap, check_unit_stride, rows_pair
from flux_runtime.kernels.swiglu import _silu
from flux_runtime.kernels.triton_utils import (
    e4m3_code,
    e4m3_consts,
    e4m3_row_scale,
    jit,
    round_to,
    temporarily,
    tl,
    triton,
    upcast,
)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# A row's dynamic scale is amax * fl32(1/448): a multiply, not a division, because aten divides a CUDA
# tensor by a Python scalar as a multiply by its reciprocal (and by a true division on the CPU).
INV_E4M3_MAX = 1.0 / 448.0
MIN_AMAX = 1e-12  # a row of zeros gets this amax, so its scale is positive and its reciprocal finite
ACTS = {"identity": 0, "gelu_tanh": 1, "swiglu": 2}
MAX_ONE_BLOCK = 16384  # widest row held in registers by one program (FLUX.1's single-block input: 15360)


class Fp8Quant(NamedTuple):
    """How a layer wants its input quantized: a static `input_scale` and its reciprocal, or both None (per row)."""

    scale: Tensor | None
    inv_scale: Tensor | None

    @property
    def static(self) -> bool:
        return self.scale is not None


class Fp8Act(NamedTuple):
    """An activation in e4m3 with the fp32 scale that multiplies it back.

    `scale` is the layer's static `input_scale` (0-dim) or one scale per row, shaped `data.shape[:-1] + (1,)`.
    """

    data: Tensor
    scale: Tensor


# --------------------------------------------------------------------------------------------------
# reference


def check_quant(op: str, scale: Tensor | None, inv_scale: Tensor | None) -> None:
    """A kernel's quantization arguments: both (static, one fp32 value each) or neither (per-row scales)."""
    if (scale is None) != (inv_scale is None):
        raise ValueError(f"{op}: pass both scale and inv_scale (static) or neither (dynamic)")
    if scale is not None and (scale.numel() != 1 or inv_scale is None or inv_scale.dtype != torch.float32):
        raise UnsupportedInput(f"{op}: a static scale must be one fp32 value")


def quantize_reference(x: Tensor, scale: Tensor | None = None, inv_scale: Tensor | None = None) -> Fp8Act:
    """e4m3 of `x` (..., K): static with `scale` and `inv_scale = 1 / scale` (0-dim fp32), dynamic per row without."""
    if (scale is None) != (inv_scale is None):
        raise ValueError("quantize: pass both scale and inv_scale (static) or neither (dynamic)")
    if scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        scale = amax.clamp(min=MIN_AMAX) * INV_E4M3_MAX
        inv_scale = scale.reciprocal()
    q = (x.float() * inv_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Act(q, scale)


def _act_reference(x: Tensor, act: str) -> Tensor:
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "swiglu":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x


def act_quantize_reference(
    x: Tensor, act: str, scale: Tensor | None, inv_scale: Tensor | None, out: Tensor | None = None
) -> Fp8Act:
    """`quantize_reference(act(x))`, written into the e4m3 buffer `out` when given (a column slice of one)."""
    q = quantize_reference(_act_reference(x, act), scale, inv_scale)
    if out is None:
        return q
    out.copy_(q.data)
    return Fp8Act(out, q.scale)


# --------------------------------------------------------------------------------------------------
# device code


@jit
def _act_value(
    x_row, cols, mask, N, ACT: tl.constexpr, DTYPE: tl.constexpr, GPU: tl.constexpr,
    BETA: tl.constexpr, KAPPA: tl.constexpr,
):  # fmt: skip
    """act(x) at `cols` of one row, rounded to DTYPE as eager stores it, as fp32."""
    x = upcast(tl.load(x_row + cols, mask=mask, other=0.0), GPU)
    if ACT == 1:
        y = round_to(_gelu_tanh(x, BETA, KAPPA, GPU), DTYPE, GPU)
    elif ACT == 2:
        up = upcast(tl.load(x_row + N + cols, mask=mask, other=0.0), GPU)
        s = round_to(_silu(x, GPU), DTYPE, GPU)  # r(silu(gate)), then r(s * up)
        y = round_to(s * up, DTYPE, GPU)
    else:
        y = x
    return y


@jit
def _act_sweep_absmax(
    amax, x_row, offs, N, ACT: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr,
    BETA: tl.constexpr, KAPPA: tl.constexpr,
):  # fmt: skip
    """`amax` (BLOCK,) raised to |act(x)| over one row's N activation values, in BLOCK-wide tiles."""
    for c0 in range(0, N, BLOCK):
        cols = c0 + offs
        mask = cols < N
        y = _act_value(x_row, cols, mask, N, ACT, DTYPE, GPU, BETA, KAPPA)
        amax = tl.maximum(amax, tl.where(mask, tl.abs(y), 0.0))
    return amax


@jit
def _act_absmax(
    amax, x_row, offs, N, ACT: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr,
    BETA: tl.constexpr, KAPPA: tl.constexpr, MAX_SHORTCUT: tl.constexpr, GELU_BOUND: tl.constexpr,
):  # fmt: skip
    """`amax` raised to the row's largest |act(x)|. With MAX_SHORTCUT (tanh-GELU; GELU_BOUND from
    `gelu.gelu_amax_bound`) the sweep reads the row's largest input m and evaluates GELU(m) once: when
    GELU(m) >= the bound it is the row's GELU absmax exactly; otherwise the row is swept through GELU."""
    if MAX_SHORTCUT:
        # the row's largest input (NaN skipped, as the GELU sweep skips NaN activations)
        top = tl.full((BLOCK,), float("-inf"), tl.float32)
        for c0 in range(0, N, BLOCK):
            cols = c0 + offs
            mask = cols < N
            x = upcast(tl.load(x_row + cols, mask=mask, other=0.0), GPU)
            top = tl.maximum(top, tl.where(mask, x, float("-inf")))
        g_top = round_to(_gelu_tanh(tl.max(top, axis=0), BETA, KAPPA, GPU), DTYPE, GPU)
        if g_top >= GELU_BOUND:  # GELU(m) bounds every |GELU(x)| of the row (False for NaN: all -inf)
            amax = tl.maximum(amax, g_top)
        else:  # a small maximum: a negative input's |GELU| may be the larger
            amax = _act_sweep_absmax(amax, x_row, offs, N, ACT, DTYPE, BLOCK, GPU, BETA, KAPPA)
    else:
        amax = _act_sweep_absmax(amax, x_row, offs, N, ACT, DTYPE, BLOCK, GPU, BETA, KAPPA)
    return amax


@jit
def _act_quant_rows_kernel(
    x_ptr,  # (B, L, N) or, for SwiGLU, (B, L, 2N) [gate | up]; strides (stride_xb, stride_xl, 1)
    q_ptr,  # (B, L, N) uint8 (e4m3 bits), strides (stride_qb, stride_ql, 1): possibly a column slice
    scale_ptr,  # dynamic: (B * L,) fp32 row scales (written); static: the 0-dim input scale (unused)
    inv_ptr,  # static: the 0-dim 1 / input_scale (read); dynamic: unused
    L,
    N,
    stride_xb,
    stride_xl,
    stride_qb,
    stride_ql,
    ACT: tl.constexpr,  # 0 identity, 1 tanh-GELU, 2 SwiGLU
    DYNAMIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,  # BLOCK_N >= N: the row is read once and held in registers
    GPU: tl.constexpr,
    HW_E4M3: tl.constexpr,  # e4m3_code's hardware conversion (triton_utils.e4m3_consts)
    BETA: tl.constexpr,  # the tanh-GELU constants (gelu.K_BETA, gelu.K_KAPPA)
    KAPPA: tl.constexpr,
    MAX_SHORTCUT: tl.constexpr,  # dynamic tanh-GELU in column blocks: the first sweep takes max(x), not |GELU(x)|
    GELU_BOUND: tl.constexpr,  # with MAX_SHORTCUT: `gelu_amax_bound`, the largest |GELU| of a negative input
):
    # grid: (L, B); one row per program
    DTYPE = x_ptr.dtype.element_ty
    b = tl.program_id(1).to(tl.int64)
    pos = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + b * stride_xb + pos * stride_xl
    q_row = q_ptr + b * stride_qb + pos * stride_ql
    offs = tl.arange(0, BLOCK_N)
    if ONE_BLOCK:
        mask = offs < N
        y = _act_value(x_row, offs, mask, N, ACT, DTYPE, GPU, BETA, KAPPA)
        if DYNAMIC:
            s, inv = e4m3_row_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))
            tl.store(scale_ptr + b * L + pos, s)
        else:
            inv = tl.load(inv_ptr)
        tl.store(q_row + offs, e4m3_code(y * inv, HW_E4M3), mask=mask)
    elif DYNAMIC:
        amax = tl.zeros((BLOCK_N,), tl.float32)
        amax = _act_absmax(
            amax, x_row, offs, N, ACT, DTYPE, BLOCK_N, GPU, BETA, KAPPA, MAX_SHORTCUT, GELU_BOUND
        )
        s, inv = e4m3_row_scale(tl.max(amax, axis=0))
        tl.store(scale_ptr + b * L + pos, s)
    else:
        inv = tl.load(inv_ptr)
    if not ONE_BLOCK:
        for c0 in range(0, N, BLOCK_N):
            cols = c0 + offs
            mask = cols < N
            y = _act_value(x_row, cols, mask, N, ACT, DTYPE, GPU, BETA, KAPPA)
            tl.store(q_row + cols, e4m3_code(y * inv, HW_E4M3), mask=mask)


# Column block of each dynamic (per-row) activation producer when no `block_n` is given (`set_act_block`): a width
# sweeps each row twice in blocks (tanh-GELU's first sweep a load and a max: the shortcut); None holds a row of up
# to MAX_ONE_BLOCK values in registers. tanh-GELU: at FLUX.1's 12288 a whole row is one 16-warp program at 93
# registers a thread, one row per SM at a time. H200, FLUX.1 [dev] double block at 1024², bf16 (kernel_check --op
# gelu_tanh_fp8): image rows 203.7 us whole, 118.2 in 1024-wide blocks, 121.9 in 2048; text rows 78.9 / 82.5 /
# 89.2; the whole FP8 step (bench_fp8.py, one run) 97.6 / 95.8 / 96.8 ms, all bit-exact. SwiGLU: klein's 9216-wide
# rows whole take 128 registers and spill 56 bytes; the klein-4B FP8 step (bench_fp8.py, one run) whole / 1024 /
# 2048: 43.1 / 42.2 / 42.3 ms, all bit-exact.
ACT_BLOCK_DEFAULTS: dict[str, int | None] = {"gelu_tanh": 1024, "swiglu": 1024, "identity": None}
_ACT_BLOCK: dict[str, int | None] = dict(ACT_BLOCK_DEFAULTS)


def set_act_block(act: str, block: int | None) -> int | None:
    """The column block `act_quantize_triton` uses for `act`'s dynamic rows when no `block_n` is given (None:
    one block per row where it fits). The bits are the same either way; `scripts/bench_fp8.py` times both.
    Returns the block it replaced."""
    if act not in _ACT_BLOCK:
        raise ValueError(f"set_act_block: unknown activation {act!r}; expected one of {tuple(_ACT_BLOCK)}")
    previous, _ACT_BLOCK[act] = _ACT_BLOCK[act], block
    return previous


def act_block(act: str, block: int | None) -> AbstractContextManager[None]:
    """`set_act_block(act, block)` for the body, the previous block restored after it (the A/Bs and tests)."""
    return temporarily(functools.partial(set_act_block, act), block)


def act_quantize_triton(
    x: Tensor, act: str, scale: Tensor | None, inv_scale: Tensor | None, out: Tensor | None = None,
    *, block_n: int | None = None, gelu_shortcut: bool | None = None,
) -> Fp8Act:  # fmt: skip
    """Fused `act_quantize_reference`: x (..., K) bf16/fp16 with a unit last stride, any row strides.

    A row of up to `MAX_ONE_BLOCK` values is read once and kept in registers (one program of 8-16 warps per
    row); wider rows, or an explicit `block_n` (for a dynamic scale also `set_act_block`'s), loop over
    column blocks (twice for a dynamic scale). A dynamic tanh-GELU row in blocks takes the max shortcut of
    `gelu.gelu_amax_bound` when `gelu_shortcut` (None: `gelu.set_gelu_shortcut`'s setting) and the bound holds
    on the device: its first sweep reads the row's largest input instead of evaluating GELU, with the same bits.
    """
    op = f"{act}_fp8"
    if act not in ACTS:
        raise ValueError(f"act_quantize: unknown activation {act!r}; expected one of {tuple(ACTS)}")
    check_inputs(op, *(t for t in (scale, inv_scale, out) if t is not None), x=x)
    if x.numel() == 0:
        raise UnsupportedInput(f"{op}: empty input")
    check_quant(op, scale, inv_scale)
    dynamic = scale is None
    n = x.shape[-1] // 2 if act == "swiglu" else x.shape[-1]
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=E4M3, device=x.device)
    else:
        if out.dtype != E4M3 or tuple(out.shape) != shape:
            raise UnsupportedInput(f"{op}: out must be e4m3 {shape}, got {out.dtype} {tuple(out.shape)}")
        check_unit_stride(op, "out", out)
        if dynamic:
            raise UnsupportedInput(
                f"{op}: out= needs a static scale (a dynamic row scale spans the whole row)"
            )
    check_no_overlap(op, x, out)
    x3, q3 = rows_pair(op, x, out.view(torch.uint8))
    b, length, _ = x3.shape
    row_scale = torch.empty(b * length, dtype=torch.float32, device=x.device) if dynamic else scale
    if block_n is None and dynamic:
        block_n = _ACT_BLOCK[act]
    one_block = block_n is None and n <= MAX_ONE_BLOCK
    if block_n is None:
        block_n = triton.next_power_of_2(n) if one_block else 2048
    warps = 16 if block_n >= 8192 else 8 if block_n >= 2048 else 4
    two_sweeps = act == "gelu_tanh" and dynamic and not one_block  # where the max shortcut applies
    consts = shortcut_consts(x.dtype, x.device, gelu_shortcut if two_sweeps else False)
    consts |= e4m3_consts(x.device)
    _act_quant_rows_kernel[(length, b)](
        x3, q3, row_scale, inv_scale if not dynamic else row_scale, length, n,
        x3.stride(0), x3.stride(1), q3.stride(0), q3.stride(1),
        ACT=ACTS[act], DYNAMIC=dynamic, BLOCK_N=block_n, ONE_BLOCK=one_block, BETA=K_BETA,
        KAPPA=K_KAPPA, num_warps=warps if one_block else 4, **EXACT, **consts,
    )  # fmt: skip
    return Fp8Act(out, row_scale.view(*shape[:-1], 1) if dynamic else scale)


def _act_op(name: str, act: str) -> FusedOp:
    """The op `act` then quantize; both paths are called `(x, scale, inv_scale, out)`."""

    def fused(x: Tensor, scale: Tensor | None, inv_scale: Tensor | None, out: Tensor | None) -> Fp8Act:
        return act_quantize_triton(x, act, scale, inv_scale, out)

    def reference(x: Tensor, scale: Tensor | None, inv_scale: Tensor | None, out: Tensor | None) -> Fp8Act:
        return act_quantize_reference(x, act, scale, inv_scale, out)

    return FusedOp(name, fused=fused, reference=reference)


_QUANTIZE = _act_op("fp8_quantize", "identity")
_GELU_FP8 = _act_op("gelu_tanh_fp8", "gelu_tanh")
_SWIGLU_FP8 = _act_op("swiglu_fp8", "swiglu")


def quantize(
    x: Tensor, scale: Tensor | None = None, inv_scale: Tensor | None = None, out: Tensor | None = None
) -> Fp8Act:
    """e4m3 of `x` (any row strides, e.g. a slice of the attention output); see `quantize_reference`.

    `out` (static scales only): an e4m3 buffer or column slice of one to write instead of a new tensor.
    """
    return run_op(_QUANTIZE, x, scale, inv_scale, out)


def gelu_tanh_fp8(
    x: Tensor, scale: Tensor | None = None, inv_scale: Tensor | None = None, out: Tensor | None = None
) -> Fp8Act:
    """e4m3 of tanh-GELU(x) without a bf16 copy; `out` (static scales only) an e4m3 column slice to write."""
    return run_op(_GELU_FP8, x, scale, inv_scale, out)


def swiglu_fp8(
    x: Tensor, scale: Tensor | None = None, inv_scale: Tensor | None = None, out: Tensor | None = None
) -> Fp8Act:
    """e4m3 of `silu(gate) * up` for x = [gate | up]; `out` as in `gelu_tanh_fp8`."""
    return run_op(_SWIGLU_FP8, x, scale, inv_scale, out)


# --------------------------------------------------------------------------------------------------
# the GEMM


def fp8_linear(
    x: Fp8Act, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    """`(x.data * x.scale) @ (weight * weight_scale)^T + bias` in one `torch._scaled_mm`, fp32 accumulation.

    weight (N, K) e4m3; weight_scale 0-dim (per tensor) or (N,) (per output channel, e.g. merged q/k/v
    shards kept byte for byte). Both scales per tensor run the tensorwise GEMM; otherwise the row-wise
    one, with a static activation scale repeated per row. In the `high` tier Hopper's fast (reduced
    precision) accumulation is used, which rounds differently.
    """
    data, k = x.data, x.data.shape[-1]
    lead = data.shape[:-1]
    a = data.reshape(-1, k)
    m, n = a.shape[0], weight.shape[0]
    if x.scale.numel() == 1 and weight_scale.numel() == 1:
        sa, sb = x.scale.reshape(()), weight_scale.reshape(())
    else:
        sa = (
            x.scale.reshape(-1, 1)
            if x.scale.numel() != 1
            else x.scale.reshape(1, 1).expand(m, 1).contiguous()
        )
        sb = (
            weight_scale.reshape(1, -1)
            if weight_scale.numel() != 1
            else weight_scale.reshape(1, 1).expand(1, n)
        )
        sb = sb.contiguous()
    fast = fused_tier() == "high" and a.device.type == "cuda"
    y = torch._scaled_mm(
        a, weight.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype, use_fast_accum=fast
    )
    return y.reshape(*lead, n)


def check_fp8_gemm(device: torch.device) -> str | None:
    """None when `device` runs FP8 GEMMs (CPU, or CUDA compute capability 8.9+), else the reason."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 GEMMs are not available on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"FP8 GEMMs need compute capability 8.9+; this GPU is {major}.{minor}"
    return None
