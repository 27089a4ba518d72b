"""QK RMSNorm + rotary embedding over the joint text/image sequence.

diffusers normalises each stream's heads with its own `torch.nn.RMSNorm` weight, concatenates
text before image along the sequence, then applies RoPE in fp32: `x * cos + rot(x) * sin`
(two fp32 products and one fp32 add, separately rounded) with a single cast back.

The fused kernel reads each head row once from its stream, writes the joint layout directly and is
lossless: the RMSNorm replays aten's fused CUDA kernel for a 128-wide row (lane t of
warp 0 sums the squares of elements 4t..4t+3 with FMAs in order, shuffle-down 16…1, the idle warps
add zeros, `ms = sum / 128`, `rstd = rsqrtf(ms + eps)`, `y = r(w * (rstd * x))`); RoPE uses
separately rounded `mul.rn`, `mul.rn`, `add.rn` and a sign-bit negation.

Layout: the joint q or k comes back as a (B, L, H, 128) tensor (the shape every caller indexes) whose storage
is either (B, L, H, 128) contiguous or head-major, (B, H, L, 128) contiguous, so that `sdpa`'s
`permute(0, 2, 1, 3)` hands SDPA contiguous (B, H, L, 128) inputs; the double blocks can build the joint V the
same way (`empty_heads`). SDPA returns the same bits either way (only its reads differ). `HEAD_MAJOR` says which
of q, k and v the models store head-major (k and v by default, `HEAD_MAJOR_DEFAULT`; `set_head_major`,
`head_major_layout`: `scripts/bench_fp8.py --layout-ab` times the FP8 step with each setting in one run).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.launch import (
    EXACT,
    check_aten_vectorized,
    check_inputs,
    check_int32_offsets,
    check_joins,
    check_shape,
    check_strided,
    optional_stream,
    row_tiles,
)
from flux_runtime.kernels.triton_utils import (
    halves,
    jit,
    mul_rn,
    round_to,
    rsqrtf,
    split4,
    temporarily,
    tl,
    to_storage,
    triton,
    upcast,
)

HEAD_DIM = 128  # the kernel is aten's RMSNorm for one 128-wide row: 32 lanes × 4
# Kernel used by the op: "v1" (one token per program) or "v2" (token x head tiles, see
# `_qk_norm_rope_tiles_kernel`). Both are bit-identical.
VARIANTS = ("v1", "v2")
VARIANT = "v2"

# --------------------------------------------------------------------------------------------------
# The attention inputs' layout

ROLES = frozenset("qkv")
# Which attention inputs the models store head-major: q and k as `qk_norm_rope` (and FLUX.3's
# `qk_norm_rope_fp32`) writes them, v as the double blocks' joint V (`double_stream`). The single blocks' v
# stays a strided view of `linear1`'s output, and FLUX.3's its own projection's output: making either
# head-major would be a copy. cuDNN's and flash attention's output follows q's layout, so with q head-major
# the heads come back head-major too and whoever flattens them to (B, L, H * 128) rows copies them (the
# double blocks' output projection; a single block's `[attn | mlp]` buffer is written by a copy either way):
# "kv" keeps q (and the output) as before. The default, from the same-run A/B (`bench_fp8.py --layout-ab`, H200,
# FP8 lossless + graph step at 1024²): FLUX.1 [dev] old layout 94.4 ms, q, k, v 95.0, k, v 94.5; klein-4B 43.1,
# 42.8, 42.6 (a run's repeats of one setting differ by up to 0.9 ms on FLUX.1 [dev]).
HEAD_MAJOR_DEFAULT = "kv"
HEAD_MAJOR: frozenset[str] = frozenset(HEAD_MAJOR_DEFAULT)


def set_head_major(flag: bool | str | frozenset[str]) -> frozenset[str]:
    """Set `HEAD_MAJOR`: True for q, k and v, False for none (every attention input (B, L, H, 128)
    contiguous, the layout before), or the roles as a string such as "kv" (`HEAD_MAJOR_DEFAULT`) or a set.
    Returns the roles it replaced.

    The values are the same whatever the setting; read when a block runs, so a captured CUDA graph keeps the
    layout it was captured with.
    """
    global HEAD_MAJOR
    previous = HEAD_MAJOR
    if isinstance(flag, bool):
        HEAD_MAJOR = ROLES if flag else frozenset()
        return previous
    roles = frozenset(flag)
    if not roles <= ROLES:
        raise ValueError(f"set_head_major: {flag!r} names roles other than q, k and v")
    HEAD_MAJOR = roles
    return previous


def head_major_layout(flag: bool | str) -> AbstractContextManager[None]:
    """`set_head_major(flag)` for the enclosed block; the previous setting is restored on exit."""
    return temporarily(set_head_major, flag)


def is_head_major(role: str) -> bool:
    """Whether the models store attention input `role` ("q", "k" or "v") head-major (`HEAD_MAJOR`)."""
    if role not in ROLES:
        raise ValueError(f"is_head_major: unknown role {role!r}; expected q, k or v")
    return role in HEAD_MAJOR


def heads_view(storage: Tensor, b: int, length: int, h: int, d: int, head_major: bool) -> Tensor:
    """(B, L, H, D) view of flat `storage` (B * L * H * D values): laid out (B, H, L, D) when `head_major`
    (what SDPA reads contiguously once permuted to (B, H, L, D)), else (B, L, H, D)."""
    if head_major:
        return storage.view(b, h, length, d).permute(0, 2, 1, 3)
    return storage.view(b, length, h, d)


def empty_heads(
    b: int, length: int, h: int, d: int, *, dtype: torch.dtype, device: torch.device, head_major: bool
) -> Tensor:
    """An uninitialised (B, L, H, D) tensor stored as `heads_view` says."""
    return heads_view(
        torch.empty(b * length * h * d, dtype=dtype, device=device), b, length, h, d, head_major
    )


def cast_heads(x: Tensor, dtype: torch.dtype, head_major: bool) -> Tensor:
    """`x.to(dtype)` for (B, L, H, D) `x`, stored head-major when `head_major` (`empty_heads`).

    `Tensor.to` is `copy_` into a new tensor, so the cast into a head-major one rounds the same values alike.
    """
    if not head_major:
        return x.to(dtype)
    return empty_heads(*x.shape, dtype=dtype, device=x.device, head_major=True).copy_(x)


@jit
def _lane_sum_squares(x4):
    """aten's per-lane sum of squares, `fma(x, x, sum)` over each lane's 4 elements in order: `x4` (..., 2, 2)
    holds a lane's elements 0..3 in its last two dims."""
    x0, x1, x2, x3 = split4(x4)
    total = tl.fma(x0, x0, 0.0)
    total = tl.fma(x1, x1, total)
    total = tl.fma(x2, x2, total)
    return tl.fma(x3, x3, total)


