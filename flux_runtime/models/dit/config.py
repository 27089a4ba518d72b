"""Transformer configurations: one frozen dataclass, named presets with checkpoint-style names."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


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


FLUX1_DEV = DiTConfig()
FLUX1_SCHNELL = replace(FLUX1_DEV, guidance_embed=False)
# The FLUX.1 architecture shrunk for tests and the offline demo: 16 latent channels packed 2x2,
# text width 32 (tiny T5), pooled width 32 (tiny CLIP).
TINY = replace(
    FLUX1_DEV,
    vec_in_dim=32,
    context_in_dim=32,
    hidden_size=64,
    num_heads=2,
    depth=2,
    depth_single_blocks=2,
    axes_dim=(8, 12, 12),
)
# The built-in `tiny` model, trained by scripts/train_tiny.py: the same text widths as TINY, 4 heads of 48,
# 2 double and 4 single blocks (5.1 M parameters).
TINY_TRAINED = replace(
    TINY, hidden_size=192, num_heads=4, depth=2, depth_single_blocks=4, axes_dim=(8, 20, 20)
)

# FLUX.2: 128 latent channels (32 VAE channels patchified 2x2), text width
# 3 x the text encoder's hidden size (three stacked layers: Mistral 5120 for dev, Qwen3 2560 / 4096 for klein).
FLUX2_DEV = DiTConfig(
    family="flux2",
    in_channels=128,
    out_channels=128,
    vec_in_dim=0,
    context_in_dim=15360,
    hidden_size=6144,
    mlp_ratio=3.0,
    num_heads=48,
    depth=8,
    depth_single_blocks=48,
    axes_dim=(32, 32, 32, 32),
    theta=2000,
    qkv_bias=False,
    guidance_embed=True,
)
FLUX2_KLEIN_4B = replace(
    FLUX2_DEV,
    context_in_dim=7680,
    hidden_size=3072,
    num_heads=24,
    depth=5,
    depth_single_blocks=20,
    guidance_embed=False,
)
FLUX2_KLEIN_9B = replace(
    FLUX2_DEV,
    context_in_dim=12288,
    hidden_size=4096,
    num_heads=32,
    depth=8,
    depth_single_blocks=24,
    guidance_embed=False,
)
# The FLUX.2 [klein] architecture shrunk for tests and the offline demo: real latent width (128),
# text width 96 (three layers of a 32-wide tiny text encoder), 2 heads of 32.
TINY_FLUX2 = replace(
    FLUX2_KLEIN_4B,
    context_in_dim=96,
    hidden_size=64,
    num_heads=2,
    depth=2,
    depth_single_blocks=2,
    axes_dim=(8, 8, 8, 8),
)
# The built-in `tiny-flux2` model, trained by scripts/train_tiny.py: TINY_FLUX2's text width, 4 heads of 48,
# 2 double and 4 single blocks (4.4 M parameters).
TINY_FLUX2_TRAINED = replace(
    TINY_FLUX2, hidden_size=192, num_heads=4, depth=2, depth_single_blocks=4, axes_dim=(12, 12, 12, 12)
)

# FLUX.3 Image Klein: 128-channel image and reference tokens, text width 8 x 2560 (eight stacked Qwen3-VL-4B
# states), 24 heads of 128, 5 blocks per token mode and 28 joint blocks; RoPE theta 10000 over 4 axes.
FLUX3_KLEIN_BASE = DiTConfig(
    family="flux3",
    in_channels=128,
    out_channels=128,
    cond_in_channels=128,
    vec_in_dim=0,
    context_in_dim=20480,
    hidden_size=3072,
    mlp_ratio=3.0,
    num_heads=24,
    depth=5,
    depth_single_blocks=28,
    axes_dim=(32, 32, 32, 32),
    theta=10_000,
    qkv_bias=False,
    guidance_embed=False,
)
FLUX3_KLEIN = replace(FLUX3_KLEIN_BASE, flow_map=True)  # the step-distilled release
# The FLUX.3 architecture shrunk for tests and the offline demo: real latent width (128), text width 256
# (eight layers of a 32-wide tiny Qwen3-VL), 2 heads of 32, 2 blocks per mode and 2 joint blocks.
TINY_FLUX3 = replace(
    FLUX3_KLEIN_BASE,
    context_in_dim=256,
    hidden_size=64,
    num_heads=2,
    depth=2,
    depth_single_blocks=2,
    axes_dim=(8, 8, 8, 8),
)

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
