"""The blocks' FP8 attention (`high` on Hopper): e4m3 q, k from QK-norm + RoPE, v from the projection, FA3.

`attention_choice` says which backend a block's attention runs (`kernels.attention_backends`): `sdpa` in every
tier but `high`, in a sequence-parallel run (its attention exchanges bf16 heads), in blocks kept in bf16
(`keep_bf16_attention`) and wherever FP8 attention cannot run; `fa3-fp8` otherwise. The double blocks call
`double_fp8` in place of their bf16 q/k/v and attention; the single blocks rotate q and k straight into e4m3
(`rotate_fp8`) and attend with `single_fp8_heads`, which quantizes v from linear1's output; FLUX.3's blocks call
`flux3_fp8`. Each attention call records the backend it ran (`record_attention`), which the pipeline's
provenance reports.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flux_runtime import kernels
from flux_runtime.kernels.attention_backends import (
    FA3_FP8,
    AttentionChoice,
    choose_attention,
    fa3_fp8_attention,
    record_attention,
)
from flux_runtime.kernels.attention_quant import Fp8Heads
from flux_runtime.kernels.heads_fp8 import heads_fp8, qk_norm_rope_fp8
from flux_runtime.models.dit.layers import EPS, RoPE, attention, write_heads

SEQUENCE_PARALLEL = AttentionChoice("sdpa", "sequence-parallel attention exchanges bf16 heads")
COMPILED = AttentionChoice("sdpa", "under torch.compile")
KEPT_BF16 = AttentionChoice("sdpa", "block kept in bf16 attention (keep_bf16_attention)")


def keep_bf16_attention(model: nn.Module, first: int = 0, last: int = 0) -> None:
    """Keep the first `first` double blocks and the last `last` single blocks of `model` in bf16 attention under
    `high` (the blocks nearest the input and the output, where quantization error may matter most); the others
    keep the backend `attention_choice` picks. `keep_bf16_attention(model)` undoes it."""
    doubles, singles = list(model.double_blocks), list(model.single_blocks)
    for i, block in enumerate(doubles):
        block.bf16_attention = i < first
    for i, block in enumerate(singles):
        block.bf16_attention = i >= len(singles) - last


def attention_choice(block: nn.Module, heads: Tensor) -> AttentionChoice:
    """The backend `block`'s attention runs for (B, L, H, D) `heads` (q or one stream's q) at the active
    dispatch tier; not recorded (the call that runs attention records it)."""
    if torch.compiler.is_compiling():
        return COMPILED
    tier = kernels.fused_tier()
    if tier == "high" and getattr(block, "attend", attention) is not attention:
        return SEQUENCE_PARALLEL
    if tier == "high" and getattr(block, "bf16_attention", False):
        return KEPT_BF16
    return choose_attention(tier, heads.device, heads.dtype, heads.shape[-1])


def double_fp8(
    block: nn.Module,
    txt_qkv: tuple[Tensor, Tensor, Tensor],
    img_qkv: tuple[Tensor, Tensor, Tensor],
    pe: RoPE,
) -> Tensor:
    """A double block's joint `[txt | img]` attention in FP8: (B, L_txt + L_img, H * D) bf16 from each stream's
    (B, L, H, D) q, k, v projections (views of the QKV outputs); q and k normed, rotated and quantized by one
    producer each, v quantized from both views, each stored as `kernels.is_head_major` says."""
    (txt_q, txt_k, txt_v), (img_q, img_k, img_v) = txt_qkv, img_qkv
    txt_norm, img_norm = block.txt_attn.norm, block.img_attn.norm
    q = qk_norm_rope_fp8(
        txt_q,
        img_q,
        txt_norm.query_norm.scale,
        img_norm.query_norm.scale,
        *pe,
        EPS,
        kernels.is_head_major("q"),
    )
    k = qk_norm_rope_fp8(
        txt_k, img_k, txt_norm.key_norm.scale, img_norm.key_norm.scale, *pe, EPS, kernels.is_head_major("k")
    )
    v = heads_fp8(txt_v, img_v, kernels.is_head_major("v"))
    record_attention(FA3_FP8)
    return write_heads(fa3_fp8_attention(q, k, v))


def rotate_fp8(x: Tensor, weight: Tensor, role: str, pe: RoPE) -> Fp8Heads:
    """A single block's q or k (`role`) heads RMS-normed with `weight`, rotated and written in e4m3."""
    return qk_norm_rope_fp8(None, x, None, weight, *pe, EPS, kernels.is_head_major(role))


def single_fp8_heads(q: Fp8Heads, k: Fp8Heads, v: Tensor) -> Tensor:
    """A single block's attention heads (B, L, H, D) bf16 from e4m3 q, k (`rotate_fp8`) and `v`, the (B, L, H, D)
    view of linear1's output, quantized here."""
    record_attention(FA3_FP8)
    return fa3_fp8_attention(q, k, heads_fp8(None, v, kernels.is_head_major("v")))


def flux3_fp8(block: nn.Module, q: Tensor, k: Tensor, v: Tensor, pe: RoPE) -> Tensor:
    """A FLUX.3 block's attention in FP8: (B, L, H, D) bf16 heads from its q, k, v projections (B, L, H, D).

    q and k go through the e4m3 QK-norm + RoPE producer of FLUX.1 and FLUX.2 (`qk_norm_rope_fp8`), with FLUX.3's
    fp32 norm weights rounded to the stream's dtype: that producer normalizes in the stream's dtype where
    `lossless` FLUX.3 normalizes in fp32, one bf16 rounding apart (2^-9 relative), small beside e4m3's 2^-4."""
    norm = block.norm
    q8 = qk_norm_rope_fp8(
        None, q, None, norm.query_norm.scale.to(q.dtype), *pe, EPS, kernels.is_head_major("q")
    )
    k8 = qk_norm_rope_fp8(
        None, k, None, norm.key_norm.scale.to(k.dtype), *pe, EPS, kernels.is_head_major("k")
    )
    record_attention(FA3_FP8)
    return fa3_fp8_attention(q8, k8, heads_fp8(None, v, kernels.is_head_major("v")))