@jit
def _rope_pairs(x_e, x_o, cos_e, cos_o, sin_e, sin_o, GPU: tl.constexpr):
    """RoPE of channel pairs (2i, 2i+1), the reference's three fp32 ops each: r(x * cos + rot(x) * sin) with
    rot = (-x[2i+1], x[2i]); the pairs joined back along a last axis of 2."""
    out_e = mul_rn(x_e, cos_e, GPU) + mul_rn(-x_o, sin_e, GPU)
    out_o = mul_rn(x_o, cos_o, GPU) + mul_rn(x_e, sin_o, GPU)
    return tl.join(out_e, out_o)


@jit
def _qk_norm_rope_kernel(
    txt_ptr,  # (B, L_txt, H, 128), strides (stride_tb, stride_tl, stride_th, 1); img_ptr when no text
    img_ptr,  # (B, L_img, H, 128), strides (stride_ib, stride_il, stride_ih, 1)
    w_txt_ptr,  # (128,) text RMSNorm weight (w_img_ptr when no text)
    w_img_ptr,  # (128,) image RMSNorm weight
    cos_ptr,  # (L_txt + L_img, 128) fp32 contiguous
    sin_ptr,  # (L_txt + L_img, 128) fp32 contiguous
    out_ptr,  # (B, L_txt + L_img, H, 128), strides (stride_ob, stride_ol, stride_oh, 1)
    L_txt,
    L_joint,
    H,
    eps,
    stride_tb,
    stride_tl,
    stride_th,
    stride_ib,
    stride_il,
    stride_ih,
    stride_ob,
    stride_ol,
    stride_oh,
    HEADS: tl.constexpr,  # heads per program
    GPU: tl.constexpr,
):
    # grid: (B * L_joint, cdiv(H, HEADS))
    DTYPE = out_ptr.dtype.element_ty
    tok = tl.program_id(0).to(tl.int64)
    b = tok // L_joint
    pos = tok % L_joint
    is_txt = pos < L_txt
    base = tl.where(
        is_txt, txt_ptr + b * stride_tb + pos * stride_tl, img_ptr + b * stride_ib + (pos - L_txt) * stride_il
    )
    stride_h = tl.where(is_txt, stride_th, stride_ih)
    w_ptr = tl.where(is_txt, w_txt_ptr, w_img_ptr)

    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    head_ok = (head < H)[:, None, None]
    lane = tl.arange(0, 32)
    col = lane[:, None] * 4 + tl.arange(0, 4)[None, :]  # (32, 4): lane t holds elements 4t..4t+3
    x = tl.load(base + head[:, None, None] * stride_h + col[None, :, :], mask=head_ok, other=0.0)
    x = upcast(x, GPU)

    # RMSNorm statistics: per lane fma(x, x, sum) in element order, then shuffle-down 16..1
    total = tl.reshape(_lane_sum_squares(tl.reshape(x, (HEADS, 32, 2, 2))), (HEADS, 1, 32))
    lo, hi = halves(total, HEADS, 1, 16)
    total = lo + hi  # self + other
    lo, hi = halves(total, HEADS, 1, 8)
    total = lo + hi
    lo, hi = halves(total, HEADS, 1, 4)
    total = lo + hi
    lo, hi = halves(total, HEADS, 1, 2)
    total = lo + hi
    lo, hi = halves(total, HEADS, 1, 1)
    total = lo + hi  # (HEADS, 1, 1); warps 1-3 of aten's block hold zeros and add nothing
    ms = tl.math.div_rn(total, tl.full(total.shape, 128.0, tl.float32))
    rstd = rsqrtf(ms + eps, GPU)  # (HEADS, 1, 1)
    w = upcast(tl.load(w_ptr + col), GPU)
    x = round_to(w[None, :, :] * (rstd * x), DTYPE, GPU)  # RMSNorm output, stored as DTYPE by eager

    # RoPE on channel pairs (2i, 2i+1): out = r(x * cos + rot(x) * sin), rot = (-x[2i+1], x[2i])
    pair = tl.arange(0, 64)
    row = pos * 128 + pair * 2
    cos_e = tl.load(cos_ptr + row)
    cos_o = tl.load(cos_ptr + row + 1)
    sin_e = tl.load(sin_ptr + row)
    sin_o = tl.load(sin_ptr + row + 1)
    x_e, x_o = tl.split(tl.reshape(x, (HEADS, 64, 2)))
    out = _rope_pairs(x_e, x_o, cos_e[None, :], cos_o[None, :], sin_e[None, :], sin_o[None, :], GPU)
    out = tl.reshape(out, (HEADS, 32, 4))
    out_off = b * stride_ob + pos * stride_ol + head[:, None, None] * stride_oh + col[None, :, :]
    tl.store(out_ptr + out_off, to_storage(out, DTYPE, GPU), mask=head_ok)


