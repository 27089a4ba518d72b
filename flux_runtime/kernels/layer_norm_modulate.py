"""LayerNorm (no affine) followed by adaLN modulate, and its deferred-residual form.

`residual_layer_norm_modulate` first materialises a pending gated residual `r + g * u` and then
normalises the result: one pass over the row in a fused kernel, two eager chains in the reference.

The fused kernel is lossless because it replays aten's `vectorized_layer_norm_kernel` (bf16/fp16,
`D % 4 == 0`, aligned) operation for operation: a row is read by
128 threads (4 warps × 32 lanes), thread t pushing the 4 elements of vectors t, t+128, ... through
Welford in order (`mean = fma(delta, 1/count, mean)`, `m2 = fma(delta, x - mean, m2)`, correctly
rounded reciprocals); lanes fold by shuffle-down 16…1, warps by (0,2),(1,3) then (0,1), each step
`cuWelfordCombine(self = lower, other = upper)` with nvcc's two FMAs; `var = m2 / D` (div.rn),
`rstd = rsqrtf(var + eps)`, `y = r(rstd * (x - mean))`; then modulate's three roundings.
The 128 lanes are a tensor dimension here and the fold is reshape/permute/split, so the tree is
fixed by construction, whatever layout Triton picks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.fp8 import E4M3, Fp8Act, check_quant, quantize_reference
from flux_runtime.kernels.gated_residual import check_gated_residual, gated_residual_reference
from flux_runtime.kernels.launch import (
    EXACT,
    check_aten_vectorized,
    check_bld,
    check_half,
    check_launchable,
    check_strided,
    empty_out,
    triton_dtype,
)
from flux_runtime.kernels.modulate import modulate_reference
from flux_runtime.kernels.triton_utils import (
    e4m3_code,
    e4m3_consts,
    e4m3_row_scale,
    halves,
    jit,
    round_to,
    rsqrtf,
    split4,
    tl,
    to_storage,
    triton,
    upcast,
)

# Widest row fused: 16 unrolled vector loads per aten thread.
MAX_WIDTH = 8192
# Kernel used by the op: "v1" (one row per program, fold by reshape/split) or "v2" (rows in registers,
# fold by two-lane reductions; see `_layer_norm_modulate_rows_kernel`). Both are bit-identical.
VARIANTS = ("v1", "v2")
VARIANT = "v2"
_THREADS = 128  # aten's block: 32 lanes × 4 warps, one row per block
_VEC = 4  # aten's vec_size for every dtype


@jit
def _welford_push(mean, m2, count, x, valid, RCP: tl.constexpr, EVEN: tl.constexpr):
    """aten `cuWelfordOnlineSum` for one element per lane; RCP is 1/count when it is a constant."""
    delta = x - mean
    new_count = count + 1.0
    if EVEN:  # noqa: SIM108 (constexpr branch)
        rcp = RCP  # correctly rounded 1/new_count, the same for every lane
    else:
        rcp = tl.math.div_rn(tl.full(new_count.shape, 1.0, tl.float32), new_count)
    new_mean = tl.fma(delta, rcp, mean)
    new_m2 = tl.fma(delta, x - new_mean, m2)
    if not EVEN:
        new_mean = tl.where(valid, new_mean, mean)
        new_m2 = tl.where(valid, new_m2, m2)
        new_count = tl.where(valid, new_count, count)
    return new_mean, new_m2, new_count


@jit
def _welford_combine(mean_b, m2_b, n_b, mean_a, m2_a, n_a):
    """aten `cuWelfordCombine(dataB = self, dataA = other)` with the FMAs nvcc contracts it to."""
    delta = mean_b - mean_a
    count = n_a + n_b
    nonempty = count > 0.0
    coef = tl.math.div_rn(tl.full(count.shape, 1.0, tl.float32), tl.where(nonempty, count, 1.0))
    na = n_a * coef
    nb = n_b * coef
    mean = tl.fma(mean_a, na, nb * mean_b)  # nA * meanA + nB * meanB
    m2 = tl.fma(nb, n_a * (delta * delta), m2_a + m2_b)  # m2A + m2B + delta * delta * nA_count * nB
    return tl.where(nonempty, mean, 0.0), tl.where(nonempty, m2, 0.0), count


@jit
def _fold(mean, m2, count, R: tl.constexpr, W: tl.constexpr, K: tl.constexpr):
    """One shuffle-down step with offset K over lanes (R, W, 2K) → (R, W, K)."""
    mean_lo, mean_hi = halves(mean, R, W, K)
    m2_lo, m2_hi = halves(m2, R, W, K)
    n_lo, n_hi = halves(count, R, W, K)
    return _welford_combine(mean_lo, m2_lo, n_lo, mean_hi, m2_hi, n_hi)


@jit
def _load_row_vectors(
    x_ptr, gate_ptr, upd_ptr, r_out_ptr, row, b, x_off, u_off, col, mask, D, stride_gate,
    HAS_RESIDUAL: tl.constexpr, STORE_R: tl.constexpr, DTYPE: tl.constexpr, GPU: tl.constexpr,
):  # fmt: skip
    """The LayerNorm input at `col` (R, 128, 4) as fp32: x, or r = r(res + r(gate * update))."""
    x = upcast(tl.load(x_ptr + x_off[:, None, None] + col[None, :, :], mask=mask, other=0.0), GPU)
    if HAS_RESIDUAL:
        g = tl.load(gate_ptr + b[:, None, None] * stride_gate + col[None, :, :], mask=mask, other=0.0)
        u = tl.load(upd_ptr + u_off[:, None, None] + col[None, :, :], mask=mask, other=0.0)
        prod = round_to(upcast(g, GPU) * upcast(u, GPU), DTYPE, GPU)
        x = round_to(x + prod, DTYPE, GPU)
        if STORE_R:
            tl.store(
                r_out_ptr + row[:, None, None] * D + col[None, :, :], to_storage(x, DTYPE, GPU), mask=mask
            )
    return x


@jit
def _layer_norm_modulate_kernel(
    x_ptr,  # (B, L, D), strides (stride_xb, stride_xl, 1): LayerNorm input, or the residual (HAS_RESIDUAL)
    gate_ptr,  # (B, D), strides (stride_gate, 1): residual gate, read only when HAS_RESIDUAL
    upd_ptr,  # (B, L, D), strides (stride_ub, stride_ul, 1): residual update, read only when HAS_RESIDUAL
    shift_ptr,  # (B, D), strides (stride_shift, 1)
    scale_ptr,  # (B, D), strides (stride_scale, 1)
    r_out_ptr,  # (B, L, D) contiguous: r = residual + gate * update, written only when HAS_RESIDUAL
    y_out_ptr,  # (B, L, D) contiguous: LayerNorm(x or r) * (1 + scale) + shift
    M,  # B * L rows
    L,
    D,
    eps,
    stride_xb,
    stride_xl,
    stride_gate,
    stride_ub,
    stride_ul,
    stride_shift,
    stride_scale,
    ITERS: tl.constexpr,  # cdiv(D, 512): 4-element vectors each aten thread reads
    EVEN: tl.constexpr,  # D % 512 == 0: every thread reads ITERS vectors, all Welford counts constant
    ROWS: tl.constexpr,  # rows per program (one aten block each)
    HAS_RESIDUAL: tl.constexpr,
    GPU: tl.constexpr,
):
    # grid: (cdiv(M, ROWS),)
    DTYPE = y_out_ptr.dtype.element_ty
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < M
    row = tl.where(row_ok, row, 0)
    b = (row // L).to(tl.int64)
    l_idx = (row % L).to(tl.int64)
    x_off = b * stride_xb + l_idx * stride_xl
    u_off = b * stride_ub + l_idx * stride_ul
    lane = tl.arange(0, 128)  # aten's thrx = threadIdx.x + 32 * threadIdx.y
    c4 = tl.arange(0, 4)

    # statistics: each lane's Welford over its vectors, in aten's order
    mean = tl.zeros((ROWS, 128), tl.float32)
    m2 = tl.zeros((ROWS, 128), tl.float32)
    count = tl.zeros((ROWS, 128), tl.float32)
    for it in tl.static_range(ITERS):
        vec = it * 128 + lane
        col = vec[:, None] * 4 + c4[None, :]  # (128, 4)
        vec_ok = (vec < D // 4)[None, :]
        mask = row_ok[:, None, None] & vec_ok[:, :, None]
        x = _load_row_vectors(
            x_ptr, gate_ptr, upd_ptr, r_out_ptr, row, b, x_off, u_off, col, mask, D, stride_gate,
            HAS_RESIDUAL, True, DTYPE, GPU,
        )  # fmt: skip
        mean, m2, count = _welford_push4(mean, m2, count, tl.reshape(x, (ROWS, 128, 2, 2)), vec_ok, it, EVEN)

    # intra-warp shuffle-down 16, 8, 4, 2, 1, then warps (0,2),(1,3) and (0,1)
    mean = tl.reshape(mean, (ROWS, 4, 32))
    m2 = tl.reshape(m2, (ROWS, 4, 32))
    count = tl.reshape(count, (ROWS, 4, 32))
    mean, m2, count = _fold(mean, m2, count, ROWS, 4, 16)
    mean, m2, count = _fold(mean, m2, count, ROWS, 4, 8)
    mean, m2, count = _fold(mean, m2, count, ROWS, 4, 4)
    mean, m2, count = _fold(mean, m2, count, ROWS, 4, 2)
    mean, m2, count = _fold(mean, m2, count, ROWS, 4, 1)
    mean = tl.reshape(mean, (ROWS, 1, 4))
    m2 = tl.reshape(m2, (ROWS, 1, 4))
    count = tl.reshape(count, (ROWS, 1, 4))
    mean, m2, count = _fold(mean, m2, count, ROWS, 1, 2)
    mean, m2, count = _fold(mean, m2, count, ROWS, 1, 1)  # (ROWS, 1, 1)
    var = tl.math.div_rn(m2, tl.full(m2.shape, D, tl.float32))
    rstd = rsqrtf(var + eps, GPU)

    # normalise and modulate: r(r(r(rstd * (x - mean)) * r(1 + scale)) + shift)
    for it in tl.static_range(ITERS):
        vec = it * 128 + lane
        col = vec[:, None] * 4 + c4[None, :]
        mask = row_ok[:, None, None] & (vec < D // 4)[None, :, None]
        x = _load_row_vectors(
            x_ptr, gate_ptr, upd_ptr, r_out_ptr, row, b, x_off, u_off, col, mask, D, stride_gate,
            HAS_RESIDUAL, False, DTYPE, GPU,
        )  # fmt: skip
        ln = round_to(rstd * (x - mean), DTYPE, GPU)
        scale = tl.load(scale_ptr + b[:, None, None] * stride_scale + col[None, :, :], mask=mask, other=0.0)
        shift = tl.load(shift_ptr + b[:, None, None] * stride_shift + col[None, :, :], mask=mask, other=0.0)
        scale1 = round_to(1.0 + upcast(scale, GPU), DTYPE, GPU)
        prod = round_to(ln * scale1, DTYPE, GPU)
        y = to_storage(prod + upcast(shift, GPU), DTYPE, GPU)
        tl.store(y_out_ptr + row[:, None, None] * D + col[None, :, :], y, mask=mask)


# --------------------------------------------------------------------------------------------------
# v2: several rows per program held in registers, the fold as seven two-lane reductions
#
# The v1 kernel above folds with reshape/permute/split, which Triton 3.6 lowers by broadcasting all
# 128 lane states to every thread (its sm_90 SASS: ~1570 instructions per thread and 176 registers
# per row at D = 3072, so 2 blocks per SM; v2: ~940 per two rows, 96 registers, 5 blocks). Here
# the lane states of ROWS rows sit in a (128, ROWS) tensor: lanes across the 4 warps, rows in each
# thread's registers. Each step of aten's tree is a `tl.reduce` over one size-2 axis of the
# (2, 2, 2, 2, 2, 2, 2, ROWS) view (bits 6..0 of the lane index): lane bits 4, 3, 2, 1, 0 (shuffle
# offsets 16..1), then bit 6 (warps (0,2), (1,3)) and bit 5 (warps (0,1)). Triton lowers a lane-bit
# step to one butterfly shuffle and a warp-bit step to one shared-memory exchange. Which operand
# Triton hands the combine first is not specified, and a butterfly leaves every lane with a result,
# so the combine carries the lane index and picks aten's `self` (the lower lane) itself: every lane
# then holds the exact value aten's lane 0 holds. The row is read once (kept raw in registers for
# the second pass), every load is issued before the first store, and scale/shift/gate rows are read
# once per program and shared by its rows (grid (cdiv(L, ROWS), B): a program never spans batches).


@jit
def _welford_combine_lanes(mean_1, m2_1, n_1, lane_1, mean_2, m2_2, n_2, lane_2):
    """`cuWelfordCombine` of two lane states, the lower lane as aten's `self`, any operand order."""
    first = lane_1 < lane_2
    mean, m2, count = _welford_combine(
        tl.where(first, mean_1, mean_2), tl.where(first, m2_1, m2_2), tl.where(first, n_1, n_2),
        tl.where(first, mean_2, mean_1), tl.where(first, m2_2, m2_1), tl.where(first, n_2, n_1),
    )  # fmt: skip
    return mean, m2, count, tl.minimum(lane_1, lane_2)


