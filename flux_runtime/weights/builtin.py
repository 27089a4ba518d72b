"""Where the built-in models' weights are: the registry's built-in names seen with their configs and files.

`tiny` / `tiny-flux2` are small FLUX.1 [dev] / FLUX.2 [klein] models trained by `scripts/train_tiny.py` on
rendered scenes of coloured shapes; their files live in `flux_runtime/assets/models/<name>/` in the layouts
the real checkpoints use (a BFL DiT file, a BFL `ae.safetensors`, transformers text-encoder folders), and load
through the same loaders with their presets' shapes (a BFL file cannot state its RoPE axes or latent factors).
`tiny-random` / `tiny-flux2-random` are the seeded random models of the `TINY` / `TINY_FLUX2` presets. The
names and their settings are `flux_runtime.registry`'s; this module adds the configs and paths.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from flux_runtime.models.dit.config import PRESETS, DiTConfig
from flux_runtime.models.vae.flux1 import VAE_PRESETS, VAEConfig
from flux_runtime.models.vae.flux2 import FLUX2_VAE_PRESETS, Flux2VAEConfig
from flux_runtime.registry import MODELS, ModelSpec, spec_for
from flux_runtime.registry import builtin as registry_builtin

MODELS_DIR = Path(__file__).resolve().parent.parent / "assets" / "models"


@dataclass(frozen=True)
class Builtin:
    """One built-in model: its registry entry, its shapes, and for a trained one the files of its weights."""

    spec: ModelSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def dit(self) -> DiTConfig:
        assert self.spec.preset is not None
        return PRESETS[self.spec.preset]

    @property
    def vae(self) -> VAEConfig | Flux2VAEConfig:
        assert self.spec.vae_preset is not None
        return {**VAE_PRESETS, **FLUX2_VAE_PRESETS}[self.spec.vae_preset]

    @property
    def trained(self) -> bool:
        return self.spec.trained

    @property
    def default_size(self) -> int | None:
        return self.spec.default_size

    @property
    def max_sequence_length(self) -> int | None:
        return self.spec.max_sequence_length

    @property
    def folder(self) -> Path:
        assert self.spec.files is not None
        return MODELS_DIR / self.spec.files

    @property
    def transformer_path(self) -> Path:
        assert self.spec.dit_file is not None
        return self.folder / self.spec.dit_file

    @property
    def vae_path(self) -> Path:
        return self.folder / "ae.safetensors"

    def weights_id(self) -> str:
        """Provenance: `<name>-seed0` for a random model; `<name>-trained-<sha256 of the DiT file[:12]>`."""
        if not self.trained:
            return self.spec.weights_id
        digest = hashlib.sha256(self.transformer_path.read_bytes()).hexdigest()
        return f"{self.name}-trained-{digest[:12]}"


BUILTINS: dict[str, Builtin] = {name: Builtin(spec) for name, spec in MODELS.items() if spec.builtin}


def builtin(path_or_id: str | Path) -> Builtin | None:
    """The built-in model of this name (unless a file or folder of that name exists), else None."""
    spec = registry_builtin(path_or_id)
    return None if spec is None else BUILTINS[spec.name]


# Every published FLUX autoencoder (FLUX.1's, FLUX.2's, which FLUX.3 uses too) downsamples 8x, and packing takes
# 2x2 latents: a side must be a multiple of 16.
PUBLISHED_SIZE_MULTIPLE = 16


def size_multiple(model: str | Path) -> int | None:
    """The multiple an image side must be for registry name `model`, known before any weights are read: a
    built-in model's from its autoencoder preset, `PUBLISHED_SIZE_MULTIPLE` for a published checkpoint's
    name or hub id; None for anything else (a path, another id: the pipeline checks once its VAE is loaded)
    and for Kontext, which takes any size and fits it to its area (as diffusers' Kontext pipeline does)."""
    local = builtin(model)
    if local is not None:
        return 2 * local.vae.spatial_factor
    spec = spec_for(model)
    if spec is None or spec.builtin or spec.variant == "kontext" or Path(model).exists():
        return None
    return PUBLISHED_SIZE_MULTIPLE
