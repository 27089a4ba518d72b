"""Pieces both FLUX transformers share unchanged: projections, embeddings, RoPE tables, QK-norm."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime import kernels


class Linear(nn.Module):
    """The one projection type of the DiTs: `F.linear` with the bias inside the GEMM.

    Parity needs the bias fused (`F.linear(x, W, b)` is not bit-equal to `x @ W.T + b` on cuBLAS).
    `split` projects through row blocks of a merged weight (BFL's fused `qkv`, `linear1`), which is
    what diffusers computes with its separate `to_q`, `to_k`, `to_v` modules.
    An FP8 checkpoint replaces this module with a subclass holding e4m3 weights and scales.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def split(
        self, x: Tensor, sizes: tuple[int, ...], *, gelu_last: bool = False, gelu_out: Tensor | None = None
    ) -> tuple[Tensor, ...]:
        """Project `x` through consecutive row blocks of the weight.

        One GEMM per block (diffusers' separate modules), or one merged GEMM where the fused tier has
        verified it bit-identical. `gelu_last` applies tanh-GELU to the last block (FLUX.1's single-block
        MLP input), writing it into `gelu_out` when given.
        """
        w, b = self.weight, self.bias
        if not gelu_last:
            return kernels.split_linear(x, w, b, tuple(sizes))
        n = sum(sizes[:-1])
        head = kernels.split_linear(x, w[:n], None if b is None else b[:n], tuple(sizes[:-1]))
        return (*head, kernels.gelu_tanh(F.linear(x, w[n:], None if b is None else b[n:]), out=gelu_out))

    def forward_gelu(self, x: Tensor) -> Tensor:
        """tanh-GELU of the projection (FLUX.1's MLP input)."""
        return kernels.gelu_tanh(F.linear(x, self.weight, self.bias))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class MLPEmbedder(nn.Module):
    """`in_layer → SiLU → out_layer`: the time, guidance and pooled-text embedders."""

    def __init__(self, in_dim: int, hidden_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.in_layer = Linear(in_dim, hidden_dim, bias)
        self.out_layer = Linear(hidden_dim, hidden_dim, bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class RMSNormScale(nn.Module):
    """Holds one QK RMSNorm weight under BFL's name `scale`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))


class QKNorm(nn.Module):
    """The query and key RMSNorm weights of one attention stream (`norm.query_norm.scale`, ...)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query_norm = RMSNormScale(dim)
        self.key_norm = RMSNormScale(dim)


class ModulationOut(NamedTuple):
    """One adaLN modulation triple, each (B, D)."""

    shift: Tensor
    scale: Tensor
    gate: Tensor


class Pending(NamedTuple):
    """A gated residual `residual + gate * update` not yet written (deferred to the next norm)."""

    residual: Tensor
    gate: Tensor
    update: Tensor


EPS = 1e-6
FP16_MAX = 65504.0

Stream = Tensor | Pending  # a residual stream, possibly with its gated update deferred
RoPE = tuple[Tensor, Tensor]


def materialize(x: Stream) -> Tensor:
    """Write a pending gated residual out (identity on a plain tensor)."""
    return kernels.gated_residual(*x) if isinstance(x, Pending) else x


def norm_modulate(x: Stream, mod: ModulationOut) -> tuple[Tensor, Tensor]:
    """Return `(x, LayerNorm(x) * (1 + scale) + shift)`, materialising a pending residual on the way."""
    if isinstance(x, Pending):
        return kernels.residual_layer_norm_modulate(*x, mod.shift, mod.scale, EPS)
    return x, kernels.layer_norm_modulate(x, mod.shift, mod.scale, EPS)


def clip_fp16(x: Stream) -> Stream:
    """diffusers clips the text and joint streams to the fp16 range after each block."""
    dtype = x.update.dtype if isinstance(x, Pending) else x.dtype
    if dtype != torch.float16:
        return x
    return materialize(x).clip(-FP16_MAX, FP16_MAX)


def timestep_embedding(t: Tensor, dim: int = 256, max_period: float = 10_000.0) -> Tensor:
    """Sinusoidal embedding `[cos | sin]` of `t` (B,), fp32 (B, dim), rounding as diffusers' `Timesteps`."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / half)
    args = t[:, None].float() * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_tables(ids: Tensor, axes_dim: tuple[int, ...], theta: int) -> tuple[Tensor, Tensor]:
    """RoPE cos/sin tables (L, sum(axes_dim)) fp32 for position ids (L, n_axes).

    Angles in float64 as diffusers computes them, each frequency repeated for its channel pair.
    Built once per image size by the caller and reused by every block of every step.
    """
    pos = ids.float()
    # float64 except where the device has none (mps); matches diffusers' choice.
    freqs_dtype = torch.float32 if pos.device.type == "mps" else torch.float64
    cos_out, sin_out = [], []
    for axis, d in enumerate(axes_dim):
        omega = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=freqs_dtype, device=pos.device) / d))
        angles = torch.outer(pos[:, axis], omega)
        cos_out.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin_out.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos_out, dim=-1), torch.cat(sin_out, dim=-1)


def attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor | None = None) -> Tensor:
    """Full attention over (B, L, H, D) inputs through default-dispatch SDPA; returns (B, L, H*D).

    With `out` (B, L, H*D) (unit last stride, e.g. a column slice of the single block's `[attn | mlp]`
    buffer) the heads are written there directly: the same values as diffusers' flatten and concat.
    """
    o = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
    o = o.permute(0, 2, 1, 3).to(q.dtype)
    if out is None:
        return o.flatten(2, 3)
    out.unflatten(-1, o.shape[2:]).copy_(o)
    return out


class SelfAttention(nn.Module):
    """Projection weights of one double-block stream: fused `qkv`, its QK RMSNorm and the output `proj`."""

    def __init__(self, dim: int, num_heads: int, bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = Linear(dim, 3 * dim, bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = Linear(dim, dim, bias)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as (B, L, H, Dh) from the modulated stream `x` (B, L, D).

        diffusers runs `to_q`, `to_k`, `to_v` separately; `Linear.split` gives those bits.
        """
        d = self.qkv.in_features
        return tuple(t.unflatten(-1, (self.num_heads, -1)) for t in self.qkv.split(x, (d, d, d)))


def double_stream(
    block: nn.Module,
    img: Stream,
    txt: Stream,
    img_mods: tuple[ModulationOut, ...],
    txt_mods: tuple[ModulationOut, ...],
    pe: RoPE,
) -> tuple[Stream, Stream]:
    """The double-stream block of both FLUX generations: image and text weights apart, one joint attention.

    `block` holds `img_attn`, `txt_attn` (SelfAttention) and `img_mlp`, `txt_mlp`; the two
    modulation pairs come from the block (FLUX.1) or are shared by all blocks (FLUX.2).
    """
    (img_mod1, img_mod2), (txt_mod1, txt_mod2) = img_mods, txt_mods

    # prepare img and txt for attention
    img, img_n = norm_modulate(img, img_mod1)
    txt, txt_n = norm_modulate(txt, txt_mod1)
    img_q, img_k, img_v = block.img_attn.project(img_n)
    txt_q, txt_k, txt_v = block.txt_attn.project(txt_n)

    # joint attention, text first: (B, L_txt + L_img, H, Dh)
    img_norm, txt_norm = block.img_attn.norm, block.txt_attn.norm
    q = kernels.qk_norm_rope(txt_q, img_q, txt_norm.query_norm.scale, img_norm.query_norm.scale, *pe, EPS)
    k = kernels.qk_norm_rope(txt_k, img_k, txt_norm.key_norm.scale, img_norm.key_norm.scale, *pe, EPS)
    # joint V: two strided copies (the merged-QKV views) are cheaper on the GPU than torch.cat of them
    n_txt = txt_v.shape[1]
    v = txt_v.new_empty(txt_v.shape[0], n_txt + img_v.shape[1], *txt_v.shape[2:])
    v[:, :n_txt].copy_(txt_v)
    v[:, n_txt:].copy_(img_v)
    txt_attn, img_attn = attention(q, k, v).split_with_sizes([txt_n.shape[1], img_n.shape[1]], dim=1)

    # image stream: attention residual, then MLP residual (both left pending)
    img = Pending(img, img_mod1.gate, block.img_attn.proj(img_attn.contiguous()))
    img, img_n = norm_modulate(img, img_mod2)
    img = Pending(img, img_mod2.gate, block.img_mlp(img_n))

    # text stream
    txt = Pending(txt, txt_mod1.gate, block.txt_attn.proj(txt_attn.contiguous()))
    txt, txt_n = norm_modulate(txt, txt_mod2)
    txt = clip_fp16(Pending(txt, txt_mod2.gate, block.txt_mlp(txt_n)))
    return img, txt
