"""The one list of model names: what `flux-gen --model`, `Pipeline.from_pretrained` and the loaders accept.

Each `ModelSpec` says where a name's weights live (a Hugging Face id, or built in and random), which
family and variant it is, which text encoders a BFL single file of it pairs with, and the defaults that
belong to the name rather than to the checkpoint (the built-in tiny models' small default size). The
CLI's choices, the pipeline's name lookup, the loaders' built-in presets and the provenance's weights id
all read this table, so adding a model is one entry here.

A leaf module that imports nothing (not even torch), so every layer may read it and `flux-gen --help`
stays fast; a built-in model names its architecture preset (`models.dit.PRESETS`) by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Family = Literal["flux1", "flux2", "flux3"]
Variant = Literal["text2img", "kontext", "fill", "control"]
"""What a FLUX.1 checkpoint does besides text to image: Kontext edits with reference tokens, Fill
inpaints from masked-image latents, Depth/Canny follow a control image."""

# The text encoders BFL pairs with each transformer (for a BFL file set, which carries none).
CLIP_L_ID = "openai/clip-vit-large-patch14"
T5_XXL_ID = "google/t5-v1_1-xxl"
MISTRAL_SMALL_ID = "mistralai/Mistral-Small-3.2-24B-Instruct-2506"
MISTRAL_PROCESSOR_ID = "mistralai/Mistral-Small-3.1-24B-Instruct-2503"
QWEN3_4B_ID = "Qwen/Qwen3-4B"  # FLUX.2 [klein] 4B
QWEN3_8B_ID = "Qwen/Qwen3-8B"  # FLUX.2 [klein] 9B
QWEN3_VL_4B_ID = "Qwen/Qwen3-VL-4B-Instruct"  # FLUX.3 Image Klein
FLUX3_UPSAMPLER_ID = "black-forest-labs/flux-3-image-klein-pup"  # FLUX.3's prompt upsampler (Qwen3.5-9B)
# What a FLUX.2 BFL file pairs with: [dev] (it embeds guidance) Mistral Small 3.2's weights with 3.1's processor,
# [klein] the Qwen3 of its text width (3 x hidden size: 4B 2560, 8B 4096).
FLUX2_DEV_TEXT_ENCODERS = (MISTRAL_SMALL_ID, MISTRAL_PROCESSOR_ID)
KLEIN_TEXT_ENCODERS = {3 * 2560: QWEN3_4B_ID, 3 * 4096: QWEN3_8B_ID}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model name. `hub_id` None: built in (random weights from `seed`, architecture `preset`)."""

    name: str
    family: Family
    hub_id: str | None = None
    variant: Variant = "text2img"
    text_encoders: tuple[str, ...] = ()
    preset: str | None = None  # built-in models only: the key of its architecture in `models.dit.PRESETS`
    vae_preset: str | None = None  # built-in models only: the key of its autoencoder's config preset
    seed: int = 0  # built-in random models only: the random weights' seed
    files: str | None = None  # built-in trained models: their folder under flux_runtime/assets/models/
    dit_file: str | None = None  # ... and the BFL transformer file in it (beside `ae.safetensors`)
    default_size: int | None = None  # None: the family's native size
    max_sequence_length: int | None = None  # None: the family's (512); a trained tiny model's own length
    default_guidance: float | None = None  # None: the pipeline's (3.5 for dev); a trained model's own
    upsampler: str | None = (
        None  # FLUX.3: the prompt upsampler BFL pairs with it (a hub id); None: it has none
    )

    @property
    def builtin(self) -> bool:
        return self.hub_id is None

    @property
    def trained(self) -> bool:
        """A built-in model whose weights ship as files (else seeded random weights)."""
        return self.files is not None

    @property
    def weights_id(self) -> str:
        """The provenance's `weights` for a built-in random model (`tiny-random` → `tiny-seed0`; files get a
        hash instead)."""
        return f"{self.name.removesuffix('-random')}-seed{self.seed}"