@jit
def _welford_combine_lanes_even(mean_1, m2_1, n_1, lane_1, mean_2, m2_2, n_2, lane_2):
    """`_welford_combine_lanes` when both counts are equal (`D % 512 == 0`).

    With n_a = n_b = n, `coef = 1/(2n)` and `nA = nB = n * coef = 0.5` exactly (the launcher checks
    `fl(n * fl(1/n)) == 1` for the first count; scaling by 2 keeps it), so the combine is
    `mean = fma(mean_a, 0.5, 0.5 * mean_b)`, `m2 = fma(0.5, n * (delta * delta), m2_a + m2_b)`: the same
    operations on the same values as the general form, without the division.
    """
    first = lane_1 < lane_2
    mean_b = tl.where(first, mean_1, mean_2)  # self: the lower lane
    mean_a = tl.where(first, mean_2, mean_1)
    delta = mean_b - mean_a
    mean = tl.fma(mean_a, 0.5, 0.5 * mean_b)
    m2 = tl.fma(0.5, n_1 * (delta * delta), m2_1 + m2_2)
    return mean, m2, n_1 + n_2, tl.minimum(lane_1, lane_2)


@jit
def _fold_step(mean, m2, count, lane, AXIS: tl.constexpr, EVEN: tl.constexpr):
    """Combine the two halves of the size-2 axis AXIS (one step of aten's shuffle / warp tree)."""
    if EVEN:
        out = tl.reduce((mean, m2, count, lane), AXIS, _welford_combine_lanes_even)
    else:
        out = tl.reduce((mean, m2, count, lane), AXIS, _welford_combine_lanes)
    return out


