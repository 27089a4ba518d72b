"""Attention inputs written in e4m3 by their producers: q and k from QK-norm + RoPE, v from the QKV projection.

The FP8 attention (`attention_backends`, FA3's e4m3 path) reads q, k, v as e4m3 codes with one fp32 descale per
(batch, head) (`attention_quant`). Quantizing bf16 q, k, v eagerly costs more than the FP8 attention saves
(issue 36), so the values are quantized where they are made:

- `qk_norm_rope_fp8`: the joint `[txt | img]` q or k of a double block (or a single block's, no text), RMS-normed
  and rotated exactly as `qk_norm_rope` computes it (the same tile code, rounded to the model dtype as the lossless
  kernel stores it), then quantized with its head's scale;
- `heads_fp8`: the joint v from the projection's strided views (two streams in a double block, one in a single).

A head's scale needs the absolute maximum over all of its tokens before any code can be written, and FA3 takes
nothing finer than one scale per (batch, head) (its descales are (batch, heads_k)), so per-block scales are no
option. Two passes over the same tiles: the first computes the values and raises each head's maximum with an
integer `atomic_max` on the fp32 bit pattern (non-negative floats order as their bits, and a maximum does not
depend on the order: deterministic), the second recomputes the values (cheaper than writing and re-reading them:
the norm and rotation are a few instructions per element, the inputs 2 bytes, the codes 1) and writes the codes
and the descales. Quantizing the model-dtype value, not the unrounded fp32 one, makes each producer
`torch.equal` to the eager chain `qk_norm_rope_reference` → `quantize_heads_reference` (so an eager-quantized
bench input is the same bytes); the bf16 rounding is 16 times finer than e4m3's. K smoothing is not applied
here (`attention_quant` measures it).

Both ops are bit-exact against their reference chain and are verified like the lossless kernels on first use;
only the `high` tier's FP8 attention calls them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flux_runtime.kernels.attention_quant import Fp8Heads, quantize_heads_reference
from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.fp8 import E4M3
from flux_runtime.kernels.launch import EXACT, check_inputs, check_int32_offsets, check_joins, optional_stream
from flux_runtime.kernels.qk_norm_rope import (
    HEAD_DIM,
    _check_stream,
    _norm_rope_tile,
    _token_head_tile,
    check_heads,
    check_rope_tables,
    empty_heads,
    qk_norm_rope_reference,
)
from flux_runtime.kernels.triton_utils import (
    e4m3_code,
    e4m3_consts,
    e4m3_row_scale,
    jit,
    round_to,
    tl,
    triton,
    upcast,
)


@jit
def _tile_values(
    txt_ptr, img_ptr, w_txt_ptr, w_img_ptr, cos_ptr, sin_ptr, L_txt, L_joint, H, eps,
    stride_tb, stride_tl, stride_th, stride_ib, stride_il, stride_ih,
    NORM: tl.constexpr, TOKS: tl.constexpr, HB: tl.constexpr, GPU: tl.constexpr,
):  # fmt: skip
    """This program's (TOKS, HB, 128) tile of the joint `[txt | img]` heads as fp32: RMS-normed and rotated
    (rounded to the input dtype, the value `qk_norm_rope` stores) when NORM, else the inputs themselves.
    Returns (batch, positions, heads, the (TOKS, HB, 1) store mask, the column offsets, the values)."""
    DTYPE = img_ptr.dtype.element_ty
    b = tl.program_id(2).to(tl.int64)
    pos, head, ok = _token_head_tile(L_joint, H, TOKS, HB)
    is_txt = pos < L_txt
    tok_base = tl.where(
        is_txt, txt_ptr + b * stride_tb + pos * stride_tl, img_ptr + b * stride_ib + (pos - L_txt) * stride_il
    )
    stride_h = tl.where(is_txt, stride_th, stride_ih)
    col = tl.arange(0, 128)[None, None, :]
    x = upcast(tl.load(tok_base[:, None, None] + head[None, :, None] * stride_h[:, None, None] + col), GPU)
    if NORM:
        w_base = tl.where(is_txt, w_txt_ptr, w_img_ptr)
        w = upcast(tl.load(w_base[:, None, None] + col), GPU)
        x = _norm_rope_tile(x, w, cos_ptr, sin_ptr, pos, col, eps, TOKS, HB, True, DTYPE, GPU)
        x = round_to(x, DTYPE, GPU)
    return b, pos, head, ok, col, x


@jit
def _heads_amax_kernel(
    txt_ptr, img_ptr, w_txt_ptr, w_img_ptr, cos_ptr, sin_ptr,
    amax_ptr,  # (B * H,) int32, zeroed: each head's max |value| as fp32 bits (raised here)
    L_txt, L_joint, H, eps, stride_tb, stride_tl, stride_th, stride_ib, stride_il, stride_ih,
    NORM: tl.constexpr, TOKS: tl.constexpr, HB: tl.constexpr, GPU: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(L_joint, TOKS), cdiv(H, HB), B); surplus tokens and heads re-read valid rows (`_token_head_tile`),
    # whose values are the heads' own: raising the maximum with them changes nothing
    b, _pos, head, _ok, _col, x = _tile_values(
        txt_ptr, img_ptr, w_txt_ptr, w_img_ptr, cos_ptr, sin_ptr, L_txt, L_joint, H, eps,
        stride_tb, stride_tl, stride_th, stride_ib, stride_il, stride_ih, NORM, TOKS, HB, GPU,
    )  # fmt: skip
    m = tl.max(tl.max(tl.abs(x), axis=2), axis=0)  # (HB,)
    tl.atomic_max(amax_ptr + b * H + head, m.to(tl.int32, bitcast=True))


@jit
def _heads_quant_kernel(
    txt_ptr, img_ptr, w_txt_ptr, w_img_ptr, cos_ptr, sin_ptr,
    amax_ptr,  # (B * H,) int32: `_heads_amax_kernel`'s maxima
    out_ptr,  # (B, L_joint, H, 128) uint8 (e4m3 codes), strides (stride_ob, stride_ol, stride_oh, 1)
    descale_ptr,  # (B * H,) fp32: each head's scale (written)
    L_txt, L_joint, H, eps, stride_tb, stride_tl, stride_th, stride_ib, stride_il, stride_ih,
    stride_ob, stride_ol, stride_oh,
    NORM: tl.constexpr, TOKS: tl.constexpr, HB: tl.constexpr, GPU: tl.constexpr, HW_E4M3: tl.constexpr,
):  # fmt: skip
    # grid: as `_heads_amax_kernel`'s
    b, pos, head, ok, col, x = _tile_values(
        txt_ptr, img_ptr, w_txt_ptr, w_img_ptr, cos_ptr, sin_ptr, L_txt, L_joint, H, eps,
        stride_tb, stride_tl, stride_th, stride_ib, stride_il, stride_ih, NORM, TOKS, HB, GPU,
    )  # fmt: skip
    amax = tl.load(amax_ptr + b * H + head).to(tl.float32, bitcast=True)  # (HB,)
    scale, inv = e4m3_row_scale(amax)
    code = e4m3_code(x * inv[None, :, None], HW_E4M3)
    out_off = b * stride_ob + pos[:, None, None] * stride_ol + head[None, :, None] * stride_oh + col
    tl.store(out_ptr + out_off, code, mask=ok)
    if tl.program_id(0) == 0:
        own = tl.program_id(1) * HB + tl.arange(0, HB) < H
        tl.store(descale_ptr + b * H + head, scale, mask=own)


def _launch(
    txt: Tensor,
    img: Tensor,
    w_txt: Tensor,
    w_img: Tensor,
    cos: Tensor,
    sin: Tensor,
    l_txt: int,
    eps: float,
    norm: bool,
    head_major: bool,
    tokens_per_program: int,
    heads_per_program: int,
) -> Fp8Heads:
    """Both passes over the joint heads of `txt` (its first `l_txt` tokens; `img` itself when no text) and `img`."""
    op = "qk_norm_rope_fp8" if norm else "heads_fp8"
    b, l_img, h, _ = img.shape
    l_joint = l_txt + l_img
    if b == 0 or l_joint == 0 or h == 0:
        raise UnsupportedInput(f"{op}: empty input {tuple(img.shape)}")
    out = empty_heads(b, l_joint, h, HEAD_DIM, dtype=E4M3, device=img.device, head_major=head_major)
    check_int32_offsets(op, "out", out)
    amax = torch.zeros(b * h, dtype=torch.int32, device=img.device)
    descale = torch.empty(b, h, dtype=torch.float32, device=img.device)
    strides = (txt.stride(0), txt.stride(1), txt.stride(2), img.stride(0), img.stride(1), img.stride(2))
    grid = (triton.cdiv(l_joint, tokens_per_program), triton.cdiv(h, heads_per_program), b)
    common = (txt, img, w_txt, w_img, cos, sin, amax)
    tiles = {"NORM": norm, "TOKS": tokens_per_program, "HB": heads_per_program, "num_warps": 4, **EXACT}
    _heads_amax_kernel[grid](*common, l_txt, l_joint, h, eps, *strides, **tiles)
    codes = out.view(torch.uint8)
    _heads_quant_kernel[grid](
        *common, codes, descale, l_txt, l_joint, h, eps, *strides,
        codes.stride(0), codes.stride(1), codes.stride(2), **tiles, **e4m3_consts(img.device),
    )  # fmt: skip
    return Fp8Heads(out, descale)


def qk_norm_rope_fp8_triton(
    x_txt: Tensor | None,
    x_img: Tensor,
    weight_txt: Tensor | None,
    weight_img: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    head_major: bool = True,
    *,
    tokens_per_program: int = 8,
    heads_per_program: int = 8,
) -> Fp8Heads:
    """`qk_norm_rope_fp8_reference` in two Triton passes (module docstring); inputs as `qk_norm_rope_triton`'s."""
    op = "qk_norm_rope_fp8"
    txt_stream = optional_stream(op, x_txt=x_txt, weight_txt=weight_txt)
    check_inputs(op, cos, sin, x_img=x_img, weight_img=weight_img, **txt_stream)
    _check_stream(op, "x_img", x_img, weight_img)
    l_txt = 0
    if x_txt is not None and weight_txt is not None:
        _check_stream(op, "x_txt", x_txt, weight_txt)
        l_txt = check_joins(op, "x_txt", x_txt, "x_img", x_img)
    check_rope_tables(op, cos, sin, l_txt + x_img.shape[1])
    txt = x_txt if x_txt is not None else x_img
    w_txt = weight_txt if weight_txt is not None else weight_img
    return _launch(
        txt, x_img, w_txt, weight_img, cos, sin, l_txt, eps, True, head_major, tokens_per_program,
        heads_per_program,
    )  # fmt: skip


