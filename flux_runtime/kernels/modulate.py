"""adaLN modulate `y * (1 + scale) + shift`.

Eager runs three bf16 ops, each rounding once: `1 + scale`, the product, the sum. The fused kernel
does the same three roundings in one pass over `y` (lossless: one rounding per eager op, Python scalars do not widen, no FMA across ops).
"""

from __future__ import annotations

from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, run_op
from flux_runtime.kernels.launch import EXACT, check_bld, check_inputs, check_strided, empty_out, row_tiles
from flux_runtime.kernels.triton_utils import batch_row_tile, jit, round_to, tl, to_storage, triton, upcast


@jit
def _modulate_kernel(
    y_ptr,  # (B, L, D), strides (stride_yb, stride_yl, 1)
    shift_ptr,  # (B, D), strides (stride_shift, 1)
    scale_ptr,  # (B, D), strides (stride_scale, 1)
    out_ptr,  # (B, L, D) contiguous
    L,
    D,
    stride_yb,
    stride_yl,
    stride_shift,
    stride_scale,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GPU: tl.constexpr,
):
    # grid: (cdiv(L, BLOCK_L), cdiv(D, BLOCK_D), B)
    DTYPE = out_ptr.dtype.element_ty
    b, rows, cols, col_ok, mask = batch_row_tile(L, D, BLOCK_L, BLOCK_D)

    scale = upcast(tl.load(scale_ptr + b * stride_scale + cols, mask=col_ok, other=0.0), GPU)
    shift = upcast(tl.load(shift_ptr + b * stride_shift + cols, mask=col_ok, other=0.0), GPU)
    scale1 = round_to(1.0 + scale, DTYPE, GPU)  # r(1 + scale)

    y = tl.load(y_ptr + b * stride_yb + rows[:, None] * stride_yl + cols[None, :], mask=mask, other=0.0)
    prod = round_to(upcast(y, GPU) * scale1[None, :], DTYPE, GPU)  # r(y * r(1 + scale))
    out = to_storage(prod + shift[None, :], DTYPE, GPU)  # r(prod + shift)
    tl.store(out_ptr + (b * L + rows[:, None]) * D + cols[None, :], out, mask=mask)


def modulate_triton(
    y: Tensor, shift: Tensor, scale: Tensor, *, block_l: int = 4, block_d: int = 1024
) -> Tensor:
    """Fused `modulate_reference`: y (B, L, D), shift/scale (B, D) with unit last stride → (B, L, D)."""
    op = "modulate"
    check_inputs(op, y=y, shift=shift, scale=scale)
    b, length, d = check_bld(op, "y", y)
    check_strided(op, (b, d), shift=shift, scale=scale)
    out = empty_out(op, (b, length, d), y)
    block_d = min(block_d, triton.next_power_of_2(d))
    _modulate_kernel[row_tiles(b, length, d, block_l, block_d)](
        y, shift, scale, out, length, d, y.stride(0), y.stride(1), shift.stride(0), scale.stride(0),
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4, **EXACT,
    )  # fmt: skip
    return out


def modulate_reference(y: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """Modulate `y` (B, L, D) by per-batch `shift`, `scale` (B, D), as diffusers does."""
    return y * (1 + scale[:, None]) + shift[:, None]


_MODULATE = FusedOp("modulate", fused=modulate_triton, reference=modulate_reference)


def modulate(y: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN modulate; see `modulate_reference` for the exact semantics (fused when `dispatch` allows)."""
    return run_op(_MODULATE, y, shift, scale)