# --------------------------------------------------------------------------------------------------
# v2: TOKS tokens x HB heads per program, batch in the grid
#
# v1 above normalises 8 heads of one token per program with a reshape/split fold that Triton 3.6
# lowers through shared memory, every thread redoing the whole reduction (sm_90 SASS: ~90
# instructions per element; v2 ~17). Here a program holds a (TOKS, HB, 128) tile: Triton gives each thread 8 contiguous
# elements (16-byte accesses) of all HB heads of one token, so the token's cos/sin/weight rows are
# loaded once and reused for its heads, and index arithmetic is per token (no division: the batch is
# a grid axis). aten's tree over the 32 lane sums is five size-2 reductions, offsets 16, 8, 4, 2, 1
# in that order (butterfly shuffles or in-thread adds); addition is commutative, so any lane order
# gives aten's value, and every load precedes the store.


@jit
def _lane_tree_sum(total, TOKS: tl.constexpr, HB: tl.constexpr):
    """aten's shuffle-down sum of lane totals (TOKS, HB, 32) → (TOKS, HB): offsets 16, 8, 4, 2, 1.

    Each offset is one size-2 axis of the (TOKS, HB, 2, 2, 2, 2, 2) view (lane bits 4..0), always
    axis 2 once the one before is gone.
    """
    total = tl.reshape(total, (TOKS, HB, 2, 2, 2, 2, 2))
    for _ in tl.static_range(5):
        total = tl.sum(total, axis=2)
    return total


