"""T5 encoder (FLUX.1's T5-XXL v1.1) in plain PyTorch, bit-identical to transformers' `T5EncoderModel`.

Importing `transformers`' modeling code costs a fresh process ~12 s; FLUX.1 only needs the encoder stack's
last hidden state. This module rebuilds it with the same parameter names (`shared.weight`,
`encoder.block.{i}.layer.0.SelfAttention.q.weight`, ..., `encoder.final_layer_norm.weight`), the same module
types (`nn.Linear`, `nn.Embedding`, so `flux_runtime.text.fp8` can swap the linears by name) and the same torch
operations in the same order and dtypes as transformers' default attention, called without an attention mask
as diffusers' FLUX pipelines do:

- RMS norm: fp32 variance, `x * rsqrt(var + eps)` (fp32), cast to a half weight's dtype, times the weight.
- Attention: no 1/sqrt(d) scaling; block 0's bucketed relative position bias, shape (1, H, L, L), is added to
  the scores of every block. How depends on the transformers release whose bits we match (`attention`):
  `"sdpa"` (5.20+): the bias, made contiguous, is the float `attn_mask` of `F.scaled_dot_product_attention`
  (`scale=1.0`); `"sdpa-strided"` (5.15-5.19): the same with the permuted, non-contiguous bias (CUDA's SDPA
  then rounds differently; the CPU gives the same bits); `"eager"` (5.7-5.14, before T5 had SDPA):
  `matmul`, `+= bias`, softmax in fp32 cast back. `attention_for_installed_transformers()` picks one from the
  installed distribution's version without importing it.
- Feed-forward: `gated-gelu` (`gelu_new`, the tanh formula written out) or `relu`; its input is cast to `wo`'s
  dtype when they differ (`wo` stays fp32 when loading in fp16, see `build`).
- fp16 only: transformers' clamp of infinities after each sub-layer.

`build(config, dtype, device)` makes a model as `from_pretrained(..., dtype=dtype)` would (see there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime.text.encoder_base import EncoderModule, embedding

_FEED_FORWARD = {"gated-gelu": True, "relu": False}  # feed_forward_proj -> gated
ATTENTION = ("sdpa", "sdpa-strided", "eager")


def attention_for_transformers(version: str) -> str:
    """The `attention` variant matching transformers `version`'s default T5 (see the module docstring)."""
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) >= (5, 20) or major > 5:
        return "sdpa"
    return "sdpa-strided" if (major, minor) >= (5, 15) else "eager"


