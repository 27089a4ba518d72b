"""LayerNorm (no affine) followed by adaLN modulate (fusion F2), and its deferred-residual form (F4).

`residual_layer_norm_modulate` first materialises a pending gated residual `r + g * u` and then
normalises the result: one pass over the row in a fused kernel, two eager chains in the reference.

The fused kernel is lossless because it replays aten's `vectorized_layer_norm_kernel` (bf16/fp16,
`D % 4 == 0`, aligned: shared/reference/fusions.md §3.1) operation for operation: a row is read by
128 threads (4 warps × 32 lanes), thread t pushing the 4 elements of vectors t, t+128, ... through
Welford in order (`mean = fma(delta, 1/count, mean)`, `m2 = fma(delta, x - mean, m2)`, correctly
rounded reciprocals); lanes fold by shuffle-down 16…1, warps by (0,2),(1,3) then (0,1), each step
`cuWelfordCombine(self = lower, other = upper)` with nvcc's two FMAs; `var = m2 / D` (div.rn),
`rstd = rsqrtf(var + eps)`, `y = r(rstd * (x - mean))`; then modulate's three roundings (F1).
The 128 lanes are a tensor dimension here and the fold is reshape/permute/split, so the tree is
fixed by construction, whatever layout Triton picks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.gated_residual import check_gated_residual, gated_residual_reference
from flux_runtime.kernels.modulate import modulate_reference
from flux_runtime.kernels.triton_utils import (
    ON_GPU,
    check_aten_vectorized,
    check_half,
    check_int32_offsets,
    check_launchable,
    check_shape,
    check_unit_stride,
    halves,
    jit,
    round_to,
    rsqrtf,
    tl,
    to_storage,
    triton,
    upcast,
)

# Widest row fused: 16 unrolled vector loads per aten thread.
MAX_WIDTH = 8192
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
        x02, x13 = tl.split(tl.reshape(x, (ROWS, 128, 2, 2)))
        x0, x2 = tl.split(x02)
        x1, x3 = tl.split(x13)
        mean, m2, count = _welford_push(mean, m2, count, x0, vec_ok, 1.0 / (it * 4 + 1), EVEN)
        mean, m2, count = _welford_push(mean, m2, count, x1, vec_ok, 1.0 / (it * 4 + 2), EVEN)
        mean, m2, count = _welford_push(mean, m2, count, x2, vec_ok, 1.0 / (it * 4 + 3), EVEN)
        mean, m2, count = _welford_push(mean, m2, count, x3, vec_ok, 1.0 / (it * 4 + 4), EVEN)

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


def _check_norm_modulate(op: str, x: Tensor, shift: Tensor, scale: Tensor) -> tuple[int, int, int]:
    b, length, d = x.shape
    if d % _VEC != 0:
        raise UnsupportedInput(
            f"{op}: width {d} is not a multiple of 4 (aten's vectorised LayerNorm needs it)"
        )
    if d > MAX_WIDTH:
        raise UnsupportedInput(f"{op}: width {d} exceeds the maximum fused width {MAX_WIDTH}")
    check_half(op, x=x, shift=shift, scale=scale)
    check_shape(op, "shift", shift, (b, d))
    check_shape(op, "scale", scale, (b, d))
    for name, t in (("shift", shift), ("scale", scale)):
        check_unit_stride(op, name, t)
        check_int32_offsets(op, name, t)
    return b, length, d


def _launch(
    x: Tensor, gate: Tensor | None, update: Tensor | None, shift: Tensor, scale: Tensor, eps: float,
    rows_per_program: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    b, length, d = x.shape
    y = torch.empty((b, length, d), dtype=x.dtype, device=x.device)
    r = torch.empty_like(y) if gate is not None else y
    check_int32_offsets("layer_norm_modulate", "out", y)
    m = b * length
    upd = update if update is not None else x
    grid = (triton.cdiv(m, rows_per_program),)
    _layer_norm_modulate_kernel[grid](
        x, gate if gate is not None else shift, upd, shift, scale, r, y, m, length, d, eps,
        x.stride(0), x.stride(1), gate.stride(0) if gate is not None else 0, upd.stride(0), upd.stride(1),
        shift.stride(0), scale.stride(0),
        ITERS=triton.cdiv(d, _THREADS * _VEC), EVEN=d % (_THREADS * _VEC) == 0, ROWS=rows_per_program,
        HAS_RESIDUAL=gate is not None, GPU=ON_GPU, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return r, y


def layer_norm_modulate_triton(
    x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6, *, rows_per_program: int = 1
) -> Tensor:
    """Fused `layer_norm_modulate_reference`: x (B, L, D), shift/scale (B, D) → (B, L, D)."""
    op = "layer_norm_modulate"
    check_launchable(op, x, shift, scale)
    if x.ndim != 3 or x.numel() == 0:
        raise UnsupportedInput(f"{op}: x must be a non-empty (B, L, D) tensor, got {tuple(x.shape)}")
    _check_norm_modulate(op, x, shift, scale)
    check_unit_stride(op, "x", x)
    check_int32_offsets(op, "x", x)
    check_aten_vectorized(op, "x", x)
    return _launch(x, None, None, shift, scale, eps, rows_per_program)[1]


def residual_layer_norm_modulate_triton(
    residual: Tensor, gate: Tensor, update: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6,
    *, rows_per_program: int = 1,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Fused `residual_layer_norm_modulate_reference`: returns `(r, y)`, both (B, L, D) contiguous.

    The reference normalises the freshly allocated (contiguous, aligned) `r`, so aten's vectorised
    LayerNorm is always the one replayed here.
    """
    op = "residual_layer_norm_modulate"
    check_launchable(op, residual, gate, update, shift, scale)
    check_gated_residual(op, residual, gate, update)
    _check_norm_modulate(op, residual, shift, scale)
    return _launch(residual, gate, update, shift, scale, eps, rows_per_program)


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
