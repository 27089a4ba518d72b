"""Per-token gated residual of two summed updates, `x + gate * (a + b)`, one stream or two (FLUX.3).

A FLUX.3 block adds its attention and MLP outputs (one bf16 op), multiplies by the per-token gate (B, L, D)
and adds the product to the stream: three eager ops, each rounding once, so the fused kernel keeps the
three roundings `r(x + r(gate * r(a + b)))` (lossless: one rounding per eager op, no FMA across them).
In the joint blocks `a + b` covers `[txt | content]` and each stream takes its own rows with its own
gate; the two-stream form writes both updated streams from the joint updates in one launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.launch import EXACT, check_bld, check_inputs, check_joins, check_strided, row_tiles
from flux_runtime.kernels.triton_utils import jit, round_to, row_tile, tl, to_storage, triton, upcast


@jit
def _token_gated_residual_kernel(
    xa_ptr,  # (B, La, D), strides (s_xa_b, s_xa_l, 1): the first stream's residual (text), xb_ptr when La = 0
    ga_ptr,  # (B, La, D), strides (s_ga_b, s_ga_l, 1): its per-token gate
    xb_ptr,  # (B, L - La, D), strides (s_xb_b, s_xb_l, 1): the second stream's residual (content)
    gb_ptr,  # (B, L - La, D), strides (s_gb_b, s_gb_l, 1)
    a_ptr,  # (B, L, D), strides (s_a_b, s_a_l, 1): first update (attention), over both streams
    b_ptr,  # (B, L, D), strides (s_b_b, s_b_l, 1): second update (MLP)
    outa_ptr,  # (B, La, D) contiguous: the first stream updated (outb_ptr when La = 0)
    outb_ptr,  # (B, L - La, D) contiguous
    La,
    L,
    D,
    s_xa_b,
    s_xa_l,
    s_ga_b,
    s_ga_l,
    s_xb_b,
    s_xb_l,
    s_gb_b,
    s_gb_l,
    s_a_b,
    s_a_l,
    s_b_b,
    s_b_l,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GPU: tl.constexpr,
):
    # grid: (cdiv(L, BLOCK_L), cdiv(D, BLOCK_D), B); a program's rows may straddle the two streams
    DTYPE = outb_ptr.dtype.element_ty
    bi, pos, cols, mask = row_tile(L, D, BLOCK_L, BLOCK_D)
    pos = tl.minimum(pos, L - 1).to(tl.int64)  # surplus rows re-read the last row, never stored
    in_a = pos < La
    pos_b = pos - La
    x_row = tl.where(in_a, xa_ptr + bi * s_xa_b + pos * s_xa_l, xb_ptr + bi * s_xb_b + pos_b * s_xb_l)
    g_row = tl.where(in_a, ga_ptr + bi * s_ga_b + pos * s_ga_l, gb_ptr + bi * s_gb_b + pos_b * s_gb_l)
    out_row = tl.where(in_a, outa_ptr + (bi * La + pos) * D, outb_ptr + (bi * (L - La) + pos_b) * D)
    c = cols[None, :]
    x = tl.load(x_row[:, None] + c, mask=mask, other=0.0)
    g = tl.load(g_row[:, None] + c, mask=mask, other=0.0)
    ua = tl.load(a_ptr + bi * s_a_b + pos[:, None] * s_a_l + c, mask=mask, other=0.0)
    ub = tl.load(b_ptr + bi * s_b_b + pos[:, None] * s_b_l + c, mask=mask, other=0.0)
    update = round_to(upcast(ua, GPU) + upcast(ub, GPU), DTYPE, GPU)  # r(a + b)
    prod = round_to(upcast(g, GPU) * update, DTYPE, GPU)  # r(gate * update)
    tl.store(out_row[:, None] + c, to_storage(upcast(x, GPU) + prod, DTYPE, GPU), mask=mask)  # r(x + prod)


def _launch(
    op: str, txt: tuple[Tensor, Tensor] | None, x: Tensor, gate: Tensor, a: Tensor, b: Tensor,
    block_l: int, block_d: int,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    named = {"x": x, "gate": gate, "a": a, "b": b}
    if txt is not None:
        named |= {"x_txt": txt[0], "gate_txt": txt[1]}
    check_inputs(op, **named)
    bsz, n, d = check_bld(op, "x", x)
    check_strided(op, (bsz, n, d), gate=gate)
    n_txt = 0
    if txt is not None:
        x_txt, gate_txt = txt
        n_txt = check_joins(op, "x_txt", x_txt, "x", x)
        if n_txt == 0:
            raise UnsupportedInput(f"{op}: x_txt is empty")
        check_strided(op, tuple(x_txt.shape), x_txt=x_txt, gate_txt=gate_txt)
    length = n_txt + n
    check_strided(op, (bsz, length, d), a=a, b=b)
    out = torch.empty((bsz, n, d), dtype=x.dtype, device=x.device)
    out_txt = torch.empty((bsz, n_txt, d), dtype=x.dtype, device=x.device) if txt is not None else None
    xa, ga, oa = (txt[0], txt[1], out_txt) if txt is not None and out_txt is not None else (x, gate, out)
    block_d = min(block_d, triton.next_power_of_2(d))
    strides = [s for t in (xa, ga, x, gate, a, b) for s in (t.stride(0), t.stride(1))]
    _token_gated_residual_kernel[row_tiles(bsz, length, d, block_l, block_d)](
        xa, ga, x, gate, a, b, oa, out, n_txt, length, d, *strides,
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4, **EXACT,
    )  # fmt: skip
    return out, out_txt


def token_gated_residual_triton(
    x: Tensor, gate: Tensor, a: Tensor, b: Tensor, *, block_l: int = 2, block_d: int = 1024
) -> Tensor:
    """Fused `token_gated_residual_reference`: all four (B, L, D), unit last stride → (B, L, D) contiguous.

    The default 2 x 1024 tile gives each thread 16 elements of each tensor (sm_90: 80 registers; 4 x 1024
    takes 156, since every row carries its own stream's pointers).
    """
    return _launch("token_gated_residual", None, x, gate, a, b, block_l, block_d)[0]


def joint_token_gated_residual_triton(
    x_txt: Tensor, gate_txt: Tensor, x: Tensor, gate: Tensor, a: Tensor, b: Tensor,
    *, block_l: int = 2, block_d: int = 1024,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Fused `joint_token_gated_residual_reference` → (txt, x), each contiguous."""
    out, out_txt = _launch("joint_token_gated_residual", (x_txt, gate_txt), x, gate, a, b, block_l, block_d)
    assert out_txt is not None
    return out_txt, out


def token_gated_residual_reference(x: Tensor, gate: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """`x + gate * (a + b)`, all (B, L, D): the gate per token, `a + b` rounded before the product."""
    return x + gate * (a + b)


def joint_token_gated_residual_reference(
    x_txt: Tensor, gate_txt: Tensor, x: Tensor, gate: Tensor, a: Tensor, b: Tensor
) -> tuple[Tensor, Tensor]:
    """`a + b` over `[txt | x]` (B, L_txt + L, D), split back; each stream `s + gate_s * its rows`."""
    out_txt, out = (a + b).split([x_txt.shape[1], x.shape[1]], dim=1)
    return x_txt + gate_txt * out_txt, x + gate * out


_TOKEN_GATED_RESIDUAL = FusedOp(
    "token_gated_residual", fused=token_gated_residual_triton, reference=token_gated_residual_reference
)
_JOINT_TOKEN_GATED_RESIDUAL = FusedOp(
    "joint_token_gated_residual",
    fused=joint_token_gated_residual_triton,
    reference=joint_token_gated_residual_reference,
)


def token_gated_residual(x: Tensor, gate: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Per-token gated residual of `a + b`; see `token_gated_residual_reference` (fused when allowed)."""
    return run_op(_TOKEN_GATED_RESIDUAL, x, gate, a, b)


def joint_token_gated_residual(
    x_txt: Tensor, gate_txt: Tensor, x: Tensor, gate: Tensor, a: Tensor, b: Tensor
) -> tuple[Tensor, Tensor]:
    """Both streams' gated residuals from joint updates; see `joint_token_gated_residual_reference`."""
    return run_op(_JOINT_TOKEN_GATED_RESIDUAL, x_txt, gate_txt, x, gate, a, b)
