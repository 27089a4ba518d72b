"""Gated residual `residual + gate * update`.

Eager runs two bf16 ops: the gated product (rounded), then the sum (rounded). The fused kernel keeps
both roundings (lossless), reading residual and update once and writing the sum once.
"""

from __future__ import annotations

from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, run_op
from flux_runtime.kernels.launch import (
    EXACT,
    check_bld,
    check_half,
    check_launchable,
    check_strided,
    empty_out,
    row_tiles,
)
from flux_runtime.kernels.triton_utils import batch_row_tile, jit, round_to, tl, to_storage, triton, upcast


@jit
def _gated_residual_kernel(
    res_ptr,  # (B, L, D), strides (stride_rb, stride_rl, 1)
    gate_ptr,  # (B, D), strides (stride_gate, 1)
    upd_ptr,  # (B, L, D), strides (stride_ub, stride_ul, 1)
    out_ptr,  # (B, L, D) contiguous
    L,
    D,
    stride_rb,
    stride_rl,
    stride_gate,
    stride_ub,
    stride_ul,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GPU: tl.constexpr,
):
    # grid: (cdiv(L, BLOCK_L), cdiv(D, BLOCK_D), B)
    DTYPE = out_ptr.dtype.element_ty
    b, rows, cols, col_ok, mask = batch_row_tile(L, D, BLOCK_L, BLOCK_D)

    gate = upcast(tl.load(gate_ptr + b * stride_gate + cols, mask=col_ok, other=0.0), GPU)
    res = tl.load(res_ptr + b * stride_rb + rows[:, None] * stride_rl + cols[None, :], mask=mask, other=0.0)
    upd = tl.load(upd_ptr + b * stride_ub + rows[:, None] * stride_ul + cols[None, :], mask=mask, other=0.0)
    prod = round_to(gate[None, :] * upcast(upd, GPU), DTYPE, GPU)  # r(gate * update)
    out = to_storage(upcast(res, GPU) + prod, DTYPE, GPU)  # r(residual + prod)
    tl.store(out_ptr + (b * L + rows[:, None]) * D + cols[None, :], out, mask=mask)


def check_gated_residual(op: str, residual: Tensor, gate: Tensor, update: Tensor) -> tuple[int, int, int]:
    """Guards shared with the deferred-residual norm: returns (B, L, D)."""
    check_half(op, residual=residual, gate=gate, update=update)
    b, length, d = check_bld(op, "residual", residual)
    check_strided(op, (b, length, d), update=update)
    check_strided(op, (b, d), gate=gate)
    return b, length, d


def gated_residual_triton(
    residual: Tensor, gate: Tensor, update: Tensor, *, block_l: int = 4, block_d: int = 1024
) -> Tensor:
    """Fused `gated_residual_reference`: residual/update (B, L, D), gate (B, D) → (B, L, D)."""
    op = "gated_residual"
    check_launchable(op, residual, gate, update)
    b, length, d = check_gated_residual(op, residual, gate, update)
    out = empty_out(op, (b, length, d), residual)
    block_d = min(block_d, triton.next_power_of_2(d))
    _gated_residual_kernel[row_tiles(b, length, d, block_l, block_d)](
        residual, gate, update, out, length, d,
        residual.stride(0), residual.stride(1), gate.stride(0), update.stride(0), update.stride(1),
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4, **EXACT,
    )  # fmt: skip
    return out


def gated_residual_reference(residual: Tensor, gate: Tensor, update: Tensor) -> Tensor:
    """`residual + gate[:, None] * update` for `residual`, `update` (B, L, D) and `gate` (B, D)."""
    return residual + gate.unsqueeze(1) * update


_GATED_RESIDUAL = FusedOp("gated_residual", fused=gated_residual_triton, reference=gated_residual_reference)


def gated_residual(residual: Tensor, gate: Tensor, update: Tensor) -> Tensor:
    """Gated residual add; see `gated_residual_reference` for the exact semantics (fused when allowed)."""
    return run_op(_GATED_RESIDUAL, residual, gate, update)