def attention_for_installed_transformers() -> str:
    """The variant for the installed transformers (read from its metadata, not imported); `"sdpa"` if absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return attention_for_transformers(version("transformers"))
    except PackageNotFoundError:
        return "sdpa"


@dataclass(frozen=True)
class T5EncoderConfig:
    """The fields of a transformers T5 `config.json` the encoder uses (transformers' defaults otherwise)."""

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"

    def __post_init__(self) -> None:
        if self.feed_forward_proj not in _FEED_FORWARD:
            raise ValueError(
                f"T5 feed_forward_proj {self.feed_forward_proj!r} unsupported ('gated-gelu', 'relu')"
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> T5EncoderConfig:
        """Read the known keys of a parsed `config.json`; unknown keys (decoder, dropout, ...) are ignored."""
        return cls(**{f.name: config[f.name] for f in fields(cls) if f.name in config})


class T5RMSNorm(nn.Module):
    """T5's scale-only norm; the statistics are always taken in fp32 so bf16/fp16 inputs do not lose range."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def position_buckets(length: int, num_buckets: int, max_distance: int, device: torch.device) -> Tensor:
    """Bidirectional bucket index (L, L) of `key - query` offsets: half the buckets per sign, exact buckets
    for small offsets and log-spaced ones up to `max_distance` (computed in float32, truncated to int64)."""
    pos = torch.arange(length, dtype=torch.long, device=device)
    rel = pos[None, :] - pos[:, None]
    half = num_buckets // 2
    buckets = (rel > 0).to(torch.long) * half
    rel = torch.abs(rel)
    max_exact = half // 2
    large = max_exact + (
        torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, half - 1))
    return buckets + torch.where(rel < max_exact, rel, large)


class T5SelfAttention(nn.Module):
    """Multi-head self-attention without score scaling; block 0 owns the relative position bias table."""

    def __init__(self, cfg: T5EncoderConfig, has_bias: bool, attention: str) -> None:
        super().__init__()
        inner = cfg.num_heads * cfg.d_kv
        self.attention = attention
        self.d_kv = cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance
        if has_bias:
            self.relative_attention_bias = embedding(cfg.relative_attention_num_buckets, cfg.num_heads)

    def position_bias(self, length: int, device: torch.device) -> Tensor:
        """The additive bias (1, H, L, L) in the table's dtype: a permuted view of the (L, L, H) lookup,
        copied contiguous for the `"sdpa"` variant (same values, other memory layout)."""
        buckets = position_buckets(length, self.num_buckets, self.max_distance, device)
        bias = self.relative_attention_bias(buckets).permute([2, 0, 1]).unsqueeze(0)
        return bias.contiguous() if self.attention == "sdpa" else bias

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        b, n = x.shape[:2]
        shape = (b, n, -1, self.d_kv)
        q = self.q(x).view(shape).transpose(1, 2)
        k = self.k(x).view(shape).transpose(1, 2)
        v = self.v(x).view(shape).transpose(1, 2)
        if self.attention == "eager":
            scores = torch.matmul(q, k.transpose(3, 2))
            scores += bias
            weights = F.softmax(scores.float(), dim=-1).type_as(scores)
            return self.o(torch.matmul(weights, v).transpose(1, 2).contiguous().reshape(b, n, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.0, scale=1.0)
        return self.o(out.transpose(1, 2).contiguous().reshape(b, n, -1).contiguous())


def gelu_tanh(x: Tensor) -> Tensor:
    """transformers' `gelu_new`: the tanh approximation written out (not `F.gelu(approximate='tanh')`, which
    rounds differently)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class T5FeedForward(nn.Module):
    """`wo(act(wi_0 x) * wi_1 x)` (gated-gelu) or `wo(relu(wi x))`, its input cast to `wo`'s dtype."""

    def __init__(self, cfg: T5EncoderConfig) -> None:
        super().__init__()
        self.gated = _FEED_FORWARD[cfg.feed_forward_proj]  # gated: wi_0, wi_1; else one wi
        if self.gated:
            self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        else:
            self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = gelu_tanh(self.wi_0(x)) * self.wi_1(x) if self.gated else torch.relu(self.wi(x))
        # an FP8 replacement exposes `weight = None`: then no cast, as in transformers
        w = getattr(self.wo, "weight", None)
        if isinstance(w, Tensor) and h.dtype != w.dtype and w.dtype != torch.int8:
            h = h.to(w.dtype)
        return self.wo(h)


class T5LayerAttention(nn.Module):
    """Pre-norm residual self-attention sub-layer (`layer.0`)."""

    def __init__(self, cfg: T5EncoderConfig, has_bias: bool, attention: str) -> None:
        super().__init__()
        self.SelfAttention = T5SelfAttention(cfg, has_bias, attention)
        self.layer_norm = T5RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        return x + self.SelfAttention(self.layer_norm(x), bias)


class T5LayerFeedForward(nn.Module):
    """Pre-norm residual feed-forward sub-layer (`layer.1`)."""

    def __init__(self, cfg: T5EncoderConfig) -> None:
        super().__init__()
        self.DenseReluDense = T5FeedForward(cfg)
        self.layer_norm = T5RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


def _clamp_fp16(x: Tensor) -> Tensor:
    """transformers' fp16 guard: clamp to the fp16 range (1000 below it when any value is already inf)."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(x).any(), top - 1000, top)
    return torch.clamp(x, min=-limit, max=limit)


class T5EncoderBlock(nn.Module):
    """One encoder block: `layer` = [self-attention, feed-forward]."""

    def __init__(self, cfg: T5EncoderConfig, has_bias: bool, attention: str) -> None:
        super().__init__()
        self.layer = nn.ModuleList([T5LayerAttention(cfg, has_bias, attention), T5LayerFeedForward(cfg)])

    def forward(self, x: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """(the block's output, the position bias). Block 0, which holds the relative-attention table, computes
        the bias every later block reuses (`bias` None) inside its own call, so that a memory plan streaming the
        block's weights in for the call has them there."""
        if bias is None:
            bias = self.layer[0].SelfAttention.position_bias(x.shape[1], x.device)
        x = _clamp_fp16(self.layer[0](x, bias))
        return _clamp_fp16(self.layer[1](x)), bias


class T5Stack(nn.Module):
    """`encoder.*`: token embedding (the model's `shared` module), blocks, final norm."""

    def __init__(self, cfg: T5EncoderConfig, embed_tokens: nn.Embedding, attention: str) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList([T5EncoderBlock(cfg, i == 0, attention) for i in range(cfg.num_layers)])
        self.final_layer_norm = T5RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)
        bias = None
        for block in self.block:
            x, bias = block(x, bias)
        return self.final_layer_norm(x)


_TIED = ("shared.weight", "encoder.embed_tokens.weight")


class T5Encoder(EncoderModule):
    """T5 encoder with `T5EncoderModel`'s state-dict names; `forward(input_ids)` -> last hidden state (B, L, D).

    `shared` and `encoder.embed_tokens` are one module (tied, as transformers ties them), so the state dict
    lists both names; a checkpoint holding only one loads into both. `attention`: which transformers release
    to match (`ATTENTION`; None: the installed one, see the module docstring).
    """

    def __init__(self, config: T5EncoderConfig, attention: str | None = None) -> None:
        super().__init__()
        attention = attention or attention_for_installed_transformers()
        if attention not in ATTENTION:
            raise ValueError(f"T5 attention {attention!r} is not one of {', '.join(ATTENTION)}")
        self.config, self.attention = config, attention
        self.shared = embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, self.shared, attention)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Fill in whichever of the two tied embedding names the checkpoint lacks."""
        first, second = (prefix + n for n in _TIED)
        if (first in state_dict) != (second in state_dict):
            state_dict[first] = state_dict[second] = state_dict.get(first, state_dict.get(second))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Token ids (B, L) -> final-norm hidden states (B, L, d_model); no attention mask (FLUX passes none)."""
        return self.encoder(input_ids)


def build(
    config: T5EncoderConfig | dict[str, Any],
    dtype: torch.dtype,
    device: torch.device | str = "meta",
    attention: str | None = None,
) -> T5Encoder:
    """An uninitialized-weights `T5Encoder` in `dtype` on `device`, with the dtypes `from_pretrained(...,
    dtype=dtype)` gives: every parameter in `dtype`, except the feed-forward `wo` weights in float32 when
    `dtype` is float16 (T5's `_keep_in_fp32_modules = ["wo"]` applies to fp16 only, not bf16, in 5.17-5.25).

    Load weights with `model.load_state_dict(sd, assign=True)` after casting each tensor to the dtype of the
    parameter it replaces (`assign` keeps the checkpoint tensor's dtype), or with a plain `load_state_dict`
    onto a model built on a real device (which copies and casts). `attention`: see `T5Encoder`.
    """
    cfg = config if isinstance(config, T5EncoderConfig) else T5EncoderConfig.from_dict(config)
    with torch.device(device):
        model = T5Encoder(cfg, attention)
    model.to(dtype=dtype)
    if dtype == torch.float16:
        for block in model.encoder.block:
            block.layer[1].DenseReluDense.wo.to(torch.float32)
    return model.eval().requires_grad_(False)
