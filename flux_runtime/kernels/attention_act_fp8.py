"""The single block's `[attention | MLP activation]` input to `linear2`, in e4m3 with one scale per row.

FLUX.1's and FLUX.2's single blocks project the concatenation of the attention heads (D wide) and the MLP
activation (tanh-GELU or SwiGLU, M wide) with one GEMM. With per-row (dynamic) scales each row's scale is the
absmax of the whole `D + M` row, so neither half can be quantized where it is made: eager writes both halves
in 16 bits, then quantizes the buffer in a third pass. This kernel reads the attention output (a strided view
of SDPA's heads) and the MLP's pre-activation, finds the row's absmax over the attention values and the
activation values as eager rounds them, and writes the e4m3 codes of both halves in a second sweep: no 16-bit
buffer, one launch instead of three.

`attention_act_quantize_reference` is the eager chain it replaces, `quantize_reference` of the concatenation:
the kernel is `torch.equal` to it (the same rounded values, the same row scale, the same e4m3 rounding), so it
is in the `lossless` tier. Static scales do not need it: there each half is written in e4m3 where it is made.

For tanh-GELU the first sweep need not evaluate the activation (see `gelu_amax_bound`): the row's GELU absmax is
the GELU of the row's largest input whenever that GELU is at least the largest |GELU| of any negative input,
so the sweep is a load and a max, and only rows whose maximum is small (below about 0.28) evaluate GELU twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.fp8 import (
    ACTS,
    E4M3,
    Fp8Act,
    _act_absmax,
    _act_reference,
    _act_value,
    quantize_reference,
)
from flux_runtime.kernels.gelu import K_BETA, K_KAPPA, shortcut_consts
from flux_runtime.kernels.launch import EXACT, check_inputs, check_int32_offsets
from flux_runtime.kernels.triton_utils import e4m3_code, e4m3_consts, e4m3_row_scale, jit, tl, upcast

ATTENTION_ACTS = ("gelu_tanh", "swiglu")


def attention_act_quantize_reference(o: Tensor, x: Tensor, act: str) -> Fp8Act:
    """e4m3 with per-row scales of `[o.flatten(2) | act(x)]`: `o` the attention heads (B, L, H, Dh), `x` the
    MLP's pre-activation (B, L, M), or (B, L, 2M) `[gate | up]` for SwiGLU."""
    return quantize_reference(torch.cat([o.flatten(2), _act_reference(x, act)], dim=-1))


@jit
def _row_pointers(o_ptr, x_ptr, q_ptr, L, D, N, stride_ob, stride_ol, stride_xb, stride_xl):
    """This program's row (grid (L, B)): its index in the row scales and its attention, input and code rows."""
    b = tl.program_id(1).to(tl.int64)
    pos = tl.program_id(0).to(tl.int64)
    row = b * L + pos
    return (
        row,
        o_ptr + b * stride_ob + pos * stride_ol,
        x_ptr + b * stride_xb + pos * stride_xl,
        q_ptr + row * (D + N),
    )