@jit
def _fold_lanes(mean, m2, count, ROWS: tl.constexpr, EVEN: tl.constexpr):
    """aten's shuffle-down and warp tree over lane states (128, ROWS) → the rows' (mean, m2), (ROWS,).

    The (2, 2, 2, 2, 2, 2, 2, ROWS) view's axes are lane bits 6..0. Lane bits 4, 3, 2, 1, 0 (offsets
    16..1) are each axis 2 once the one before is gone; then bit 6 (warps (0,2), (1,3)) and bit 5
    (warps (0,1)) are axis 0.
    """
    tree: tl.constexpr = (2, 2, 2, 2, 2, 2, 2, ROWS)
    mean = tl.reshape(mean, tree)
    m2 = tl.reshape(m2, tree)
    count = tl.reshape(count, tree)
    lane = tl.reshape(tl.zeros((128, ROWS), tl.int32) + tl.arange(0, 128)[:, None], tree)
    for _ in tl.static_range(5):
        mean, m2, count, lane = _fold_step(mean, m2, count, lane, 2, EVEN)
    mean, m2, count, lane = _fold_step(mean, m2, count, lane, 0, EVEN)
    mean, m2, count, lane = _fold_step(mean, m2, count, lane, 0, EVEN)
    return mean, m2


@jit
def _welford_push4(mean, m2, count, x4, valid, IT: tl.constexpr, EVEN: tl.constexpr):
    """Each lane's `IT`-th 4-element vector into its Welford, elements in order: `x4` fp32 (..., 2, 2), a lane's
    elements 0..3 in its last two dims."""
    x0, x1, x2, x3 = split4(x4)
    mean, m2, count = _welford_push(mean, m2, count, x0, valid, 1.0 / (IT * 4 + 1), EVEN)
    mean, m2, count = _welford_push(mean, m2, count, x1, valid, 1.0 / (IT * 4 + 2), EVEN)
    mean, m2, count = _welford_push(mean, m2, count, x2, valid, 1.0 / (IT * 4 + 3), EVEN)
    mean, m2, count = _welford_push(mean, m2, count, x3, valid, 1.0 / (IT * 4 + 4), EVEN)
    return mean, m2, count