@jit
def _token_head_tile(L, H, TOKS: tl.constexpr, HB: tl.constexpr):
    """This program's TOKS tokens x HB heads (grid axes 0 and 1): the positions and heads, clamped to valid
    ones (surplus tokens and heads re-read valid rows, never stored), and the (TOKS, HB, 1) mask of the stores."""
    pos = tl.program_id(0) * TOKS + tl.arange(0, TOKS)
    head = tl.program_id(1) * HB + tl.arange(0, HB)
    ok = (pos < L)[:, None, None] & (head < H)[None, :, None]
    return tl.minimum(pos, L - 1), tl.minimum(head, H - 1), ok


@jit
def _norm_rope_tile(
    x, w, cos_ptr, sin_ptr, pos, col, eps, TOKS: tl.constexpr, HB: tl.constexpr, ROUND: tl.constexpr,
    DTYPE: tl.constexpr, GPU: tl.constexpr,
):  # fmt: skip
    """RMSNorm with weight `w` (fp32, (TOKS, 1, 128)), then RoPE, of the fp32 head rows `x` (TOKS, HB, 128) at
    positions `pos` (their cos/sin rows read here); the norm output rounded to DTYPE first when ROUND (the
    16-bit value eager stores), kept fp32 otherwise. Returns the rotated fp32 (TOKS, HB, 128)."""
    table = pos[:, None, None] * 128 + col
    cos = tl.load(cos_ptr + table)  # (TOKS, 1, 128)
    sin = tl.load(sin_ptr + table)

    # RMSNorm statistics: lane t sums fma(x, x, sum) over elements 4t..4t+3 in order, then the
    # shuffle-down tree over the 32 lanes
    total = _lane_sum_squares(tl.reshape(x, (TOKS, HB, 32, 2, 2)))
    # aten's `sum / 128`: multiplying by 1/128 (a power of 2) gives the same correctly rounded value
    ms = _lane_tree_sum(total, TOKS, HB) * (1.0 / 128)
    rstd = rsqrtf(ms + eps, GPU)[:, :, None]  # warps 1-3 of aten's block added zeros: nothing
    x = w * (rstd * x)  # fp32: no add follows, nothing to contract
    if ROUND:
        x = round_to(x, DTYPE, GPU)

    # RoPE on channel pairs (2i, 2i+1): out = r(x * cos + rot(x) * sin), rot = (-x[2i+1], x[2i])
    x_e, x_o = tl.split(tl.reshape(x, (TOKS, HB, 64, 2)))
    cos_e, cos_o = tl.split(tl.reshape(cos, (TOKS, 1, 64, 2)))
    sin_e, sin_o = tl.split(tl.reshape(sin, (TOKS, 1, 64, 2)))
    return tl.reshape(_rope_pairs(x_e, x_o, cos_e, cos_o, sin_e, sin_o, GPU), (TOKS, HB, 128))


