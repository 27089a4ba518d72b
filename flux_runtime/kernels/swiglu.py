"""SwiGLU over FLUX.2's fused feed-forward intermediate: `silu(gate) * up`.

FLUX.2 projects to `[gate | up]` (2 * M wide) in one GEMM (`img_mlp.0`, the MLP part of `linear1`)
and halves it here. Eager runs two ops on views of that GEMM output, each rounding once in the
input dtype: SiLU of the first half, then the product with the second half. The fused kernel reads
both halves once and writes the product once, keeping both roundings (lossless):

    s = r(x / (1 + expf(-x)))     # aten's silu functor in fp32: libdevice `__nv_expf`, IEEE division
    out = r(s * up)

The input may be a strided view (the single blocks' `[gate | up]` is a column slice of the packed
`linear1` output, row stride 3D + 2M); `out=` writes into a preallocated view instead (the right
column slice of the `[attn | mlp]` buffer). A unary function of a 16-bit input can be checked
exhaustively: the first verification per signature also compares the fused SiLU with aten's on all
65,536 inputs of the dtype on the same device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.gelu import all_half_values
from flux_runtime.kernels.triton_utils import (
    HAS_TRITON,
    ON_GPU,
    as_rows,
    check_half,
    check_int32_offsets,
    check_launchable,
    check_no_overlap,
    check_out,
    jit,
    round_to,
    tl,
    to_storage,
    triton,
    upcast,
)

if HAS_TRITON:
    from triton.language.extra import libdevice


@jit
def _silu(x, GPU: tl.constexpr):
    """aten's `x / (1 + exp(-x))` in fp32: libdevice `expf`, correctly rounded division."""
    if GPU:  # noqa: SIM108 (a constexpr branch: the interpreter has no libdevice)
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(x, 1.0 + e)


@jit
def _swiglu_kernel(
    x_ptr,  # (B, L, 2M), strides (stride_xb, stride_xl, 1): [gate | up]
    out_ptr,  # (B, L, M), strides (stride_ob, stride_ol, 1)
    L,
    M,
    stride_xb,
    stride_xl,
    stride_ob,
    stride_ol,
    BLOCK_L: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GPU: tl.constexpr,
):
    # grid: (cdiv(L, BLOCK_L), cdiv(M, BLOCK_M), B)
    DTYPE = out_ptr.dtype.element_ty
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < L)[:, None] & (cols < M)[None, :]
    gate_ptr = x_ptr + b * stride_xb + rows[:, None] * stride_xl + cols[None, :]
    gate = upcast(tl.load(gate_ptr, mask=mask, other=0.0), GPU)
    up = upcast(tl.load(gate_ptr + M, mask=mask, other=0.0), GPU)
    s = round_to(_silu(gate, GPU), DTYPE, GPU)  # r(silu(gate)), stored by eager's first op
    out = to_storage(s * up, DTYPE, GPU)  # r(s * up)
    tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_ol + cols[None, :], out, mask=mask)


def swiglu_triton(x: Tensor, out: Tensor | None = None, *, block_l: int = 4, block_m: int = 1024) -> Tensor:
    """Fused `swiglu_reference`: x (..., 2M) with unit last stride → (..., M), into `out` if given."""
    op = "swiglu"
    tensors = (x,) if out is None else (x, out)
    check_launchable(op, *tensors)
    check_half(op, **({"x": x} if out is None else {"x": x, "out": out}))
    if x.ndim == 0 or x.numel() == 0:
        raise UnsupportedInput(f"{op}: empty input {tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise UnsupportedInput(f"{op}: expected an even last dim ([gate | up]), got {x.shape[-1]}")
    m = x.shape[-1] // 2
    shape = (*x.shape[:-1], m)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        check_out(op, out, shape)
        check_no_overlap(op, x, out)
    x3, out3 = as_rows(op, "x", x), as_rows(op, "out", out)
    check_int32_offsets(op, "x", x3)
    check_int32_offsets(op, "out", out3)
    b, length, _ = x3.shape
    grid = (triton.cdiv(length, block_l), triton.cdiv(m, block_m), b)
    _swiglu_kernel[grid](
        x3, out3, length, m, x3.stride(0), x3.stride(1), out3.stride(0), out3.stride(1),
        BLOCK_L=block_l, BLOCK_M=block_m, GPU=ON_GPU, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def silu_exhaustive_check(x: Tensor, out: Tensor | None = None) -> str | None:
    """None if the fused SiLU equals aten's on all 65,536 inputs of `x.dtype`, else a description.

    The kernel computes `r(r(silu(gate)) * 1)` for `[gate | 1]`, which is `r(silu(gate))` exactly.
    """
    values = all_half_values(x.dtype, x.device)
    fused = swiglu_triton(torch.cat([values, torch.ones_like(values)]))  # one row [gate | up]
    ref = F.silu(values)
    same = (fused == ref) | (fused.isnan() & ref.isnan())
    if bool(same.all()):
        return None
    bad = values[~same]
    return f"silu: {bad.numel()} of 65536 {x.dtype} inputs differ, e.g. x={bad[:4].float().tolist()}"


def swiglu_reference(x: Tensor, out: Tensor | None = None) -> Tensor:
    """`silu(x[..., :M]) * x[..., M:]` for `x` (..., 2M): gate first, as BFL and diffusers store it.

    With `out`, the result is copied into it (any strides) and `out` is returned.
    """
    half = x.shape[-1] // 2
    y = F.silu(x[..., :half]) * x[..., half:]
    return y if out is None else out.copy_(y)


_SWIGLU = FusedOp("swiglu", fused=swiglu_triton, reference=swiglu_reference, self_check=silu_exhaustive_check)


def swiglu(x: Tensor, out: Tensor | None = None) -> Tensor:
    """SwiGLU of `x` (..., 2M) → (..., M); see `swiglu_reference` (fused when `dispatch` allows).

    `out`: optional preallocated (..., M) tensor of x's dtype with unit last stride (e.g. the right
    column slice `h[..., D:]` of the single block's `[attn | mlp]` buffer); it is written and returned.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu: expected an even last dim ([gate | up]), got {x.shape[-1]}")
    if out is None:
        return run_op(_SWIGLU, x)
    return run_op(_SWIGLU, x, out)
