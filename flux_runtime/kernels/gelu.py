"""tanh-approximated GELU over the feed-forward intermediate.

aten's CUDA functor, which the fused kernel copies expression for expression (nvcc contracts only
`x + kKappa * x_cube` into an FMA; `tanhf` is libdevice's accurate `__nv_tanhf`)::

    x_cube = x * x * x
    inner = kBeta * (x + kKappa * x_cube)
    out = 0.5 * x * (1 + tanhf(inner))      # in fp32, one rounding to bf16/fp16

A unary function of a 16-bit input can be checked exhaustively: the first verification per
signature also compares all 65,536 inputs of the dtype against aten on the same device.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, run_op
from flux_runtime.kernels.launch import EXACT, check_int32_offsets, check_into, launch_rows, rows_pair
from flux_runtime.kernels.triton_utils import (
    HAS_TRITON,
    jit,
    row_tile,
    temporarily,
    tl,
    to_storage,
    triton,
    upcast,
)

if HAS_TRITON:
    from triton.language.extra import libdevice

# aten: `constexpr opmath_t kBeta = M_SQRT2 * M_2_SQRTPI * opmath_t(0.5)`, computed in double and
# rounded once to float (Triton rounds these Python floats to fp32 the same way).
K_BETA = 1.4142135623730951 * 1.1283791670955126 * 0.5  # M_SQRT2 * M_2_SQRTPI * 0.5 in double
K_KAPPA = 0.044715


@jit
def _tanhf_emulated(x):
    """libdevice `__nv_tanhf` for the interpreter: the same branches, constants and FMAs, with
    `exp2` and `1 / d` standing in for the `ex2.approx` / `rcp.approx` hardware instructions.

    Constants are libdevice's fp32 values (printed exactly). Only CPU CI runs this; the GPU calls
    libdevice's `__nv_tanhf` itself, the device `tanhf` that aten's functor calls. That the two
    builds agree (Triton's bundled libdevice vs the CUDA that built torch) is what the exhaustive GPU
    test and the first-use check establish.
    """
    a = tl.abs(x)
    # |x| >= 0.6: 1 - 2 / (exp(2|x|) + 1), saturating to 1 from 9.0109
    e = tl.exp2(a * 2.885390043258667)
    r = 1.0 / (1.0 + e)
    big = tl.fma(r, -2.0, 1.0)
    big = tl.where(a >= 9.010913848876953, 1.0, big)
    big_bits = big.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)
    big = big_bits.to(tl.float32, bitcast=True)
    # |x| < 0.6: odd polynomial
    x2 = x * x
    p = tl.fma(0.01573968306183815, x2, -0.05230396240949631)
    p = tl.fma(p, x2, 0.13315297663211823)
    p = tl.fma(p, x2, -0.33332768082618713)
    p = tl.fma(p, x2, 0.0)
    small = tl.fma(p, x, x)
    return tl.where(a >= 0.6000000238418579, big, small)


@jit
def _gelu_tanh(x, K_BETA: tl.constexpr, K_KAPPA: tl.constexpr, GPU: tl.constexpr):
    """aten's tanh-GELU functor on fp32 `x` (before the one rounding)."""
    x_cube = x * x * x
    inner = K_BETA * tl.fma(K_KAPPA, x_cube, x)  # nvcc: fma(kKappa, x_cube, x)
    if GPU:  # noqa: SIM108 (a constexpr branch: the interpreter has no libdevice)
        t = libdevice.tanh(inner)
    else:
        t = _tanhf_emulated(inner)
    return 0.5 * x * (1.0 + t)


@jit
def _gelu_tanh_kernel(
    x_ptr,  # (N,) contiguous
    out_ptr,  # (N,) contiguous
    N,
    K_BETA: tl.constexpr,
    K_KAPPA: tl.constexpr,
    BLOCK: tl.constexpr,
    GPU: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK),)
    DTYPE = out_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), GPU)
    out = _gelu_tanh(x, K_BETA, K_KAPPA, GPU)
    tl.store(out_ptr + offs, to_storage(out, DTYPE, GPU), mask=mask)


