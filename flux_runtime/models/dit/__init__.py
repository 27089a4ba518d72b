"""FLUX diffusion transformers written from the Black Forest Labs architecture."""

from flux_runtime.models.dit.config import (
    FLUX1_DEV,
    FLUX1_SCHNELL,
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX2_KLEIN_9B,
    PRESETS,
    TINY,
    TINY_FLUX2,
    DiTConfig,
)
from flux_runtime.models.dit.flux1 import Flux1Transformer
from flux_runtime.models.dit.flux2 import Flux2Transformer

__all__ = [
    "FLUX1_DEV",
    "FLUX1_SCHNELL",
    "FLUX2_DEV",
    "FLUX2_KLEIN_4B",
    "FLUX2_KLEIN_9B",
    "PRESETS",
    "TINY",
    "TINY_FLUX2",
    "DiTConfig",
    "Flux1Transformer",
    "Flux2Transformer",
]
