"""Transformer configurations: one frozen dataclass, named presets with checkpoint-style names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, kw_only=True)
class DiTConfig:
    """Shape of a FLUX diffusion transformer, in Black Forest Labs' `FluxParams` vocabulary.

    `family` picks the architecture (`flux1`: per-block modulation, GELU MLP, biases;
    `flux2`: shared modulation, SwiGLU, no biases; `flux3`: per-mode blocks and per-token modulation,
    SwiGLU, no biases, where `depth` counts the blocks of each token mode). Validated on construction.
    """

    family: Literal["flux1", "flux2", "flux3"] = "flux1"
    in_channels: int = 64
    out_channels: int = 64
    # flux3 only: the reference-image token width (0 elsewhere) and whether the checkpoint is a flow map
    # (step-distilled: a second timestep embedder for the time each step jumps to)
    cond_in_channels: int = 0
    flow_map: bool = False
    vec_in_dim: int = 768
    context_in_dim: int = 4096
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19
    depth_single_blocks: int = 38
    axes_dim: tuple[int, ...] = (16, 56, 56)
    theta: int = 10_000
    qkv_bias: bool = True
    guidance_embed: bool = True

    def __post_init__(self) -> None:
        h, n = self.hidden_size, self.num_heads
        if h <= 0 or n <= 0:
            raise ValueError(f"hidden_size {h} and num_heads {n} must be positive")
        if h % n:
            raise ValueError(f"hidden_size {h} not divisible by num_heads {n}")
        if sum(self.axes_dim) != h // n:
            raise ValueError(f"axes_dim {self.axes_dim} sums to {sum(self.axes_dim)}, not head_dim {h // n}")
        if any(d % 2 for d in self.axes_dim):
            raise ValueError(f"axes_dim {self.axes_dim} must be even per axis (RoPE rotates pairs)")
        if self.depth < 0 or self.depth_single_blocks < 0:
            raise ValueError(
                f"depth {self.depth} and depth_single_blocks {self.depth_single_blocks} must be >= 0"
            )
        if self.mlp_hidden_dim <= 0:
            raise ValueError(f"mlp_ratio {self.mlp_ratio} gives an empty MLP")
        if self.family in ("flux2", "flux3") and (self.qkv_bias or self.vec_in_dim):
            # FLUX.2 has no Linear biases and no pooled text vector; a config claiming either is wrong.
            raise ValueError(
                f"{self.family} has no biases and no pooled vector: qkv_bias {self.qkv_bias} must be False, "
                f"vec_in_dim {self.vec_in_dim} must be 0"
            )
        if self.family == "flux3":
            if self.guidance_embed:
                raise ValueError("flux3 embeds no guidance: guidance_embed must be False")
            if self.cond_in_channels <= 0 or self.out_channels != self.in_channels:
                raise ValueError(
                    f"flux3 needs cond_in_channels > 0 (got {self.cond_in_channels}) and out_channels equal to "
                    f"in_channels ({self.out_channels} vs {self.in_channels})"
                )
        elif self.cond_in_channels or self.flow_map:
            raise ValueError(
                f"cond_in_channels {self.cond_in_channels} and flow_map {self.flow_map} are flux3 fields; "
                f"{self.family} has neither"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


# What each family's presets share; `_preset` adds the size. DiTConfig's defaults are FLUX.1's. FLUX.2 and FLUX.3:
# 128 latent channels (32 VAE channels patchified 2x2), no pooled text vector, no biases, MLP ratio 3.
_WIDE: dict[str, Any] = dict(in_channels=128, out_channels=128, vec_in_dim=0, mlp_ratio=3.0, qkv_bias=False)
_FAMILIES: dict[str, dict[str, Any]] = {
    "flux1": {"family": "flux1"},
    "flux2": {**_WIDE, "family": "flux2", "theta": 2000},
    "flux3": {**_WIDE, "family": "flux3", "cond_in_channels": 128, "theta": 10_000, "guidance_embed": False},
}


def _preset(
    family: str,
    text: int,
    hidden: int,
    heads: int,
    blocks: tuple[int, int],
    axes: tuple[int, ...],
    **fields: Any,
) -> DiTConfig:
    """A preset of `family` (`_FAMILIES`): its text width, hidden size, heads, (double or per-mode, single)
    block counts, RoPE axes and any other `fields`."""
    return DiTConfig(
        **_FAMILIES[family],
        context_in_dim=text,
        hidden_size=hidden,
        num_heads=heads,
        depth=blocks[0],
        depth_single_blocks=blocks[1],
        axes_dim=axes,
        **fields,
    )


_AXES4 = (32, 32, 32, 32)  # FLUX.2 and FLUX.3: RoPE over (t, h, w, l), 32 channels each

# FLUX.1: text width 4096 (T5-XXL), pooled width 768 (CLIP-L). `tiny`: the architecture shrunk for tests and the
# offline demo (16 latent channels packed 2x2, text and pooled width 32: the tiny T5 and CLIP); `tiny-trained`: the
# built-in `tiny` model, trained by scripts/train_tiny.py (same text widths, 4 heads of 48, 5.1 M parameters).
# FLUX.2: text width 3 x the text encoder's hidden size (three stacked layers: Mistral 5120 for dev, Qwen3 2560 /
# 4096 for klein); `tiny-flux2`: the [klein] architecture shrunk (text width 96: three layers of a 32-wide tiny
# encoder, 2 heads of 32); `tiny-flux2-trained`: the built-in `tiny-flux2` model (4 heads of 48, 4.4 M parameters).
# FLUX.3 Image Klein: text width 8 x 2560 (eight stacked Qwen3-VL-4B states), blocks per token mode and joint blocks;
# `flux3-klein` is the step-distilled release (a flow map); `tiny-flux3`: shrunk (text width 256: eight layers of
# a 32-wide tiny Qwen3-VL, 2 heads of 32).
# fmt: off
#                            family   text   hidden heads blocks   RoPE axes          guidance (and other fields)
FLUX1_DEV          = _preset("flux1", 4096,  3072,  24,   (19, 38), (16, 56, 56),      guidance_embed=True)
FLUX1_SCHNELL      = _preset("flux1", 4096,  3072,  24,   (19, 38), (16, 56, 56),      guidance_embed=False)
TINY               = _preset("flux1", 32,    64,    2,    (2, 2),   (8, 12, 12),       guidance_embed=True, vec_in_dim=32)
TINY_TRAINED       = _preset("flux1", 32,    192,   4,    (2, 4),   (8, 20, 20),       guidance_embed=True, vec_in_dim=32)
FLUX2_DEV          = _preset("flux2", 15360, 6144,  48,   (8, 48),  _AXES4,            guidance_embed=True)
FLUX2_KLEIN_4B     = _preset("flux2", 7680,  3072,  24,   (5, 20),  _AXES4,            guidance_embed=False)
FLUX2_KLEIN_9B     = _preset("flux2", 12288, 4096,  32,   (8, 24),  _AXES4,            guidance_embed=False)
TINY_FLUX2         = _preset("flux2", 96,    64,    2,    (2, 2),   (8, 8, 8, 8),      guidance_embed=False)
TINY_FLUX2_TRAINED = _preset("flux2", 96,    192,   4,    (2, 4),   (12, 12, 12, 12),  guidance_embed=False)
FLUX3_KLEIN_BASE   = _preset("flux3", 20480, 3072,  24,   (5, 28),  _AXES4)
FLUX3_KLEIN        = _preset("flux3", 20480, 3072,  24,   (5, 28),  _AXES4,            flow_map=True)
TINY_FLUX3         = _preset("flux3", 256,   64,    2,    (2, 2),   (8, 8, 8, 8))
# fmt: on

PRESETS: dict[str, DiTConfig] = {
    "flux1-dev": FLUX1_DEV,
    "flux1-schnell": FLUX1_SCHNELL,
    "tiny": TINY,
    "flux2-dev": FLUX2_DEV,
    "flux2-klein-4b": FLUX2_KLEIN_4B,
    "flux2-klein-9b": FLUX2_KLEIN_9B,
    "tiny-flux2": TINY_FLUX2,
    "tiny-trained": TINY_TRAINED,
    "tiny-flux2-trained": TINY_FLUX2_TRAINED,
    "flux3-klein-base": FLUX3_KLEIN_BASE,
    "flux3-klein": FLUX3_KLEIN,
    "tiny-flux3": TINY_FLUX3,
}