def heads_fp8_triton(
    x_txt: Tensor | None,
    x_img: Tensor,
    head_major: bool = True,
    *,
    tokens_per_program: int = 8,
    heads_per_program: int = 8,
) -> Fp8Heads:
    """`heads_fp8_reference` in two Triton passes; `x_txt`, `x_img` (B, L, H, 128) strided views."""
    op = "heads_fp8"
    check_inputs(op, x_img=x_img, **optional_stream(op, x_txt=x_txt))
    check_heads(op, "x_img", x_img)
    l_txt = 0
    if x_txt is not None:
        check_heads(op, "x_txt", x_txt)
        l_txt = check_joins(op, "x_txt", x_txt, "x_img", x_img)
    txt = x_txt if x_txt is not None else x_img
    return _launch(
        txt, x_img, x_img, x_img, x_img, x_img, l_txt, 0.0, False, head_major, tokens_per_program,
        heads_per_program,
    )  # fmt: skip


def qk_norm_rope_fp8_reference(
    x_txt: Tensor | None,
    x_img: Tensor,
    weight_txt: Tensor | None,
    weight_img: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    head_major: bool = True,
) -> Fp8Heads:
    """`qk_norm_rope_reference` (the lossless q or k), then one e4m3 scale per (batch, head)
    (`quantize_heads_reference`), the codes stored head-major when `head_major`."""
    x = qk_norm_rope_reference(x_txt, x_img, weight_txt, weight_img, cos, sin, eps, head_major)
    return quantize_heads_reference(x, head_major=head_major)