@jit
def _qk_norm_rope_tiles_kernel(
    txt_ptr,  # (B, L_txt, H, 128), strides (stride_tb, stride_tl, stride_th, 1); img_ptr when no text
    img_ptr,  # (B, L_img, H, 128), strides (stride_ib, stride_il, stride_ih, 1)
    w_txt_ptr,  # (128,) text RMSNorm weight (w_img_ptr when no text)
    w_img_ptr,  # (128,) image RMSNorm weight
    cos_ptr,  # (L_txt + L_img, 128) fp32 contiguous
    sin_ptr,  # (L_txt + L_img, 128) fp32 contiguous
    out_ptr,  # (B, L_txt + L_img, H, 128), strides (stride_ob, stride_ol, stride_oh, 1)
    L_txt,
    L_joint,
    H,
    eps,
    stride_tb,
    stride_tl,
    stride_th,
    stride_ib,
    stride_il,
    stride_ih,
    stride_ob,
    stride_ol,
    stride_oh,
    TOKS: tl.constexpr,  # tokens per program
    HB: tl.constexpr,  # heads per program
    GPU: tl.constexpr,
):
    # grid: (cdiv(L_joint, TOKS), cdiv(H, HB), B)
    DTYPE = out_ptr.dtype.element_ty
    b = tl.program_id(2).to(tl.int64)
    pos, head, ok = _token_head_tile(L_joint, H, TOKS, HB)
    is_txt = pos < L_txt
    tok_base = tl.where(
        is_txt, txt_ptr + b * stride_tb + pos * stride_tl, img_ptr + b * stride_ib + (pos - L_txt) * stride_il
    )  # (TOKS,)
    stride_h = tl.where(is_txt, stride_th, stride_ih)
    w_base = tl.where(is_txt, w_txt_ptr, w_img_ptr)
    col = tl.arange(0, 128)[None, None, :]
    x = tl.load(tok_base[:, None, None] + head[None, :, None] * stride_h[:, None, None] + col)
    x = upcast(x, GPU)  # (TOKS, HB, 128)
    w = upcast(tl.load(w_base[:, None, None] + col), GPU)  # (TOKS, 1, 128)
    out = _norm_rope_tile(x, w, cos_ptr, sin_ptr, pos, col, eps, TOKS, HB, True, DTYPE, GPU)
    out_off = b * stride_ob + pos[:, None, None] * stride_ol + head[None, :, None] * stride_oh + col
    tl.store(out_ptr + out_off, to_storage(out, DTYPE, GPU), mask=ok)


def check_heads(op: str, name: str, x: Tensor) -> None:
    """`x` is (B, L, H, 128), read through its strides."""
    if x.ndim != 4 or x.shape[-1] != HEAD_DIM:
        raise UnsupportedInput(f"{op}: {name} must be (B, L, H, {HEAD_DIM}), got {tuple(x.shape)}")
    check_strided(op, **{name: x})


def check_norm_weight(op: str, name: str, w: Tensor) -> None:
    """`w` is a (128,) RMSNorm weight, contiguous and aligned as aten's vectorised kernel reads it."""
    check_shape(op, name, w, (HEAD_DIM,))
    if w.stride(0) != 1:
        raise UnsupportedInput(f"{op}: {name} must be contiguous, got stride {w.stride()}")
    check_aten_vectorized(op, name, w)


def check_rope_tables(op: str, cos: Tensor, sin: Tensor, length: int) -> None:
    """`cos` and `sin` are fp32 (L, 128) and contiguous."""
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32:
            raise UnsupportedInput(f"{op}: {name} must be fp32, got {t.dtype}")
        check_shape(op, name, t, (length, HEAD_DIM))
        if not t.is_contiguous():
            raise UnsupportedInput(f"{op}: {name} must be contiguous")


def _check_stream(op: str, name: str, x: Tensor, w: Tensor) -> None:
    check_heads(op, name, x)
    check_aten_vectorized(op, name, x)
    check_norm_weight(op, f"{name} weight", w)