@jit
def _gelu_tanh_rows_kernel(
    x_ptr,  # (B, L, N), strides (stride_xb, stride_xl, 1)
    out_ptr,  # (B, L, N), strides (stride_ob, stride_ol, 1): e.g. a column slice of a wider buffer
    L,
    N,
    stride_xb,
    stride_xl,
    stride_ob,
    stride_ol,
    K_BETA: tl.constexpr,
    K_KAPPA: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GPU: tl.constexpr,
):
    # grid: (cdiv(L, BLOCK_L), cdiv(N, BLOCK_N), B)
    DTYPE = out_ptr.dtype.element_ty
    b, rows, cols, mask = row_tile(L, N, BLOCK_L, BLOCK_N)
    x = tl.load(x_ptr + b * stride_xb + rows[:, None] * stride_xl + cols[None, :], mask=mask, other=0.0)
    out = _gelu_tanh(upcast(x, GPU), K_BETA, K_KAPPA, GPU)
    out_ptrs = out_ptr + b * stride_ob + rows[:, None] * stride_ol + cols[None, :]
    tl.store(out_ptrs, to_storage(out, DTYPE, GPU), mask=mask)


def gelu_tanh_triton(
    x: Tensor, out: Tensor | None = None, *, block: int = 4096, block_l: int = 4, block_n: int = 1024
) -> Tensor:
    """Fused `gelu_tanh_reference` for a bf16/fp16 tensor of any shape, into `out` if given.

    A contiguous input and a fresh output run the flat kernel (`block` elements per program); a
    strided input or `out` (unit last stride, e.g. `h[..., D:]`) the row kernel (`block_l` x `block_n`).
    """
    op = "gelu_tanh"
    check_into(op, x, out, tuple(x.shape))
    consts = {"K_BETA": K_BETA, "K_KAPPA": K_KAPPA, "num_warps": 8}
    if x.is_contiguous() and (out is None or out.is_contiguous()):
        check_int32_offsets(op, "x", x)
        result = torch.empty_like(x) if out is None else out
        n = x.numel()
        _gelu_tanh_kernel[(triton.cdiv(n, block),)](x, result, n, BLOCK=block, **EXACT, **consts)
        return result
    result = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    launch_rows(_gelu_tanh_rows_kernel, *rows_pair(op, x, result), x.shape[-1], block_l, block_n, **consts)
    return result