def heads_fp8_reference(x_txt: Tensor | None, x_img: Tensor, head_major: bool = True) -> Fp8Heads:
    """The joint `[txt | img]` heads (`x_img` alone when `x_txt` is None) in e4m3, one scale per (batch, head)."""
    x = x_img if x_txt is None else torch.cat([x_txt, x_img], dim=1)
    return quantize_heads_reference(x, head_major=head_major)


_QK_NORM_ROPE_FP8 = FusedOp(
    "qk_norm_rope_fp8", fused=qk_norm_rope_fp8_triton, reference=qk_norm_rope_fp8_reference
)
_HEADS_FP8 = FusedOp("heads_fp8", fused=heads_fp8_triton, reference=heads_fp8_reference)


def qk_norm_rope_fp8(
    x_txt: Tensor | None,
    x_img: Tensor,
    weight_txt: Tensor | None,
    weight_img: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    head_major: bool = True,
) -> Fp8Heads:
    """QK-norm + RoPE written in e4m3 with per-head descales; see `qk_norm_rope_fp8_reference` (fused when
    `dispatch` allows, verified bit-exact on first use)."""
    return run_op(_QK_NORM_ROPE_FP8, x_txt, x_img, weight_txt, weight_img, cos, sin, eps, head_major)


def heads_fp8(x_txt: Tensor | None, x_img: Tensor, head_major: bool = True) -> Fp8Heads:
    """The joint v in e4m3 with per-head descales; see `heads_fp8_reference` (fused when `dispatch` allows)."""
    return run_op(_HEADS_FP8, x_txt, x_img, head_major)
