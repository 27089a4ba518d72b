"""Qwen3's decoder stack (FLUX.2 [klein]'s text encoder) in plain PyTorch, bit-identical to transformers'.

Importing `transformers`' modeling code costs a fresh process seconds; FLUX.2 [klein] only reads three residual
streams of Qwen3-4B / Qwen3-8B (after layers 9, 18 and 27 of 36). This module rebuilds what those states depend
on: the token embedding and the first `depth` decoder layers, with `Qwen3ForCausalLM`'s parameter names
(`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`, ...) and module types (`nn.Linear`,
`nn.Embedding`, so `flux_runtime.text.fp8` can swap the linears by name). Later layers, the final norm and the
LM head are not built: the states read do not depend on them.

The ops, their order and dtypes are those of transformers 5.25's Qwen3 under its default SDPA attention, as
`model(input_ids, attention_mask, output_hidden_states=True, use_cache=False)` runs them:

- RMS norm: the input upcast to float32, `x * rsqrt(mean(x^2) + eps)`, cast back to the input's dtype, then
  `weight *` it (the weight's dtype wins the promotion).
- RoPE: `inv_freq = 1 / theta^(arange(0, d, 2) / d)` computed in float32 on the CPU (where transformers computes
  it); per call, `positions x inv_freq` in float32, concatenated twice, cos and sin (times an attention scaling of
  1) cast to the hidden states' dtype; `q * cos + rotate_half(q) * sin`.
- Attention: q/k/v projections, the per-head q/k norms before the transpose to (B, H, L, D), RoPE, then
  `F.scaled_dot_product_attention` with `scale = head_dim ** -0.5`. Without padding the mask is dropped and SDPA
  runs `is_causal=True` with `enable_gqa=True` (head_dim <= 256); with padding the mask is boolean
  (B, 1, L, L), `causal & key-not-padding`, and k/v are repeated per query head (`expand` + `reshape`) first.
  (A single token with heads wider than 256 has its query heads packed per key/value head instead, as there.)
  The output is transposed back, made contiguous and projected by `o_proj`.
- Residuals `x + attention(norm(x))`, then `x + down(silu(gate(h)) * up(h))` with `h = norm(x)`.

`build(config, dtype, device, depth)` makes a model as `from_pretrained(..., dtype=dtype)` would (every
parameter in `dtype`), uninitialized on `meta` by default for a loader to fill (`native_weights`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime.text.encoder_base import EncoderModule, embedding

# transformers hands SDPA `enable_gqa=True` (no repeated k/v) only without a mask and for heads this wide or less
_GQA_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Qwen3EncoderConfig:
    """The fields of a transformers Qwen3 `config.json` the encoder uses (transformers' defaults otherwise).

    `num_hidden_layers` is the checkpoint's depth; the model builds only the layers it is asked for.
    """

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3 has {self.num_attention_heads} attention heads, not a multiple of its "
                f"{self.num_key_value_heads} key/value heads"
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Qwen3EncoderConfig:
        """Read a parsed Qwen3 `config.json` (either transformers 4's `rope_theta` / `rope_scaling` or 5's
        `rope_parameters`); a setting this encoder does not reproduce (another RoPE type, sliding-window layers,
        an activation other than SiLU) is a ValueError naming it."""
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Qwen3 hidden_act {act!r} unsupported (only 'silu')")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"Qwen3 RoPE type {rope_type!r} unsupported (only 'default')")
        layer_types = config.get("layer_types") or []
        if config.get("use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
            raise ValueError("Qwen3 sliding-window attention layers are unsupported (only full attention)")
        known = {
            f.name: config[f.name] for f in fields(cls) if f.name in config and config[f.name] is not None
        }
        known["rope_theta"] = rope.get("rope_theta", config.get("rope_theta", cls.rope_theta))
        if config.get("num_key_value_heads") is None and "num_attention_heads" in config:
            known["num_key_value_heads"] = config[
                "num_attention_heads"
            ]  # transformers' default: one per head
        return cls(**known)


class Qwen3RMSNorm(nn.Module):
    """Scale-only norm: statistics in float32, the normalized input cast back to its dtype before the scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(theta: float, head_dim: int) -> Tensor:
    """(head_dim / 2,) float32 inverse frequencies, computed on the CPU as transformers computes them (so the same
    bits whatever device the model later runs on)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    return 1.0 / (theta**exponent)


def rotary(inv_freq: Tensor, length: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, sin) (1, L, head_dim) in `like`'s dtype on its device for positions 0..L-1, in transformers' order:
    float32 angles, duplicated halves, cos/sin times an attention scaling of 1, then the cast."""
    positions = torch.arange(length, device=like.device).unsqueeze(0)
    freqs = positions[..., None].float() * inv_freq.to(device=like.device, dtype=torch.float)
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos() * 1.0, angles.sin() * 1.0
    return cos.to(dtype=like.dtype), sin.to(dtype=like.dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_mask(padding: Tensor | None, length: int) -> Tensor | None:
    """The mask transformers' SDPA path passes for a 2D `padding` mask (B, L), 1 = token: None when no position
    is padding (SDPA then runs causal), else a boolean (B, 1, L, L) `key <= query and key is a token`."""
    if padding is None:
        return None
    keep = padding.to(dtype=torch.bool)
    if keep.sum() == keep.numel():
        return None
    index = torch.arange(length, device=keep.device)
    causal = index[None, None, None, :] <= index[None, None, :, None]  # (1, 1, L, L)
    batch = torch.arange(keep.shape[0], device=keep.device)
    key_ok = keep[batch[:, None, None, None], index[None, None, None, :]]  # (B, 1, 1, L)
    mask = torch.ones((), dtype=torch.bool, device=keep.device) & causal
    mask = mask & key_ok
    return mask.expand(keep.shape[0], -1, length, length)


class Qwen3Attention(nn.Module):
    """Grouped-query self-attention with per-head RMS-normed queries and keys and RoPE."""

    def __init__(self, cfg: Qwen3EncoderConfig) -> None:
        super().__init__()
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.head_dim, self.groups = d, heads // kv_heads
        self.scaling = d**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(heads * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = Qwen3RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        b, n = x.shape[:2]
        shape = (b, n, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        extra = {}
        if self.groups > 1:
            if _sdpa_gqa(mask, k, v):
                extra["enable_gqa"] = True
            elif (
                n == 1
            ):  # one query: its heads packed per key/value head as the query axis, as transformers does
                q = q.reshape(b, -1, self.groups, self.head_dim)
                mask = (
                    mask
                    if mask is None or mask.shape[1] == 1
                    else mask.reshape(b, -1, self.groups, mask.shape[-1])
                )
            else:
                k, v = repeat_heads(k, self.groups), repeat_heads(v, self.groups)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=0.0,
            scale=self.scaling,
            is_causal=n > 1 and mask is None,
            **extra,
        )
        out = out.reshape(out.shape[0], -1, n, v.shape[-1]).transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(b, n, -1).contiguous())


def _sdpa_gqa(mask: Tensor | None, k: Tensor, v: Tensor) -> bool:
    """Whether transformers lets SDPA group the heads itself (CUDA/CPU rule; its environment override honoured)."""
    if os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1":
        return True
    return mask is None and k.shape[-1] == v.shape[-1] <= _GQA_MAX_HEAD_DIM


def repeat_heads(x: Tensor, groups: int) -> Tensor:
    """(B, H_kv, L, D) -> (B, H_kv * groups, L, D), each key/value head repeated for its query heads."""
    b, heads, n, d = x.shape
    return x[:, :, None, :, :].expand(b, heads, groups, n, d).reshape(b, heads * groups, n, d)


class Qwen3MLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, cfg: Qwen3EncoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm residual attention, then pre-norm residual MLP."""

    def __init__(self, cfg: Qwen3EncoderConfig) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Stack(nn.Module):
    """`model.*`: the token embedding and the first `depth` decoder layers (no final norm: nothing read uses it)."""

    def __init__(self, cfg: Qwen3EncoderConfig, depth: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(cfg) for _ in range(depth)])


class Qwen3Encoder(EncoderModule):
    """Qwen3's residual stream at several depths, with `Qwen3ForCausalLM`'s state-dict names for what it holds.

    `forward(input_ids, attention_mask, depths)` returns the hidden states after each of `depths` layers (0: the
    embedding), as transformers' `hidden_states[k]`. `config` is the checkpoint's (`num_hidden_layers` its full
    depth); `model.layers` holds the first `depth` layers only.
    """

    def __init__(self, config: Qwen3EncoderConfig, depth: int) -> None:
        super().__init__()
        if not 0 <= depth <= config.num_hidden_layers:
            raise ValueError(f"Qwen3 has {config.num_hidden_layers} layers; cannot build the first {depth}")
        self.config = config
        self.model = Qwen3Stack(config, depth)
        # float32 and on the CPU as transformers makes it; not saved (nor in a checkpoint), moved with the model
        self.register_buffer("inv_freq", rope_inv_freq(config.rope_theta, config.head_dim), persistent=False)

    @property
    def depth(self) -> int:
        """How many decoder layers are built (and so the deepest hidden state it gives)."""
        return len(self.model.layers)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None, depths: tuple[int, ...]
    ) -> list[Tensor]:
        """Token ids (B, L) and their 2D mask (1 = token, 0 = padding; None: no padding) -> the hidden states
        (B, L, hidden_size) after each of `depths` layers, padding positions included."""
        if any(not 0 <= k <= self.depth for k in depths):
            raise ValueError(
                f"hidden states {depths} asked of a Qwen3 encoder built {self.depth} layers deep"
            )
        x = self.model.embed_tokens(input_ids)
        mask = attention_mask_for(attention_mask, x)
        cos, sin = rotary(self.inv_freq, x.shape[1], x)
        states = {0: x}
        for i, layer in enumerate(self.model.layers[: max(depths, default=0)]):
            x = layer(x, cos, sin, mask)
            states[i + 1] = x
        return [states[k] for k in depths]


def attention_mask_for(padding: Tensor | None, x: Tensor) -> Tensor | None:
    """`attention_mask` for the embedded inputs `x` (B, L, H): the 2D mask moved to their device first."""
    if padding is None:
        return None
    return attention_mask(padding.to(device=x.device, dtype=torch.bool), x.shape[1])


def build(
    config: Qwen3EncoderConfig | dict[str, Any],
    dtype: torch.dtype,
    device: torch.device | str = "meta",
    depth: int | None = None,
) -> Qwen3Encoder:
    """An uninitialized `Qwen3Encoder` of the first `depth` layers (default: all) with every parameter in `dtype`
    on `device`, as `from_pretrained(..., dtype=dtype)` gives them; the RoPE frequencies are float32 on the CPU
    (computed there whatever `device` is, as transformers does; they move with the model).

    Load weights with `load_state_dict(sd, assign=True)` after casting each tensor to the dtype of the parameter
    it replaces (`native_weights.load_native` does).
    """
    cfg = config if isinstance(config, Qwen3EncoderConfig) else Qwen3EncoderConfig.from_dict(config)
    depth = cfg.num_hidden_layers if depth is None else depth
    with torch.device(device):
        model = Qwen3Encoder(cfg, depth)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model.eval().requires_grad_(False)
