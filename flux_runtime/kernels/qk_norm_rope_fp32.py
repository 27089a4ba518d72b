"""QK RMSNorm + rotary embedding in fp32 with one cast back, q and k in one launch (FLUX.3's attention).

FLUX.3 upcasts each head row to fp32 before `torch.nn.RMSNorm` (its weight kept fp32), rotates the fp32
result and casts the rotated q and k back to the stream dtype once. Compared with the joint
`qk_norm_rope` op, the norm output is therefore not rounded to bf16 before RoPE, and the weight is fp32.

aten runs the fp32 RMSNorm with the same vectorised kernel as the bf16 one (4-element vectors for every
dtype, 128 threads per 128-wide row): lane t of warp 0 sums `fma(x, x, sum)` over elements 4t..4t+3 in
order, the shuffle-down tree 16…1 adds the lane sums, the idle warps add zeros, `ms = sum / 128`,
`rstd = rsqrtf(ms + eps)`, `y = w * (rstd * x)` in fp32. RoPE is the reference's three fp32 ops
(`mul.rn`, `mul.rn`, `add.rn`, the rotation's negation a sign flip), then one round-to-nearest-even cast.
The bf16 input is exactly representable in fp32, so the kernel reads q and k as they come from the
projections instead of their fp32 copies.

q and k come back (B, L, H, 128), each stored head-major ((B, H, L, 128) contiguous, what SDPA reads best once
permuted) or contiguous as `qk_norm_rope.HEAD_MAJOR` says for the role (`head_major_q`, `head_major_k`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.launch import EXACT, check_inputs, check_int32_offsets, check_strided, row_tiles
from flux_runtime.kernels.qk_norm_rope import (
    HEAD_DIM,
    _norm_rope_tile,
    _token_head_tile,
    cast_heads,
    check_heads,
    check_norm_weight,
    check_rope_tables,
    heads_view,
    rms_norm_reference,
    rope_reference,
)
from flux_runtime.kernels.triton_utils import jit, tl, to_storage, upcast


@jit
def _qk_norm_rope_fp32_kernel(
    q_ptr,  # (B, L, H, 128) bf16/fp16, strides (stride_qb, stride_ql, stride_qh, 1)
    k_ptr,  # (B, L, H, 128) like q, strides (stride_kb, stride_kl, stride_kh, 1)
    wq_ptr,  # (128,) fp32 query RMSNorm weight
    wk_ptr,  # (128,) fp32 key RMSNorm weight
    cos_ptr,  # (L, 128) fp32 contiguous
    sin_ptr,  # (L, 128) fp32 contiguous
    qo_ptr,  # (B, L, H, 128) rotated q in q's dtype, strides (stride_qob, stride_qol, stride_qoh, 1)
    ko_ptr,  # (B, L, H, 128) rotated k, strides (stride_kob, stride_kol, stride_koh, 1)
    B,
    L,
    H,
    eps,
    stride_qb,
    stride_ql,
    stride_qh,
    stride_kb,
    stride_kl,
    stride_kh,
    stride_qob,
    stride_qol,
    stride_qoh,
    stride_kob,
    stride_kol,
    stride_koh,
    TOKS: tl.constexpr,  # tokens per program
    HB: tl.constexpr,  # heads per program
    GPU: tl.constexpr,
):
    # grid: (cdiv(L, TOKS), cdiv(H, HB), 2 * B): the q programs of every batch, then the k programs
    DTYPE = qo_ptr.dtype.element_ty
    which = tl.program_id(2) // B  # 0: q, 1: k
    b = (tl.program_id(2) % B).to(tl.int64)
    is_k = which == 1
    base = tl.where(is_k, k_ptr + b * stride_kb, q_ptr + b * stride_qb)
    stride_l = tl.where(is_k, stride_kl, stride_ql)
    stride_h = tl.where(is_k, stride_kh, stride_qh)
    w_ptr = tl.where(is_k, wk_ptr, wq_ptr)
    out_base = tl.where(is_k, ko_ptr + b * stride_kob, qo_ptr + b * stride_qob)
    stride_ol = tl.where(is_k, stride_kol, stride_qol)
    stride_oh = tl.where(is_k, stride_koh, stride_qoh)

    pos, head, ok = _token_head_tile(L, H, TOKS, HB)
    pos = pos.to(tl.int64)
    col = tl.arange(0, 128)[None, None, :]
    x = tl.load(base + pos[:, None, None] * stride_l + head[None, :, None] * stride_h + col)
    x = upcast(x, GPU)  # (TOKS, HB, 128): `.float()` is exact
    w = tl.load(w_ptr + col)  # (1, 1, 128) fp32
    # the fp32 RMSNorm output is kept fp32: RoPE rotates it before the one cast back
    out = _norm_rope_tile(x, w, cos_ptr, sin_ptr, pos, col, eps, TOKS, HB, False, DTYPE, GPU)
    out_off = pos[:, None, None] * stride_ol + head[None, :, None] * stride_oh + col
    tl.store(out_base + out_off, to_storage(out, DTYPE, GPU), mask=ok)


def qk_norm_rope_fp32_triton(
    q: Tensor,
    k: Tensor,
    weight_q: Tensor,
    weight_k: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    head_major_q: bool = True,
    head_major_k: bool = True,
    *,
    heads_per_program: int = 8,
    tokens_per_program: int = 8,
) -> tuple[Tensor, Tensor]:
    """Fused `qk_norm_rope_fp32_reference` → (q, k), each (B, L, H, 128) in q's dtype, stored as the
    reference stores it: head-major ((B, H, L, 128) contiguous) where `head_major_q` / `head_major_k`, else
    contiguous.

    q and k are bf16/fp16 (B, L, H, 128), possibly strided views (unit last stride) of the projections;
    the weights fp32 (128,); cos/sin fp32 (L, 128) contiguous. One launch rotates both: the outputs are
    the two halves of one buffer, each written through its own strides.
    """
    op = "qk_norm_rope_fp32"
    check_inputs(op, weight_q, weight_k, cos, sin, q=q, k=k)
    check_heads(op, "q", q)
    b, length, h, _ = q.shape
    if b == 0 or length == 0 or h == 0:
        raise UnsupportedInput(f"{op}: empty input {tuple(q.shape)}")
    check_strided(op, tuple(q.shape), k=k)
    for name, w in (("weight_q", weight_q), ("weight_k", weight_k)):
        if w.dtype != torch.float32:
            raise UnsupportedInput(
                f"{op}: {name} must be fp32 (the norm weights are kept fp32), got {w.dtype}"
            )
        check_norm_weight(op, name, w)
    check_rope_tables(op, cos, sin, length)
    # one allocation: q's half, then k's, each (B, H, L, 128) or (B, L, H, 128) contiguous
    halves = torch.empty((2, b * length * h * HEAD_DIM), dtype=q.dtype, device=q.device)
    check_int32_offsets(op, "out", halves)
    q_out, k_out = (
        heads_view(half, b, length, h, HEAD_DIM, major)
        for half, major in zip(halves, (head_major_q, head_major_k), strict=True)
    )
    _qk_norm_rope_fp32_kernel[row_tiles(2 * b, length, h, tokens_per_program, heads_per_program)](
        q, k, weight_q, weight_k, cos, sin, q_out, k_out, b, length, h, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        TOKS=tokens_per_program, HB=heads_per_program, num_warps=4, **EXACT,
    )  # fmt: skip
    return q_out, k_out


def qk_norm_rope_fp32_reference(
    q: Tensor,
    k: Tensor,
    weight_q: Tensor,
    weight_k: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    head_major_q: bool = True,
    head_major_k: bool = True,
) -> tuple[Tensor, Tensor]:
    """`rope(rms_norm(x.float(), w), cos, sin).to(x.dtype)` for x = q, k (B, L, H, D); weights fp32 (D,).

    The RMSNorm and RoPE both run in fp32 (cos/sin (L, D) fp32) and each result is cast back once, into
    head-major storage where `head_major_q` / `head_major_k` (`qk_norm_rope.cast_heads`).
    """
    return tuple(
        cast_heads(rope_reference(rms_norm_reference(x.float(), w, eps), cos, sin), q.dtype, major)
        for x, w, major in ((q, weight_q, head_major_q), (k, weight_k, head_major_k))
    )  # type: ignore[return-value]


_QK_NORM_ROPE_FP32 = FusedOp(
    "qk_norm_rope_fp32", fused=qk_norm_rope_fp32_triton, reference=qk_norm_rope_fp32_reference
)


def qk_norm_rope_fp32(
    q: Tensor,
    k: Tensor,
    weight_q: Tensor,
    weight_k: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    head_major_q: bool = True,
    head_major_k: bool = True,
) -> tuple[Tensor, Tensor]:
    """fp32 QK-norm + RoPE of q and k; see `qk_norm_rope_fp32_reference` (fused when `dispatch` allows).
    FLUX.3 passes `is_head_major("q")` and `is_head_major("k")`: the layout `qk_norm_rope.HEAD_MAJOR` sets."""
    return run_op(_QK_NORM_ROPE_FP32, q, k, weight_q, weight_k, cos, sin, eps, head_major_q, head_major_k)