@jit
def _attention_act_quant_rows_kernel(
    o_ptr,  # (B, L, H, HD) attention heads, strides (stride_ob, stride_ol, stride_oh, 1)
    x_ptr,  # (B, L, N) pre-activation, or (B, L, 2N) [gate | up] for SwiGLU; strides (stride_xb, stride_xl, 1)
    q_ptr,  # (B, L, D + N) uint8 (e4m3 bits), contiguous
    scale_ptr,  # (B * L,) fp32 row scales (written)
    L,
    D,  # H * HD
    N,
    HD,
    stride_ob,
    stride_ol,
    stride_oh,
    stride_xb,
    stride_xl,
    ACT: tl.constexpr,  # 1 tanh-GELU, 2 SwiGLU (fp8.ACTS)
    BLOCK: tl.constexpr,
    GPU: tl.constexpr,
    HW_E4M3: tl.constexpr,  # e4m3_code's hardware conversion (triton_utils.e4m3_consts)
    BETA: tl.constexpr,
    KAPPA: tl.constexpr,
    MAX_SHORTCUT: tl.constexpr,  # tanh-GELU only: the first sweep takes max(x), not |GELU(x)|
    GELU_BOUND: tl.constexpr,  # with MAX_SHORTCUT: `gelu_amax_bound`, the largest |GELU| of a negative input
):
    # grid: (L, B); one row per program: its absmax over both halves, then its codes
    DTYPE = x_ptr.dtype.element_ty
    row, o_row, x_row, q_row = _row_pointers(
        o_ptr, x_ptr, q_ptr, L, D, N, stride_ob, stride_ol, stride_xb, stride_xl
    )
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, D, BLOCK):
        cols = c0 + offs
        mask = cols < D
        y = upcast(tl.load(o_row + (cols // HD) * stride_oh + cols % HD, mask=mask, other=0.0), GPU)
        amax = tl.maximum(amax, tl.where(mask, tl.abs(y), 0.0))
    amax = _act_absmax(amax, x_row, offs, N, ACT, DTYPE, BLOCK, GPU, BETA, KAPPA, MAX_SHORTCUT, GELU_BOUND)
    s, inv = e4m3_row_scale(tl.max(amax, axis=0))
    tl.store(scale_ptr + row, s)
    for c0 in range(0, D, BLOCK):
        cols = c0 + offs
        mask = cols < D
        y = upcast(tl.load(o_row + (cols // HD) * stride_oh + cols % HD, mask=mask, other=0.0), GPU)
        tl.store(q_row + cols, e4m3_code(y * inv, HW_E4M3), mask=mask)
    for c0 in range(0, N, BLOCK):
        cols = c0 + offs
        mask = cols < N
        y = _act_value(x_row, cols, mask, N, ACT, DTYPE, GPU, BETA, KAPPA)
        tl.store(q_row + D + cols, e4m3_code(y * inv, HW_E4M3), mask=mask)


# The tile of `attention_act_quantize_triton` by output row width (H200, kernel_check --tune, 4 warps): rows up to
# NARROW_ROW values sweep faster in 1024-wide tiles (klein-4B's 12288: 153.5 us against 179.0; FLUX.1's 15360:
# 202.8 against 211.0), wider ones in 2048-wide tiles (FLUX.2 [dev]'s 24576: 289.1 against 295.8; klein-9B's
# 16384: 195.4 against 201.4).
NARROW_ROW, NARROW_BLOCK, WIDE_BLOCK = 15360, 1024, 2048


def attention_act_quantize_triton(
    o: Tensor,
    x: Tensor,
    act: str,
    *,
    block: int | None = None,
    num_warps: int = 4,
    gelu_shortcut: bool | None = None,
) -> Fp8Act:
    """Fused `attention_act_quantize_reference`: `o` (B, L, H, Dh) with a unit last stride (SDPA's heads as
    they come out), `x` (B, L, M or 2M) with a unit last stride (a column slice of `linear1`'s output).

    Each row is swept twice in `block`-wide tiles (None: chosen by the row's width, see `NARROW_ROW`), one
    program of `num_warps` warps per row (grid (L, B)): its absmax, then its codes, re-reading the inputs.
    The tile and warp count change the time, not the bits (a max is exact in any order; `kernel_check.py --op
    attention_act_fp8 --tune` times the alternatives).
    For tanh-GELU with `gelu_shortcut` (None: `gelu.set_gelu_shortcut`'s setting, on by default; and `gelu_amax_bound` established for the dtype and device) the first
    sweep reads the row's maximum instead of evaluating GELU, falling back to the GELU sweep per row where
    the maximum is small; the bits are the same either way (`gelu_shortcut=False` is the two-GELU path, kept
    for comparison: `kernel_check.py --op attention_act_fp8` times both).
    Two alternatives measured slower on an H200 at every FLUX shape and were dropped: holding the whole row on
    chip and reading it once (FLUX.2 [dev]: 1.66 ms against 0.29; the 24576-value tile spills), and a
    persistent launch of 2, 4 or 8 programs per SM taking a row at a time (FLUX.2 [dev]: 0.49 / 0.36 /
    0.37 ms against 0.29; the whole FP8 step 303 / 300 / 299 ms against 297)."""
    op = f"attention_{act}_fp8"
    if act not in ATTENTION_ACTS:
        raise ValueError(
            f"attention_act_quantize: unknown activation {act!r}; expected one of {ATTENTION_ACTS}"
        )
    check_inputs(op, o=o, x=x)
    if o.ndim != 4 or x.ndim != 3 or o.shape[:2] != x.shape[:2]:
        raise UnsupportedInput(
            f"{op}: needs o (B, L, H, Dh) and x (B, L, K), got {tuple(o.shape)}, {tuple(x.shape)}"
        )
    if o.stride(-1) != 1 or x.stride(-1) != 1:
        raise UnsupportedInput(f"{op}: the last dimensions must be contiguous")
    if x.numel() == 0 or o.numel() == 0:
        raise UnsupportedInput(f"{op}: empty input")
    b, length, heads, hd = o.shape
    d = heads * hd
    n = x.shape[-1] // 2 if act == "swiglu" else x.shape[-1]
    q = torch.empty(b, length, d + n, dtype=torch.uint8, device=x.device)
    if block is None:
        block = NARROW_BLOCK if d + n <= NARROW_ROW else WIDE_BLOCK
    for name, t in (("o", o), ("x", x), ("out", q)):
        check_int32_offsets(op, name, t)
    row_scale = torch.empty(b * length, dtype=torch.float32, device=x.device)
    args = (o, x, q, row_scale, length, d, n, hd, o.stride(0), o.stride(1), o.stride(2), x.stride(0), x.stride(1))  # fmt: skip
    consts = dict(ACT=ACTS[act], BETA=K_BETA, KAPPA=K_KAPPA, **EXACT)
    consts |= e4m3_consts(x.device)
    consts |= shortcut_consts(x.dtype, x.device, gelu_shortcut if act == "gelu_tanh" else False)
    _attention_act_quant_rows_kernel[(length, b)](*args, BLOCK=block, num_warps=num_warps, **consts)
    return Fp8Act(q.view(E4M3), row_scale.view(b, length, 1))


_ATTENTION_ACT_FP8 = FusedOp(
    "attention_act_fp8", fused=attention_act_quantize_triton, reference=attention_act_quantize_reference
)


def attention_act_fp8(o: Tensor, x: Tensor, act: str) -> Fp8Act:
    """The single block's `linear2` input `[heads | act(x)]` in e4m3 with per-row scales (see the module)."""
    return run_op(_ATTENTION_ACT_FP8, o, x, act)