def qk_norm_rope_triton(
    x_txt: Tensor | None,
    x_img: Tensor,
    weight_txt: Tensor | None,
    weight_img: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    head_major: bool = True,
    *,
    variant: str | None = None,
    heads_per_program: int = 8,
    tokens_per_program: int = 8,
) -> Tensor:
    """Fused `qk_norm_rope_reference` → (B, L_txt + L_img, H, 128), stored as the reference stores it:
    head-major ((B, H, L, 128) contiguous, returned permuted) when `head_major`, else contiguous.

    Streams may be strided views (unit last stride); weights bf16/fp16 like the streams (a weight of
    another dtype sends aten down its composite RMSNorm path, which this kernel does not replay).
    `variant` "v1" or "v2" (default `VARIANT`); v1 tiles one token x `heads_per_program` heads, v2
    `tokens_per_program` tokens x `heads_per_program` heads. Both write through the output's strides.
    """
    op = "qk_norm_rope"
    variant = VARIANT if variant is None else variant
    if variant not in VARIANTS:
        raise ValueError(f"{op}: unknown variant {variant!r}; expected one of {VARIANTS}")
    txt_stream = optional_stream(op, x_txt=x_txt, weight_txt=weight_txt)
    check_inputs(op, cos, sin, x_img=x_img, weight_img=weight_img, **txt_stream)
    _check_stream(op, "x_img", x_img, weight_img)
    b, l_img, h, _ = x_img.shape
    l_txt = 0
    if x_txt is not None and weight_txt is not None:
        _check_stream(op, "x_txt", x_txt, weight_txt)
        l_txt = check_joins(op, "x_txt", x_txt, "x_img", x_img)
    l_joint = l_txt + l_img
    if b == 0 or l_joint == 0 or h == 0:
        raise UnsupportedInput(f"{op}: empty input {tuple(x_img.shape)}")
    check_rope_tables(op, cos, sin, l_joint)
    out = empty_heads(b, l_joint, h, HEAD_DIM, dtype=x_img.dtype, device=x_img.device, head_major=head_major)
    check_int32_offsets(op, "out", out)
    txt = x_txt if x_txt is not None else x_img
    w_txt = weight_txt if weight_txt is not None else weight_img
    strides = (txt.stride(0), txt.stride(1), txt.stride(2), x_img.stride(0), x_img.stride(1), x_img.stride(2))
    strides += (out.stride(0), out.stride(1), out.stride(2))
    if variant == "v1":
        _qk_norm_rope_kernel[(b * l_joint, triton.cdiv(h, heads_per_program))](
            txt, x_img, w_txt, weight_img, cos, sin, out, l_txt, l_joint, h, eps, *strides,
            HEADS=heads_per_program, num_warps=4, **EXACT,
        )  # fmt: skip
    else:
        _qk_norm_rope_tiles_kernel[row_tiles(b, l_joint, h, tokens_per_program, heads_per_program)](
            txt, x_img, w_txt, weight_img, cos, sin, out, l_txt, l_joint, h, eps, *strides,
            TOKS=tokens_per_program, HB=heads_per_program, num_warps=4, **EXACT,
        )  # fmt: skip
    return out


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`torch.nn.RMSNorm` over the last dim (aten's fused kernel: weight applied in fp32, one rounding)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, head_major: bool = False) -> Tensor:
    """Rotate interleaved channel pairs of `x` (B, L, H, D) by the (L, D) fp32 tables `cos`, `sin`;
    the result stored head-major when `head_major` (`cast_heads`: the same values)."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return cast_heads(x.float() * cos + x_rotated.float() * sin, x.dtype, head_major)


def qk_norm_rope_reference(
    x_txt: Tensor | None,
    x_img: Tensor,
    weight_txt: Tensor | None,
    weight_img: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    head_major: bool = True,
) -> Tensor:
    """Normalise `x_txt` (B, L_txt, H, D) and `x_img` (B, L_img, H, D), join them text first, rotate.

    `x_txt` is None in single-stream blocks, where `x_img` already holds the joint sequence.
    Returns (B, L_txt + L_img, H, D) in the input dtype; its storage head-major ((B, H, L, D) contiguous,
    what SDPA reads best) when `head_major`, else contiguous. The cast back writes that layout directly.
    """
    x = rms_norm_reference(x_img, weight_img, eps)
    if x_txt is not None:
        assert weight_txt is not None
        x = torch.cat([rms_norm_reference(x_txt, weight_txt, eps), x], dim=1)
    return rope_reference(x, cos, sin, head_major)


_QK_NORM_ROPE = FusedOp("qk_norm_rope", fused=qk_norm_rope_triton, reference=qk_norm_rope_reference)


def qk_norm_rope(
    x_txt: Tensor | None,
    x_img: Tensor,
    weight_txt: Tensor | None,
    weight_img: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    head_major: bool = True,
) -> Tensor:
    """QK-norm + RoPE; see `qk_norm_rope_reference` (fused when `dispatch` allows). The models pass
    `head_major=is_head_major("q")` (or "k"): the layout `HEAD_MAJOR` sets."""
    return run_op(_QK_NORM_ROPE, x_txt, x_img, weight_txt, weight_img, cos, sin, eps, head_major)