@jit
def _row_stats(mean, m2, count, D, eps, ROWS: tl.constexpr, EVEN: tl.constexpr, GPU: tl.constexpr):
    """The lanes' Welford states folded as aten folds them: each row's mean and 1 / sqrt(var + eps), shaped
    (1, ROWS, 1) to broadcast over (128, ROWS, 4) vectors."""
    mean, m2 = _fold_lanes(mean, m2, count, ROWS, EVEN)  # (ROWS,)
    var = tl.math.div_rn(m2, tl.full(m2.shape, D, tl.float32))
    rstd = rsqrtf(var + eps, GPU)[None, :, None]
    return mean[None, :, None], rstd


@jit
def _row_block(L, ROWS: tl.constexpr):
    """This program's ROWS rows of batch b (grid (cdiv(L, ROWS), B)): b and the positions (int64), surplus rows
    re-reading the last row (never stored), and which are rows."""
    b = tl.program_id(1).to(tl.int64)
    pos = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = pos < L
    return b, tl.where(row_ok, pos, L - 1).to(tl.int64), row_ok


@jit
def _vectors(ptr, b, stride, col, col_ok, PER_ROW: tl.constexpr, EVEN: tl.constexpr):
    """Each lane's 4-element vectors at columns `col` (128, 1, 4) of the rows at pointers `ptr` (ROWS,) when
    PER_ROW, else of the batch's one row at `ptr + b * stride`; unmasked when EVEN, else zeros past the row."""
    if PER_ROW:  # noqa: SIM108 (constexpr branches)
        ptrs = ptr[None, :, None] + col
    else:
        ptrs = ptr + b * stride + col
    if EVEN:  # noqa: SIM108
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=col_ok, other=0.0)
    return v