_FLUX1_TEXT = (CLIP_L_ID, T5_XXL_ID)
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="tiny",
            family="flux1",
            preset="tiny-trained",
            vae_preset="tiny-trained",
            files="tiny",
            dit_file="flux1-tiny.safetensors",
            default_size=256,
            max_sequence_length=64,
            default_guidance=2.5,  # inside the guidance range [1, 3] its guidance embedding was distilled over
        ),
        ModelSpec(name="tiny-random", family="flux1", preset="tiny", vae_preset="tiny", default_size=128),
        ModelSpec(
            name="flux1-dev", family="flux1", hub_id="black-forest-labs/FLUX.1-dev", text_encoders=_FLUX1_TEXT
        ),
        ModelSpec(
            name="flux1-schnell",
            family="flux1",
            hub_id="black-forest-labs/FLUX.1-schnell",
            text_encoders=_FLUX1_TEXT,
        ),
        ModelSpec(
            name="flux1-kontext-dev",
            family="flux1",
            hub_id="black-forest-labs/FLUX.1-Kontext-dev",
            variant="kontext",
            text_encoders=_FLUX1_TEXT,
        ),
        ModelSpec(
            name="flux1-fill-dev",
            family="flux1",
            hub_id="black-forest-labs/FLUX.1-Fill-dev",
            variant="fill",
            text_encoders=_FLUX1_TEXT,
        ),
        ModelSpec(
            name="flux1-depth-dev",
            family="flux1",
            hub_id="black-forest-labs/FLUX.1-Depth-dev",
            variant="control",
            text_encoders=_FLUX1_TEXT,
        ),
        ModelSpec(
            name="flux1-canny-dev",
            family="flux1",
            hub_id="black-forest-labs/FLUX.1-Canny-dev",
            variant="control",
            text_encoders=_FLUX1_TEXT,
        ),
        ModelSpec(
            name="tiny-flux2",
            family="flux2",
            preset="tiny-flux2-trained",
            vae_preset="tiny-flux2-trained",
            files="tiny-flux2",
            dit_file="flux2-tiny.safetensors",
            default_size=256,
            max_sequence_length=64,
        ),
        ModelSpec(
            name="tiny-flux2-random",
            family="flux2",
            preset="tiny-flux2",
            vae_preset="tiny-flux2",
            default_size=128,
        ),
        ModelSpec(
            name="flux2-dev",
            family="flux2",
            hub_id="black-forest-labs/FLUX.2-dev",
            text_encoders=FLUX2_DEV_TEXT_ENCODERS,
        ),
        ModelSpec(
            name="flux2-klein-4b",
            family="flux2",
            hub_id="black-forest-labs/FLUX.2-klein-4B",
            text_encoders=(QWEN3_4B_ID,),
        ),
        ModelSpec(
            name="flux2-klein-9b",
            family="flux2",
            hub_id="black-forest-labs/FLUX.2-klein-9B",
            text_encoders=(QWEN3_8B_ID,),
        ),
        ModelSpec(
            # the built-in tiny FLUX.3: for now the seeded random weights of `tiny-flux3-random` (no trained
            # tiny FLUX.3 ships yet; its `weights` record, tiny-flux3-seed0, says which weights ran)
            name="tiny-flux3",
            family="flux3",
            preset="tiny-flux3",
            vae_preset="tiny-flux2",
            default_size=128,
        ),
        ModelSpec(
            name="tiny-flux3-random",  # random weights: no prompt upsampler (its record says "unavailable")
            family="flux3",
            preset="tiny-flux3",
            vae_preset="tiny-flux2",
            default_size=128,
        ),
        ModelSpec(
            name="flux3-klein",  # step-distilled (flow map): 16 steps, no CFG
            family="flux3",
            hub_id="black-forest-labs/flux-3-image-klein",
            text_encoders=(QWEN3_VL_4B_ID,),
            upsampler=FLUX3_UPSAMPLER_ID,
        ),
        ModelSpec(
            name="flux3-klein-base",  # 50 steps with CFG
            family="flux3",
            hub_id="black-forest-labs/flux-3-image-klein-base",
            text_encoders=(QWEN3_VL_4B_ID,),
            upsampler=FLUX3_UPSAMPLER_ID,
        ),
    )
}
MODEL_NAMES: tuple[str, ...] = tuple(MODELS)
# name → where its weights are: the hub id, or the name itself for a built-in model.
MODEL_IDS: dict[str, str] = {s.name: s.hub_id or s.name for s in MODELS.values()}


def builtin(name: str | Path) -> ModelSpec | None:
    """The built-in model called `name`, unless a file or folder of that name exists (a path wins)."""
    spec = MODELS.get(str(name))
    if spec is None or not spec.builtin or Path(name).exists():
        return None
    return spec


def spec_for(name_or_id: str | Path) -> ModelSpec | None:
    """The spec of a registry name or of its hub id (`black-forest-labs/FLUX.1-Fill-dev`), else None."""
    name = str(name_or_id)
    if name in MODELS:
        return MODELS[name]
    return next((s for s in MODELS.values() if s.hub_id == name), None)