def all_half_values(dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """Every 16-bit pattern of `dtype` (65,536 values, NaNs and infinities included)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device).to(torch.int16)
    return bits.view(dtype)


def all_values_difference(values: Tensor, fused: Tensor, ref: Tensor, what: str = "") -> str | None:
    """None if `fused` equals `ref` (NaN where it is NaN), a unary function's two results at all 65,536 16-bit
    `values` (`all_half_values`); else a description, prefixed by `what`."""
    same = (fused == ref) | (fused.isnan() & ref.isnan())
    if bool(same.all()):
        return None
    bad = values[~same]
    return f"{what}{bad.numel()} of 65536 {values.dtype} inputs differ, e.g. x={bad[:4].float().tolist()}"


def exhaustive_check(x: Tensor, out: Tensor | None = None) -> str | None:
    """None if the fused GELU equals aten's on all 65,536 inputs of `x.dtype`, else a description."""
    values = all_half_values(x.dtype, x.device)
    return all_values_difference(values, gelu_tanh_triton(values), gelu_tanh_reference(values))


def gelu_tanh_reference(x: Tensor, out: Tensor | None = None) -> Tensor:
    """`F.gelu(x, approximate="tanh")`: one rounding per element; copied into `out` if given."""
    y = F.gelu(x, approximate="tanh")
    return y if out is None else out.copy_(y)


_GELU_TANH = FusedOp(
    "gelu_tanh",
    fused=gelu_tanh_triton,
    reference=gelu_tanh_reference,
    self_check=exhaustive_check,
)


def gelu_tanh(x: Tensor, out: Tensor | None = None) -> Tensor:
    """tanh-GELU; see `gelu_tanh_reference` (fused when `dispatch` allows).

    `out`: optional preallocated tensor of x's shape and dtype with unit last stride (e.g. the right
    column slice `h[..., D:]` of the single block's `[attn | mlp]` buffer); it is written and returned.
    """
    if out is None:
        return run_op(_GELU_TANH, x)
    return run_op(_GELU_TANH, x, out)


# --------------------------------------------------------------------------------------------------
# the row-absmax shortcut of the per-row e4m3 producers (fp8.act_quantize_triton, attention_act_fp8)


def monotone_bound(values: Tensor, g: Tensor) -> float | None:
    """B = the largest |g(x)| over the negative finite `values`, if g is an activation table (`g[i]` the
    16-bit activation of `values[i]`) that is >= 0 and non-decreasing over the non-negative inputs in value
    order (+inf included); None if it is not, or if g is NaN at a negative finite input.

    With both, a row's largest |g| is g(m) at its largest input m whenever g(m) >= B: every input x <= m that
    is >= 0 has 0 <= g(x) <= g(m), every negative finite one |g(x)| <= B <= g(m), and -inf (g NaN) is skipped
    by the kernel's max as it is in the full sweep. That is exact, not an approximation: g(m) is one of the
    row's own activation values, and a max selects a value without rounding it."""
    x, g = values.float(), g.float()
    nonneg = x >= 0  # -0.0 included, NaN excluded
    order = torch.argsort(x[nonneg], stable=True)
    up = g[nonneg][order]
    if not bool((up >= 0).all()) or not bool((up[1:] >= up[:-1]).all()):  # a NaN fails both
        return None
    below = g[(x < 0) & x.isfinite()].abs()
    if below.numel() == 0:
        return 0.0
    if not bool(below.isfinite().all()):
        return None
    return float(below.max())


_GELU_BOUNDS: dict[tuple[torch.device, torch.dtype], float | None] = {}
_SHORTCUT = {"gelu": True}  # the default `gelu_shortcut=` of the per-row producers (see `shortcut_consts`)


def set_gelu_shortcut(on: bool) -> bool:
    """Whether the per-row tanh-GELU e4m3 producers that sweep a row twice (`attention_act_fp8`, and
    `fp8.act_quantize_triton` in column blocks) take the row max shortcut by default: on, unless a benchmark
    times the two-GELU path inside a whole step (`scripts/bench_fp8.py`); the bits are the same either way.
    Returns the setting it replaced."""
    previous, _SHORTCUT["gelu"] = _SHORTCUT["gelu"], bool(on)
    return previous


def gelu_shortcut(on: bool) -> AbstractContextManager[None]:
    """`set_gelu_shortcut(on)` for the body, the previous setting restored after it."""
    return temporarily(set_gelu_shortcut, on)


def gelu_amax_bound(dtype: torch.dtype, device: torch.device) -> float | None:
    """`monotone_bound` of the kernels' own tanh-GELU (`gelu_tanh_triton`, the same `_gelu_tanh` and rounding
    the producers evaluate) over all 65,536 inputs of `dtype` on `device`, computed once per (device, dtype):
    about 0.17 for bf16 and fp16, or None where the property fails (the producers then evaluate GELU in both
    sweeps). It is established on the device itself because libdevice's `tanhf` (and, on the CPU, its
    emulation) is what g is made of: no property of the exact GELU is assumed.

    None without caching while a CUDA graph is being captured (the check syncs; the two-GELU path runs)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    if key not in _GELU_BOUNDS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        values = all_half_values(dtype, device)
        _GELU_BOUNDS[key] = monotone_bound(values, gelu_tanh_triton(values))
    return _GELU_BOUNDS[key]


def shortcut_consts(dtype: torch.dtype, device: torch.device, use: bool | None) -> dict[str, object]:
    """The `MAX_SHORTCUT` / `GELU_BOUND` constexprs of a per-row tanh-GELU producer's launch: the shortcut when
    `use` (None: `set_gelu_shortcut`'s setting) and `gelu_amax_bound` holds for `dtype` on `device`."""
    bound = gelu_amax_bound(dtype, device) if (_SHORTCUT["gelu"] if use is None else use) else None
    return {"MAX_SHORTCUT": bound is not None, "GELU_BOUND": 0.0 if bound is None else bound}