@jit
def _read_rows(
    x_row, scale_ptr, shift_ptr, gate_ptr, u_row, b, stride_scale, stride_shift, stride_gate, D, eps,
    ITERS: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr, PER_ROW: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, DTYPE: tl.constexpr, GPU: tl.constexpr,
):  # fmt: skip
    """Pass 1 of the rows kernels: every load, and each lane's Welford over its vectors in aten's order, folded.

    The rows are at pointers `x_row` (ROWS,); their scale and shift rows at pointers (ROWS,) when PER_ROW, else
    the batch's (`_vectors`). With HAS_RESIDUAL they are the residual and the LayerNorm input is
    r = r(residual + r(gate * update)), the gate per batch, the update rows at `u_row`. Returns per vector
    (tuples of ITERS) the LayerNorm input in the storage dtype, the scale (raw when PER_ROW; else r(1 + scale),
    once for the program's rows) and the raw shift, then each row's mean and rstd, (1, ROWS, 1).
    """
    lane = tl.arange(0, 128)  # aten's thrx = threadIdx.x + 32 * threadIdx.y
    c4 = tl.arange(0, 4)
    mean = tl.zeros((128, ROWS), tl.float32)
    m2 = tl.zeros((128, ROWS), tl.float32)
    count = tl.zeros((128, ROWS), tl.float32)
    xs = ()  # the LayerNorm input of each vector, in the storage dtype
    scales = ()
    shifts = ()
    for it in tl.static_range(ITERS):
        vec = it * 128 + lane
        col = (vec * 4)[:, None, None] + c4[None, None, :]  # (128, 1, 4): lane t holds 4t..4t+3
        vec_ok = vec < D // 4
        col_ok = vec_ok[:, None, None]
        x = _vectors(x_row, b, 0, col, col_ok, True, EVEN)  # (128, ROWS, 4)
        scale = _vectors(scale_ptr, b, stride_scale, col, col_ok, PER_ROW, EVEN)
        shift = _vectors(shift_ptr, b, stride_shift, col, col_ok, PER_ROW, EVEN)
        if HAS_RESIDUAL:
            g = _vectors(gate_ptr, b, stride_gate, col, col_ok, False, EVEN)
            u = _vectors(u_row, b, 0, col, col_ok, True, EVEN)
            prod = round_to(upcast(g, GPU) * upcast(u, GPU), DTYPE, GPU)
            x = to_storage(upcast(x, GPU) + prod, DTYPE, GPU)  # r = r(residual + r(gate * update))
        # tuples grow by `+` in Triton's frontend (it has no starred unpacking)
        xs = xs + (x,)  # noqa: RUF005
        if PER_ROW:  # noqa: SIM108 (constexpr branch)
            scales = scales + (scale,)  # noqa: RUF005
        else:
            scales = scales + (round_to(1.0 + upcast(scale, GPU), DTYPE, GPU),)  # noqa: RUF005
        shifts = shifts + (shift,)  # noqa: RUF005
        xf = upcast(x, GPU)
        mean, m2, count = _welford_push4(
            mean, m2, count, tl.reshape(xf, (128, ROWS, 2, 2)), vec_ok[:, None], it, EVEN
        )
    mean, rstd = _row_stats(mean, m2, count, D, eps, ROWS, EVEN, GPU)
    return xs, scales, shifts, mean, rstd


@jit
def _write_rows(
    xs, scales, shifts, mean, rstd, y_ptr, r_ptr, q_scale_ptr, q_inv_ptr, out_row, b, L, pos, row_ok, D,
    ITERS: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr, PER_ROW: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, HW_E4M3: tl.constexpr, DTYPE: tl.constexpr,
    GPU: tl.constexpr,
):  # fmt: skip
    """Pass 2 of the rows kernels (`_read_rows`' values): normalise and modulate,
    r(r(r(rstd * (x - mean)) * r(1 + scale)) + shift), and store at `y_ptr + out_row` (and r at
    `r_ptr + out_row` with HAS_RESIDUAL). QUANT 0: y; 1: e4m3(y * 1 / static scale); 2: e4m3 with each row's
    scale from its absmax, written to `q_scale_ptr + b * L + pos`."""
    lane = tl.arange(0, 128)
    c4 = tl.arange(0, 4)
    store_ok = row_ok[None, :, None]
    ys = ()  # QUANT 2: the rounded values, quantized once the row's amax is known
    amax = tl.zeros((ROWS,), tl.float32)
    if QUANT == 1:
        inv = tl.load(q_inv_ptr)
    for it in tl.static_range(ITERS):
        col = ((it * 128 + lane) * 4)[:, None, None] + c4[None, None, :]
        mask = store_ok if EVEN else store_ok & (col < D)
        if HAS_RESIDUAL:
            tl.store(r_ptr + out_row[None, :, None] + col, xs[it], mask=mask)
        ln = round_to(rstd * (upcast(xs[it], GPU) - mean), DTYPE, GPU)
        if PER_ROW:  # noqa: SIM108 (constexpr branch)
            scale1 = round_to(1.0 + upcast(scales[it], GPU), DTYPE, GPU)
        else:
            scale1 = scales[it]
        prod = round_to(ln * scale1, DTYPE, GPU)
        if QUANT == 0:
            y = to_storage(prod + upcast(shifts[it], GPU), DTYPE, GPU)
            tl.store(y_ptr + out_row[None, :, None] + col, y, mask=mask)
        else:
            y = round_to(prod + upcast(shifts[it], GPU), DTYPE, GPU)  # the 16-bit value eager would store
            if QUANT == 1:
                tl.store(y_ptr + out_row[None, :, None] + col, e4m3_code(y * inv, HW_E4M3), mask=mask)
            else:
                ys = ys + (y,)  # noqa: RUF005
                a = tl.abs(y) if EVEN else tl.where(col < D, tl.abs(y), 0.0)
                amax = tl.maximum(amax, tl.max(tl.max(a, axis=2), axis=0))
    if QUANT == 2:
        s, inv_row = e4m3_row_scale(amax)  # one scale per row
        tl.store(q_scale_ptr + b * L + pos, s, mask=row_ok)
        for it in tl.static_range(ITERS):
            col = ((it * 128 + lane) * 4)[:, None, None] + c4[None, None, :]
            mask = store_ok if EVEN else store_ok & (col < D)
            q = e4m3_code(ys[it] * inv_row[None, :, None], HW_E4M3)
            tl.store(y_ptr + out_row[None, :, None] + col, q, mask=mask)


