"""The built-in models: `tiny` and `tiny-flux2` (trained, shipped as files) and their random test twins.

`tiny` / `tiny-flux2` are small FLUX.1 [dev] / FLUX.2 [klein] models trained by `scripts/train_tiny.py` on
rendered scenes of coloured shapes; their files live in `flux_runtime/assets/models/<name>/` in the layouts
the real checkpoints use (a BFL DiT file, a BFL `ae.safetensors`, transformers text-encoder folders), and load
through the same loaders with the shapes below (a BFL file cannot state its RoPE axes or latent factors).
`tiny-random` / `tiny-flux2-random` are the seeded random models of the `TINY` / `TINY_FLUX2` presets, for
tests that need a model of those exact shapes and nothing else.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from flux_runtime.models.dit.config import TINY, TINY_FLUX2, TINY_FLUX2_TRAINED, TINY_TRAINED, DiTConfig
from flux_runtime.models.vae.flux1 import TINY_TRAINED_VAE, TINY_VAE, VAEConfig
from flux_runtime.models.vae.flux2 import TINY_FLUX2_TRAINED_VAE, TINY_FLUX2_VAE, Flux2VAEConfig

MODELS_DIR = Path(__file__).resolve().parent.parent / "assets" / "models"


@dataclass(frozen=True)
class Builtin:
    """One built-in model: its shapes, and for a trained one the folder and DiT file holding its weights."""

    name: str
    family: str  # "flux1" or "flux2"
    dit: DiTConfig
    vae: VAEConfig | Flux2VAEConfig
    dit_file: str | None  # None: seeded random weights (seed 0), no files
    default_size: int
    max_sequence_length: int | None  # the text length it was trained with; None: the family's

    @property
    def folder(self) -> Path:
        return MODELS_DIR / self.name

    @property
    def trained(self) -> bool:
        return self.dit_file is not None

    @property
    def transformer_path(self) -> Path:
        assert self.dit_file is not None
        return self.folder / self.dit_file

    @property
    def vae_path(self) -> Path:
        return self.folder / "ae.safetensors"

    def weights_id(self) -> str:
        """Provenance: `<name>-seed0` for a random model; `<name>-trained-<sha256 of the DiT file[:12]>`."""
        if not self.trained:
            return f"{self.name.removesuffix('-random')}-seed0"
        digest = hashlib.sha256(self.transformer_path.read_bytes()).hexdigest()
        return f"{self.name}-trained-{digest[:12]}"


BUILTINS: dict[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("tiny", "flux1", TINY_TRAINED, TINY_TRAINED_VAE, "flux1-tiny.safetensors", 256, 64),
        Builtin(
            "tiny-flux2",
            "flux2",
            TINY_FLUX2_TRAINED,
            TINY_FLUX2_TRAINED_VAE,
            "flux2-tiny.safetensors",
            256,
            64,
        ),
        Builtin("tiny-random", "flux1", TINY, TINY_VAE, None, 128, None),
        Builtin("tiny-flux2-random", "flux2", TINY_FLUX2, TINY_FLUX2_VAE, None, 128, None),
    )
}


def builtin(path_or_id: str | Path) -> Builtin | None:
    """The built-in model of this name (unless a file or folder of that name exists), else None."""
    name = str(path_or_id)
    if name in BUILTINS and not Path(path_or_id).exists():
        return BUILTINS[name]
    return None
