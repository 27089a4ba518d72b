"""CLIP text transformer (FLUX.1's CLIP-L) in plain PyTorch, bit-identical to transformers' `CLIPTextModel`.

Importing `transformers`' modeling code costs a fresh process ~12 s; FLUX.1 only needs CLIP's pooled output.
This module rebuilds the text tower with `CLIPTextModel`'s parameter names as transformers 5 has them
(`embeddings.*`, `encoder.layers.{i}.self_attn.q_proj.weight`, ..., `final_layer_norm.*`), the same module
types (`nn.Linear`, `nn.Embedding`, `nn.LayerNorm`) and the same torch operations in the same order and dtypes
as transformers 5.17-5.25 run by default (`attn_implementation="sdpa"`, called without an attention mask as
diffusers' FLUX pipelines do): with no padding mask transformers builds no mask tensor and calls
`F.scaled_dot_product_attention(..., attn_mask=None, scale=head_dim**-0.5, is_causal=L > 1)`.

Pooling picks, per row, the final-norm state at: the largest token id (configs with the legacy
`eos_token_id == 2`, such as FLUX.1's CLIP-L, where the end-of-text id is the vocabulary's largest), otherwise
the first `eos_token_id`.

Position ids are `arange(L)` made at call time (transformers' non-persistent `position_ids` buffer holds the
same values); a checkpoint's `embeddings.position_ids` is accepted and ignored, as transformers does.
Checkpoints with and without the `text_model.` prefix (original CLIP-L files have it) both load.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime.text.encoder_base import EncoderModule, embedding

_ACTIVATIONS = ("quick_gelu", "gelu")


@dataclass(frozen=True)
class ClipTextConfig:
    """The fields of a transformers CLIP text `config.json` the encoder uses (transformers' defaults otherwise)."""

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"CLIP hidden_act {self.hidden_act!r} is not supported (only 'quick_gelu', 'gelu')"
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ClipTextConfig:
        """Read a `clip_text_model` config (or the `text_config` of a full CLIP config); other keys ignored."""
        if "text_config" in config:
            config = config["text_config"]
        return cls(**{f.name: config[f.name] for f in fields(cls) if f.name in config})


class ClipEmbeddings(nn.Module):
    """Token embedding plus learned absolute position embedding."""

    def __init__(self, cfg: ClipTextConfig) -> None:
        super().__init__()
        self.token_embedding = embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embedding = embedding(cfg.max_position_embeddings, cfg.hidden_size)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Drop a checkpoint's `position_ids` buffer (always `arange`, rebuilt at call time)."""
        state_dict.pop(prefix + "position_ids", None)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, input_ids: Tensor) -> Tensor:
        n = input_ids.shape[-1]
        limit = self.position_embedding.weight.shape[0]
        if n > limit:
            raise ValueError(f"CLIP text: {n} tokens exceed max_position_embeddings {limit}")
        positions = torch.arange(n, device=self.position_embedding.weight.device)[None, :]
        return self.token_embedding(input_ids) + self.position_embedding(positions)


class ClipAttention(nn.Module):
    """Causal multi-head self-attention with biased projections, scaled by head_dim**-0.5."""

    def __init__(self, cfg: ClipTextConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.head_dim = d // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.q_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, n = x.shape[:2]
        shape = (b, n, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=0.0, scale=self.scale, is_causal=n > 1
        )
        out = out.transpose(1, 2).contiguous().reshape(b, n, -1).contiguous()
        return self.out_proj(out)


def quick_gelu(x: Tensor) -> Tensor:
    """CLIP's sigmoid approximation of GELU, `x * sigmoid(1.702 x)`."""
    return x * torch.sigmoid(1.702 * x)


class ClipMLP(nn.Module):
    """`fc2(act(fc1 x))` with `quick_gelu` or exact (erf) `gelu`."""

    def __init__(self, cfg: ClipTextConfig) -> None:
        super().__init__()
        self.act = quick_gelu if cfg.hidden_act == "quick_gelu" else F.gelu
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    """Pre-LayerNorm residual block: attention, then MLP."""

    def __init__(self, cfg: ClipTextConfig) -> None:
        super().__init__()
        self.self_attn = ClipAttention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = ClipMLP(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    """`encoder`: the stack of `layers`."""

    def __init__(self, cfg: ClipTextConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ClipEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class ClipTextEncoder(EncoderModule):
    """CLIP's text tower with `CLIPTextModel`'s module names: `embeddings`, `encoder`, `final_layer_norm`.

    `forward(input_ids)` is the pooled output (B, D) FLUX.1 feeds its DiT; `encode` also gives the final-norm
    states. The module tree is transformers 5's (no `text_model` level), so what addresses CLIP's layers by
    name (a LoRA's text-encoder weights) finds them as it does in a transformers model.
    """

    def __init__(self, config: ClipTextConfig) -> None:
        super().__init__()
        self.config = config
        self.eos_token_id = config.eos_token_id
        self.embeddings = ClipEmbeddings(config)
        self.encoder = ClipEncoder(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Accept both checkpoint layouts: `text_model.*` (original CLIP-L files) and the un-prefixed names
        transformers 5 saves (it strips the prefix on load too)."""
        outer = prefix + "text_model."
        for key in [k for k in state_dict if k.startswith(outer)]:
            state_dict.setdefault(prefix + key[len(outer) :], state_dict.pop(key))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def encode(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Token ids (B, L) -> (final-norm hidden states (B, L, D), pooled (B, D)): transformers'
        `last_hidden_state` and `pooler_output`."""
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        hidden = self.final_layer_norm(self.encoder(self.embeddings(input_ids)))
        ids = input_ids.to(dtype=torch.int, device=hidden.device)
        if self.eos_token_id == 2:  # legacy configs: the end-of-text token has the largest id
            index = ids.argmax(dim=-1)
        else:  # the first end-of-text token (padding may reuse its id)
            index = (ids == self.eos_token_id).int().argmax(dim=-1)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), index]
        return hidden, pooled

    def forward(self, input_ids: Tensor) -> Tensor:
        """Token ids (B, L) -> the pooled output (B, D); no attention mask."""
        return self.encode(input_ids)[1]


def build(
    config: ClipTextConfig | dict[str, Any], dtype: torch.dtype, device: torch.device | str = "meta"
) -> ClipTextEncoder:
    """An uninitialized-weights `ClipTextEncoder` with every parameter in `dtype` on `device`, as
    `CLIPTextModel.from_pretrained(..., dtype=dtype)` gives (CLIP has no `_keep_in_fp32_modules`).

    Load weights with `model.load_state_dict(sd, assign=True)` after casting each floating tensor to `dtype`
    (`assign` keeps the checkpoint tensor's dtype), or with a plain `load_state_dict` onto a model built on a
    real device (which copies and casts).
    """
    cfg = config if isinstance(config, ClipTextConfig) else ClipTextConfig.from_dict(config)
    with torch.device(device):
        model = ClipTextEncoder(cfg)
    return model.to(dtype=dtype).eval().requires_grad_(False)
