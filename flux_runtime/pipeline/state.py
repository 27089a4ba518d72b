"""What one call of a pipeline carries between its steps: the arguments (`Call`), the encoded prompt
(`Conditioning`), where denoising starts (`Start`) and the result (`PipelineOutput`).

Plain records, apart from the recipes that fill them, so that every module of the pipeline (the core, the
family recipes, the parallel ranks) can read them without importing the machinery that runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from flux_runtime.pipeline.tiers import Tier

OutputType = Literal["pil", "pt", "np", "latent"]
Progress = Callable[[str, int, int], None]
"""`progress(stage, done, total)` with stage "encode", "denoise" or "decode"."""


@dataclass
class PipelineOutput:
    """`images`: PIL images, a float tensor (B, 3, H, W) in [0, 1], uint8 arrays, or latents.

    `latents` are the final packed latents (B, L, 64), FLUX.2 (B, L, 128), in the model dtype; `info` is the
    provenance (prompt, seed, size, steps, guidance, model, quality tier actually used, versions, and the
    input images' paths and fingerprints where there were any).
    """

    images: Any
    latents: Tensor
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Call:
    """One call's arguments, as given, then completed by the recipe's `check` (defaults filled in)."""

    prompt: str | list[str] | None
    height: int | None
    width: int | None
    num_steps: int | None
    guidance: float | None
    seed: int | None
    generator: torch.Generator | list[torch.Generator] | None
    max_sequence_length: int
    num_images_per_prompt: int
    output_type: OutputType
    quality: Tier
    progress: Progress | None
    prompt_embeds: Tensor | None = None
    pooled_prompt_embeds: Tensor | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    """The variant's own arguments (`image`, `mask_image`, `strength`, `negative_prompt`, ...)."""
    # filled in by `Recipe.check`
    steps: int = 0
    guidance_used: float | None = None  # what the model is fed / the CFG scale; None when ignored
    true_cfg_scale: float = 1.0  # > 1: a negative branch runs every step
    cache: Any = None
    """The step-cache policy of this call (`flux_runtime.sampling.step_cache`), None for none."""
    prepared: dict[str, Any] = field(default_factory=dict)
    """What `check` made of the inputs (preprocessed images, masks), for `encode` and `prepare`."""

    def report(self, stage: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(stage, done, total)


@dataclass
class Conditioning:
    """The encoded prompt(s): text states (B, L, D), FLUX.1's pooled vector (B, D_pooled), and the
    negative branch's when CFG runs."""

    txt: Tensor
    vec: Tensor | None = None
    negative_txt: Tensor | None = None
    negative_vec: Tensor | None = None
    # each branch's extra step input where the recipe has one (FLUX.1's IP-Adapter image embeddings), made
    # ready once per generation by `Recipe.fixed_extra` and handed to `velocity` with the text (`WithExtra`)
    extra: Any = None
    negative_extra: Any = None

    @property
    def batch(self) -> int:
        return self.txt.shape[0]


class WithExtra(NamedTuple):
    """What `velocity` gets as its text when the branch has an extra step input: the text as every step reads
    it and the extra (`Recipe.fixed_extra`'s result)."""

    text: Any
    extra: Any


@dataclass
class Start:
    """Where denoising starts: packed latents (B, L, C), the latent grid (h, w), the sigma schedule, the
    position ids, the RoPE cache key, and tokens that condition every step without being updated."""

    latents: Tensor
    grid: tuple[int, int]
    sigmas: Tensor
    timesteps: Tensor
    img_ids: Tensor
    txt_ids: Tensor
    rope_key: tuple
    reference_tokens: Tensor | None = None  # appended after the latents (FLUX.2 references, Kontext)
    channel_cond: Tensor | None = None  # every step's extra input: `conditioned_velocity` says how it joins
    blend: Callable[[int, Tensor], Tensor] | None = None  # after step i (inpainting keeps the unmasked part)
    control: Any = None  # ControlNets' inputs and per-step activity (`pipeline.controlnets.ControlRun`)
    crop: tuple[int, int, int, int] | None = None  # (left, top, right, bottom) of the decoded image to keep