@jit
def _layer_norm_modulate_rows_kernel(
    x_ptr,  # (B, L, D), strides (stride_xb, stride_xl, 1): LayerNorm input, or the residual (HAS_RESIDUAL)
    gate_ptr,  # (B, D), strides (stride_gate, 1): residual gate, read only when HAS_RESIDUAL
    upd_ptr,  # (B, L, D), strides (stride_ub, stride_ul, 1): residual update, read only when HAS_RESIDUAL
    shift_ptr,  # (B, D), strides (stride_shift, 1)
    scale_ptr,  # (B, D), strides (stride_scale, 1)
    r_out_ptr,  # (B, L, D) contiguous: r = residual + gate * update, written only when HAS_RESIDUAL
    y_out_ptr,  # (B, L, D) contiguous: LayerNorm(x or r) * (1 + scale) + shift (QUANT: uint8 e4m3 bits)
    q_scale_ptr,  # QUANT 2: (B * L,) fp32 row scales written; QUANT 1: unused
    q_inv_ptr,  # QUANT 1: 0-dim fp32 1 / input_scale read; QUANT 2: unused
    L,
    D,
    eps,
    stride_xb,
    stride_xl,
    stride_gate,
    stride_ub,
    stride_ul,
    stride_shift,
    stride_scale,
    ITERS: tl.constexpr,  # cdiv(D, 512): 4-element vectors each aten thread reads
    EVEN: tl.constexpr,  # D % 512 == 0: no masks, every Welford count a constant
    ROWS: tl.constexpr,  # rows per program, held in registers side by side
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,  # 0: store y; 1: store e4m3(y) with a static scale; 2: with per-row scales
    GPU: tl.constexpr,
    HW_E4M3: tl.constexpr,  # e4m3_code's hardware conversion (triton_utils.e4m3_consts)
    DTYPE: tl.constexpr,  # the activations' dtype (y_out_ptr holds bytes when QUANT)
):
    # grid: (cdiv(L, ROWS), B)
    b, pos, row_ok = _row_block(L, ROWS)
    x_row = x_ptr + b * stride_xb + pos * stride_xl  # (ROWS,)
    u_row = upd_ptr + b * stride_ub + pos * stride_ul
    out_row = (b * L + pos) * D
    xs, scales, shifts, mean, rstd = _read_rows(
        x_row, scale_ptr, shift_ptr, gate_ptr, u_row, b, stride_scale, stride_shift, stride_gate, D, eps,
        ITERS, EVEN, ROWS, False, HAS_RESIDUAL, DTYPE, GPU,
    )  # fmt: skip
    _write_rows(
        xs, scales, shifts, mean, rstd, y_out_ptr, r_out_ptr, q_scale_ptr, q_inv_ptr, out_row, b, L, pos, row_ok,
        D, ITERS, EVEN, ROWS, False, HAS_RESIDUAL, QUANT, HW_E4M3, DTYPE, GPU,
    )  # fmt: skip


def _check_width(op: str, d: int) -> None:
    """A row width whose LayerNorm the kernels replay: aten's vectorised kernel's (a multiple of 4), at most
    `MAX_WIDTH`."""
    if d % _VEC != 0:
        raise UnsupportedInput(
            f"{op}: width {d} is not a multiple of 4 (aten's vectorised LayerNorm needs it)"
        )
    if d > MAX_WIDTH:
        raise UnsupportedInput(f"{op}: width {d} exceeds the maximum fused width {MAX_WIDTH}")


def _check_norm_modulate(op: str, x: Tensor, shift: Tensor, scale: Tensor) -> tuple[int, int, int]:
    b, length, d = x.shape
    _check_width(op, d)
    check_half(op, x=x, shift=shift, scale=scale)
    check_strided(op, (b, d), shift=shift, scale=scale)
    return b, length, d


def _check_plain_input(op: str, x: Tensor, shift: Tensor, scale: Tensor) -> None:
    """Guards of the kernels that normalise `x` itself (no pending residual): launchable, (B, L, D), and laid
    out as the aten kernel they replay sees it."""
    check_launchable(op, x, shift, scale)
    check_bld(op, "x", x)
    _check_norm_modulate(op, x, shift, scale)
    check_aten_vectorized(op, "x", x)


def _even_counts_halve(iters: int) -> bool:
    """`fl(n * fl(1/n)) == 1` for aten's per-lane count n = 4 * iters, so the fold's `nA = nB = 0.5`."""
    n = np.float32(4 * iters)
    return bool(n * (np.float32(1.0) / n) == np.float32(1.0))


def default_rows_per_program(d: int, variant: str) -> int:
    """Rows per program: v1 one aten block each; v2 two up to D = 6144. `scripts/compile_check.py` counts
    their registers (96-255; under Triton 3.6 the residual kernel at 6144 spills 216 bytes a thread in bf16,
    one row per program none) and `scripts/kernel_check.py --tune` times one, two and four rows."""
    if variant == "v1":
        return 1
    return 2 if d <= 6144 else 1


def _rows_quant(
    quant: tuple[Tensor | None, Tensor | None] | None, b: int, length: int, unused: Tensor
) -> tuple[int, Tensor, Tensor]:
    """The rows kernels' `QUANT` and their q_scale / q_inv pointers: 0 without `quant` (`unused` for both, never
    read); 1 with a static (scale, inv_scale); 2 for per-row scales, both a new (B * L,) fp32 buffer."""
    if quant is None:
        return 0, unused, unused
    q_scale, q_inv = quant
    if q_scale is not None and q_inv is not None:
        return 1, q_scale, q_inv
    row_scales = torch.empty(b * length, dtype=torch.float32, device=unused.device)
    return 2, row_scales, row_scales


