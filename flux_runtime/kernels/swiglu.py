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
from flux_runtime.kernels.gelu import all_half_values, all_values_difference
from flux_runtime.kernels.launch import check_into, launch_rows, rows_pair
from flux_runtime.kernels.triton_utils import HAS_TRITON, jit, round_to, row_tile, tl, to_storage, upcast

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
    x_ptr,  # (B, L, 2N), strides (stride_xb, stride_xl, 1): [gate | up]
    out_ptr,  # (B, L, N), strides (stride_ob, stride_ol, 1)
    L,
    N,
    stride_xb,
    stride_xl,
    stride_ob,
    stride_ol,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GPU: tl.constexpr,
):
    # grid: (cdiv(L, BLOCK_L), cdiv(N, BLOCK_N), B)
    DTYPE = out_ptr.dtype.element_ty
    b, rows, cols, mask = row_tile(L, N, BLOCK_L, BLOCK_N)
    gate_ptr = x_ptr + b * stride_xb + rows[:, None] * stride_xl + cols[None, :]
    gate = upcast(tl.load(gate_ptr, mask=mask, other=0.0), GPU)
    up = upcast(tl.load(gate_ptr + N, mask=mask, other=0.0), GPU)
    s = round_to(_silu(gate, GPU), DTYPE, GPU)  # r(silu(gate)), stored by eager's first op
    out = to_storage(s * up, DTYPE, GPU)  # r(s * up)
    tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_ol + cols[None, :], out, mask=mask)


def swiglu_triton(x: Tensor, out: Tensor | None = None, *, block_l: int = 4, block_m: int = 1024) -> Tensor:
    """Fused `swiglu_reference`: x (..., 2M) with unit last stride → (..., M), into `out` if given."""
    op = "swiglu"
    if x.ndim == 0 or x.shape[-1] % 2:
        raise UnsupportedInput(f"{op}: expected an even last dim ([gate | up]), got shape {tuple(x.shape)}")
    m = x.shape[-1] // 2
    shape = (*x.shape[:-1], m)
    check_into(op, x, out, shape)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    launch_rows(_swiglu_kernel, *rows_pair(op, x, out), m, block_l, block_m, num_warps=8)
    return out


def silu_exhaustive_check(x: Tensor, out: Tensor | None = None) -> str | None:
    """None if the fused SiLU equals aten's on all 65,536 inputs of `x.dtype`, else a description.

    The kernel computes `r(r(silu(gate)) * 1)` for `[gate | 1]`, which is `r(silu(gate))` exactly.
    """
    values = all_half_values(x.dtype, x.device)
    fused = swiglu_triton(torch.cat([values, torch.ones_like(values)]))  # one row [gate | up]
    return all_values_difference(values, fused, F.silu(values), "silu: ")


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
