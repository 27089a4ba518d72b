"""LayerNorm (no affine) + modulate with per-token shift and scale, one stream or two joined (FLUX.3).

FLUX.3 modulates every token with its own row: `(1 + scale) * LayerNorm(x) + shift` with shift/scale
(B, L, D) (chunks of a per-token projection, row stride 3D). Its joint blocks modulate the text and the
content streams apart and concatenate them, text first; the two-stream form writes both modulated
streams straight into the joint (B, L_txt + L, D) buffer, so no `torch.cat` pass remains.

The statistics replay aten's `vectorized_layer_norm_kernel` exactly as `layer_norm_modulate` does (its
Welford push and lane/warp tree are reused from there); then modulate's three roundings,
`r(r(r(rstd * (x - mean)) * r(1 + scale)) + shift)`, with the scale and shift rows of each token.

`token_layer_norm_modulate_fp8` is the same kernel with an e4m3 epilogue for FP8 consumers (FLUX.3's q, k, v
and MLP input projections read one modulated input): it quantizes the 16-bit value above, never the fp32 one,
with a static scale or one scale per token from that row's absmax (the row is in registers already), so it is
`torch.equal` to the 16-bit op followed by `quantize_reference`. The joint form writes `[txt | content]`
straight into one e4m3 buffer: no 16-bit copy of the block input exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, run_op
from flux_runtime.kernels.fp8 import Fp8Act, check_quant, quantize_reference
from flux_runtime.kernels.launch import (
    check_aten_vectorized,
    check_bld,
    check_inputs,
    check_joins,
    check_strided,
    empty_out,
    optional_stream,
)
from flux_runtime.kernels.layer_norm_modulate import (
    _check_width,
    _read_rows,
    _row_block,
    _rows_consts,
    _rows_fp8,
    _rows_quant,
    _write_rows,
)
from flux_runtime.kernels.triton_utils import jit, tl, triton

_THREADS = 128  # aten's block: 32 lanes × 4 warps, one row per block
_VEC = 4  # aten's vec_size for every dtype
# Rows per program by default: one. The rows share no scale/shift loads here (each token has its own), and a
# second row doubles the registers (sm_90, D = 3072: 96 with one row, 204 with two: 5 blocks per SM fall to 2).
ROWS_PER_PROGRAM = 1


@jit
def _token_layer_norm_modulate_kernel(
    xa_ptr,  # (B, La, D), strides (s_xa_b, s_xa_l, 1): the first stream (text), xb_ptr when La = 0
    sha_ptr,  # (B, La, D), strides (s_sha_b, s_sha_l, 1): its per-token shift
    sca_ptr,  # (B, La, D), strides (s_sca_b, s_sca_l, 1): its per-token scale
    xb_ptr,  # (B, L - La, D), strides (s_xb_b, s_xb_l, 1): the second stream (content)
    shb_ptr,  # (B, L - La, D), strides (s_shb_b, s_shb_l, 1)
    scb_ptr,  # (B, L - La, D), strides (s_scb_b, s_scb_l, 1)
    out_ptr,  # (B, L, D) contiguous: [modulated a | modulated b] (QUANT: uint8 e4m3 bits)
    q_scale_ptr,  # QUANT 2: (B * L,) fp32 row scales written; otherwise unused
    q_inv_ptr,  # QUANT 1: 0-dim fp32 1 / input_scale read; otherwise unused
    La,
    L,
    D,
    eps,
    s_xa_b,
    s_xa_l,
    s_sha_b,
    s_sha_l,
    s_sca_b,
    s_sca_l,
    s_xb_b,
    s_xb_l,
    s_shb_b,
    s_shb_l,
    s_scb_b,
    s_scb_l,
    ITERS: tl.constexpr,  # cdiv(D, 512): 4-element vectors each aten thread reads
    EVEN: tl.constexpr,  # D % 512 == 0: no masks, every Welford count a constant
    ROWS: tl.constexpr,  # rows per program, held in registers side by side (lanes x rows, as v2)
    QUANT: tl.constexpr,  # 0: store y; 1: store e4m3(y) with a static scale; 2: with per-row scales
    GPU: tl.constexpr,
    HW_E4M3: tl.constexpr,  # e4m3_code's hardware conversion (triton_utils.e4m3_consts)
    DTYPE: tl.constexpr,  # the activations' dtype (out_ptr holds bytes when QUANT)
):
    # grid: (cdiv(L, ROWS), B); a program's rows may straddle the two streams
    b, pos, row_ok = _row_block(L, ROWS)
    in_a = pos < La
    pos_b = pos - La
    x_row = tl.where(
        in_a, xa_ptr + b * s_xa_b + pos * s_xa_l, xb_ptr + b * s_xb_b + pos_b * s_xb_l
    )  # (ROWS,)
    sh_row = tl.where(in_a, sha_ptr + b * s_sha_b + pos * s_sha_l, shb_ptr + b * s_shb_b + pos_b * s_shb_l)
    sc_row = tl.where(in_a, sca_ptr + b * s_sca_b + pos * s_sca_l, scb_ptr + b * s_scb_b + pos_b * s_scb_l)
    out_row = (b * L + pos) * D
    # pass 1: every load, each lane's Welford in aten's order; pass 2: normalise, modulate with the token's own
    # scale and shift rows, store
    xs, scales, shifts, mean, rstd = _read_rows(
        x_row, sc_row, sh_row, x_row, x_row, b, 0, 0, 0, D, eps, ITERS, EVEN, ROWS, True, False, DTYPE, GPU
    )
    _write_rows(
        xs, scales, shifts, mean, rstd, out_ptr, out_ptr, q_scale_ptr, q_inv_ptr, out_row, b, L, pos, row_ok, D,
        ITERS, EVEN, ROWS, True, False, QUANT, HW_E4M3, DTYPE, GPU,
    )  # fmt: skip


def _check_stream(op: str, name: str, x: Tensor, shift: Tensor, scale: Tensor) -> None:
    check_bld(op, name, x)
    check_strided(op, tuple(x.shape), **{f"{name} shift": shift, f"{name} scale": scale})
    # aten normalises a contiguous x in place (a misaligned one takes another kernel); others it copies
    check_aten_vectorized(op, name, x)


def token_layer_norm_modulate_triton(
    x_txt: Tensor | None,
    shift_txt: Tensor | None,
    scale_txt: Tensor | None,
    x: Tensor,
    shift: Tensor,
    scale: Tensor,
    eps: float = 1e-6,
    *,
    rows_per_program: int | None = None,
) -> Tensor:
    """Fused `token_layer_norm_modulate_reference` → (B, L_txt + L, D) contiguous.

    Every tensor is (B, L_stream, D) with a unit last stride (shift/scale typically chunks of a (B, L, 3D)
    projection); the text stream (`x_txt`, `shift_txt`, `scale_txt`) is optional, all three or none.
    """
    args = (x_txt, shift_txt, scale_txt, x, shift, scale)
    out = _launch("token_layer_norm_modulate", args, eps, rows_per_program, None)
    assert isinstance(out, Tensor)
    return out


def _launch(
    op: str,
    args: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor, Tensor],
    eps: float,
    rows_per_program: int | None,
    quant: tuple[Tensor | None, Tensor | None] | None,
) -> Tensor | Fp8Act:
    """Check and launch the kernel: the 16-bit output, or (with `quant`) its e4m3 with the scale(s)."""
    x_txt, shift_txt, scale_txt, x, shift, scale = args
    txt = optional_stream(op, x_txt=x_txt, shift_txt=shift_txt, scale_txt=scale_txt)
    check_inputs(op, *(t for t in quant or () if t is not None), x=x, shift=shift, scale=scale, **txt)
    _check_stream(op, "x", x, shift, scale)
    b, n, d = x.shape
    _check_width(op, d)
    n_txt = 0
    a = (x, shift, scale)  # the first stream's pointers, never read without a text stream (La = 0)
    if x_txt is not None and shift_txt is not None and scale_txt is not None:
        _check_stream(op, "x_txt", x_txt, shift_txt, scale_txt)
        n_txt = check_joins(op, "x_txt", x_txt, "x", x)
        a = (x_txt, shift_txt, scale_txt)
    length = n_txt + n
    if quant is not None:
        check_quant(op, *quant)
    mode, q_scale, q_inv = _rows_quant(quant, b, length, shift)
    out = empty_out(op, (b, length, d), x, None if quant is None else torch.uint8)
    rows = ROWS_PER_PROGRAM if rows_per_program is None else rows_per_program
    strides = [s for t in (*a, x, shift, scale) for s in (t.stride(0), t.stride(1))]
    _token_layer_norm_modulate_kernel[(triton.cdiv(length, rows), b)](
        *a,
        x,
        shift,
        scale,
        out,
        q_scale,
        q_inv,
        n_txt,
        length,
        d,
        eps,
        *strides,
        **_rows_consts(x, rows, mode),
    )
    return out if quant is None else _rows_fp8(out, mode, q_scale)


def _modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float) -> Tensor:
    return (1 + scale) * F.layer_norm(x, (x.shape[-1],), None, None, eps) + shift


def token_layer_norm_modulate_reference(
    x_txt: Tensor | None,
    shift_txt: Tensor | None,
    scale_txt: Tensor | None,
    x: Tensor,
    shift: Tensor,
    scale: Tensor,
    eps: float = 1e-6,
) -> Tensor:
    """`(1 + scale) * LayerNorm(x) + shift` per token (shift/scale (B, L, D)); with a text stream, its own
    modulation of `x_txt` concatenated before it along the sequence: (B, L_txt + L, D)."""
    y = _modulate(x, shift, scale, eps)
    if x_txt is None:
        return y
    assert shift_txt is not None and scale_txt is not None
    return torch.cat([_modulate(x_txt, shift_txt, scale_txt, eps), y], dim=1)


_TOKEN_LAYER_NORM_MODULATE = FusedOp(
    "token_layer_norm_modulate",
    fused=token_layer_norm_modulate_triton,
    reference=token_layer_norm_modulate_reference,
)


def token_layer_norm_modulate(
    x_txt: Tensor | None,
    shift_txt: Tensor | None,
    scale_txt: Tensor | None,
    x: Tensor,
    shift: Tensor,
    scale: Tensor,
    eps: float = 1e-6,
) -> Tensor:
    """Per-token LayerNorm + modulate; see `token_layer_norm_modulate_reference` (fused when allowed)."""
    return run_op(_TOKEN_LAYER_NORM_MODULATE, x_txt, shift_txt, scale_txt, x, shift, scale, eps)


# --------------------------------------------------------------------------------------------------
# e4m3 output for FP8 consumers: the 16-bit value above, then the consumer's quantization (no 16-bit copy)


def token_layer_norm_modulate_fp8_triton(
    x_txt: Tensor | None,
    shift_txt: Tensor | None,
    scale_txt: Tensor | None,
    x: Tensor,
    shift: Tensor,
    scale: Tensor,
    eps: float,
    q_scale: Tensor | None,
    q_inv: Tensor | None,
    *,
    rows_per_program: int | None = None,
) -> Fp8Act:
    """Fused `token_layer_norm_modulate_fp8_reference`: the e4m3 (B, L_txt + L, D) with its scale(s).

    Static (`q_scale`, `q_inv = 1 / q_scale`, one fp32 value each) or, with both None, one scale per
    token computed from the row's rounded values in the same pass (returned (B, L_txt + L, 1)).
    """
    args = (x_txt, shift_txt, scale_txt, x, shift, scale)
    out = _launch("token_layer_norm_modulate_fp8", args, eps, rows_per_program, (q_scale, q_inv))
    assert isinstance(out, Fp8Act)
    return out


def token_layer_norm_modulate_fp8_reference(
    x_txt: Tensor | None,
    shift_txt: Tensor | None,
    scale_txt: Tensor | None,
    x: Tensor,
    shift: Tensor,
    scale: Tensor,
    eps: float,
    q_scale: Tensor | None,
    q_inv: Tensor | None,
) -> Fp8Act:
    """`quantize_reference(token_layer_norm_modulate_reference(...), q_scale, q_inv)`."""
    y = token_layer_norm_modulate_reference(x_txt, shift_txt, scale_txt, x, shift, scale, eps)
    return quantize_reference(y, q_scale, q_inv)


_TOKEN_LAYER_NORM_MODULATE_FP8 = FusedOp(
    "token_layer_norm_modulate_fp8",
    fused=token_layer_norm_modulate_fp8_triton,
    reference=token_layer_norm_modulate_fp8_reference,
)


def token_layer_norm_modulate_fp8(
    x_txt: Tensor | None,
    shift_txt: Tensor | None,
    scale_txt: Tensor | None,
    x: Tensor,
    shift: Tensor,
    scale: Tensor,
    eps: float = 1e-6,
    q_scale: Tensor | None = None,
    q_inv: Tensor | None = None,
) -> Fp8Act:
    """Per-token LayerNorm + modulate in e4m3 for FP8 consumers: static (`q_scale`, `q_inv`) or per-token
    scales; the joint form writes `[txt | content]` into one e4m3 buffer (fused when `dispatch` allows)."""
    return run_op(
        _TOKEN_LAYER_NORM_MODULATE_FP8, x_txt, shift_txt, scale_txt, x, shift, scale, eps, q_scale, q_inv
    )