def _rows_consts(x: Tensor, rows: int, quant: int) -> dict[str, Any]:
    """The rows kernels' constexprs and launch options for `x` (..., D), `rows` per program, `QUANT` quant."""
    iters = triton.cdiv(x.shape[-1], _THREADS * _VEC)
    even = x.shape[-1] % (_THREADS * _VEC) == 0 and _even_counts_halve(iters)
    consts = {"ITERS": iters, "EVEN": even, "ROWS": rows, "QUANT": quant, "DTYPE": triton_dtype(x.dtype)}
    return consts | {"num_warps": 4, **EXACT, **e4m3_consts(x.device)}


def _rows_fp8(out: Tensor, quant: int, q_scale: Tensor) -> Fp8Act:
    """The e4m3 output `out` (B, L, D) of a quantizing launch with its scale: static, or (B, L, 1) per row."""
    return Fp8Act(out.view(E4M3), q_scale.view(*out.shape[:2], 1) if quant == 2 else q_scale)


def _launch(
    x: Tensor, gate: Tensor | None, update: Tensor | None, shift: Tensor, scale: Tensor, eps: float,
    variant: str | None, rows_per_program: int | None,
    quant: tuple[Tensor | None, Tensor | None] | None = None,
) -> tuple[Tensor, Tensor | Fp8Act]:  # fmt: skip
    variant = VARIANT if variant is None else variant
    if variant not in VARIANTS:
        raise ValueError(f"layer_norm_modulate: unknown variant {variant!r}; expected one of {VARIANTS}")
    if quant is not None and variant != "v2":
        raise UnsupportedInput("layer_norm_modulate: the e4m3 output exists in the v2 kernel only")
    b, length, d = x.shape
    rows = default_rows_per_program(d, variant) if rows_per_program is None else rows_per_program
    y = empty_out("layer_norm_modulate", (b, length, d), x, None if quant is None else torch.uint8)
    r = torch.empty((b, length, d), dtype=x.dtype, device=x.device) if gate is not None else y
    upd = update if update is not None else x
    g = gate if gate is not None else shift
    strides = (
        x.stride(0),
        x.stride(1),
        g.stride(0),
        upd.stride(0),
        upd.stride(1),
        shift.stride(0),
        scale.stride(0),
    )
    if variant == "v1":
        m = b * length
        iters = triton.cdiv(d, _THREADS * _VEC)
        _layer_norm_modulate_kernel[(triton.cdiv(m, rows),)](
            x, g, upd, shift, scale, r, y, m, length, d, eps, *strides,
            ITERS=iters, EVEN=d % (_THREADS * _VEC) == 0, ROWS=rows, HAS_RESIDUAL=gate is not None, num_warps=4,
            **EXACT,
        )  # fmt: skip
    else:
        mode, q_scale, q_inv = _rows_quant(quant, b, length, shift)
        _layer_norm_modulate_rows_kernel[(triton.cdiv(length, rows), b)](
            x, g, upd, shift, scale, r, y, q_scale, q_inv, length, d, eps, *strides,
            HAS_RESIDUAL=gate is not None, **_rows_consts(x, rows, mode),
        )  # fmt: skip
        if quant is not None:
            return (r if gate is not None else x), _rows_fp8(y, mode, q_scale)
    return r, y


def layer_norm_modulate_triton(
    x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6, *, variant: str | None = None,
    rows_per_program: int | None = None,
) -> Tensor:  # fmt: skip
    """Fused `layer_norm_modulate_reference`: x (B, L, D), shift/scale (B, D) → (B, L, D).

    `variant` "v1" or "v2" (default `VARIANT`); `rows_per_program` defaults per variant and width.
    """
    op = "layer_norm_modulate"
    _check_plain_input(op, x, shift, scale)
    return _launch(x, None, None, shift, scale, eps, variant, rows_per_program)[1]


def residual_layer_norm_modulate_triton(
    residual: Tensor, gate: Tensor, update: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6,
    *, variant: str | None = None, rows_per_program: int | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Fused `residual_layer_norm_modulate_reference`: returns `(r, y)`, both (B, L, D) contiguous.

    The reference normalises the freshly allocated (contiguous, aligned) `r`, so aten's vectorised
    LayerNorm is always the one replayed here. `variant`, `rows_per_program`: as `layer_norm_modulate_triton`.
    """
    op = "residual_layer_norm_modulate"
    check_launchable(op, residual, gate, update, shift, scale)
    check_gated_residual(op, residual, gate, update)
    _check_norm_modulate(op, residual, shift, scale)
    return _launch(residual, gate, update, shift, scale, eps, variant, rows_per_program)


def layer_norm_modulate_reference(x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6) -> Tensor:
    """`LayerNorm(x) * (1 + scale) + shift` for `x` (B, L, D), `shift`/`scale` (B, D)."""
    y = F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return modulate_reference(y, shift, scale)


def residual_layer_norm_modulate_reference(
    residual: Tensor, gate: Tensor, update: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Return `(r, layer_norm_modulate(r))` with `r = residual + gate * update`."""
    r = gated_residual_reference(residual, gate, update)
    return r, layer_norm_modulate_reference(r, shift, scale, eps)


_LAYER_NORM_MODULATE = FusedOp(
    "layer_norm_modulate", fused=layer_norm_modulate_triton, reference=layer_norm_modulate_reference
)
_RESIDUAL_LAYER_NORM_MODULATE = FusedOp(
    "residual_layer_norm_modulate",
    fused=residual_layer_norm_modulate_triton,
    reference=residual_layer_norm_modulate_reference,
)


def layer_norm_modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6) -> Tensor:
    """LayerNorm + modulate; see `layer_norm_modulate_reference` (fused when `dispatch` allows)."""
    return run_op(_LAYER_NORM_MODULATE, x, shift, scale, eps)


def residual_layer_norm_modulate(
    residual: Tensor, gate: Tensor, update: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Deferred gated residual + LayerNorm + modulate; see `residual_layer_norm_modulate_reference`."""
    return run_op(_RESIDUAL_LAYER_NORM_MODULATE, residual, gate, update, shift, scale, eps)


# --------------------------------------------------------------------------------------------------
# e4m3 outputs: the bf16/fp16 value above, then the FP8 consumer's quantization (no bf16 copy written)


def layer_norm_modulate_fp8_triton(
    x: Tensor, shift: Tensor, scale: Tensor, eps: float, q_scale: Tensor | None, q_inv: Tensor | None
) -> Fp8Act:
    """Fused `layer_norm_modulate_fp8_reference` (the v2 kernel with its e4m3 epilogue)."""
    op = "layer_norm_modulate_fp8"
    _check_plain_input(op, x, shift, scale)
    check_quant(op, q_scale, q_inv)
    return _launch(x, None, None, shift, scale, eps, "v2", None, (q_scale, q_inv))[1]


def residual_layer_norm_modulate_fp8_triton(
    residual: Tensor, gate: Tensor, update: Tensor, shift: Tensor, scale: Tensor, eps: float,
    q_scale: Tensor | None, q_inv: Tensor | None,
) -> tuple[Tensor, Fp8Act]:  # fmt: skip
    """Fused `residual_layer_norm_modulate_fp8_reference`: `(r, e4m3 of the modulated r)`."""
    op = "residual_layer_norm_modulate_fp8"
    check_launchable(op, residual, gate, update, shift, scale)
    check_gated_residual(op, residual, gate, update)
    _check_norm_modulate(op, residual, shift, scale)
    check_quant(op, q_scale, q_inv)
    return _launch(residual, gate, update, shift, scale, eps, "v2", None, (q_scale, q_inv))


def layer_norm_modulate_fp8_reference(
    x: Tensor, shift: Tensor, scale: Tensor, eps: float, q_scale: Tensor | None, q_inv: Tensor | None
) -> Fp8Act:
    """`quantize_reference(layer_norm_modulate_reference(x, shift, scale, eps), q_scale, q_inv)`."""
    return quantize_reference(layer_norm_modulate_reference(x, shift, scale, eps), q_scale, q_inv)


def residual_layer_norm_modulate_fp8_reference(
    residual: Tensor, gate: Tensor, update: Tensor, shift: Tensor, scale: Tensor, eps: float,
    q_scale: Tensor | None, q_inv: Tensor | None,
) -> tuple[Tensor, Fp8Act]:  # fmt: skip
    """`(r, quantize_reference(layer_norm_modulate(r)))` with `r = residual + gate * update`."""
    r, y = residual_layer_norm_modulate_reference(residual, gate, update, shift, scale, eps)
    return r, quantize_reference(y, q_scale, q_inv)


_LAYER_NORM_MODULATE_FP8 = FusedOp(
    "layer_norm_modulate_fp8",
    fused=layer_norm_modulate_fp8_triton,
    reference=layer_norm_modulate_fp8_reference,
)
_RESIDUAL_LAYER_NORM_MODULATE_FP8 = FusedOp(
    "residual_layer_norm_modulate_fp8",
    fused=residual_layer_norm_modulate_fp8_triton,
    reference=residual_layer_norm_modulate_fp8_reference,
)


def layer_norm_modulate_fp8(
    x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6,
    q_scale: Tensor | None = None, q_inv: Tensor | None = None,
) -> Fp8Act:  # fmt: skip
    """LayerNorm + modulate in e4m3 for an FP8 consumer: static (`q_scale`, `q_inv`) or per-row scales."""
    return run_op(_LAYER_NORM_MODULATE_FP8, x, shift, scale, eps, q_scale, q_inv)


def residual_layer_norm_modulate_fp8(
    residual: Tensor, gate: Tensor, update: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6,
    q_scale: Tensor | None = None, q_inv: Tensor | None = None,
) -> tuple[Tensor, Fp8Act]:  # fmt: skip
    """Deferred gated residual + LayerNorm + modulate, the modulated value in e4m3 (see above)."""
    return run_op(
        _RESIDUAL_LAYER_NORM_MODULATE_FP8, residual, gate, update, shift, scale, eps, q_scale, q_inv
    )
