"""FLUX diffusion transformers written from the Black Forest Labs architecture."""

from flux_runtime.models.dit.config import (
    FLUX1_DEV,
    FLUX1_SCHNELL,
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX2_KLEIN_9B,
    FLUX3_KLEIN,
    FLUX3_KLEIN_BASE,
    PRESETS,
    TINY,
    TINY_FLUX2,
    TINY_FLUX3,
    DiTConfig,
)
from flux_runtime.models.dit.flux1 import Flux1Transformer
from flux_runtime.models.dit.flux2 import Flux2Transformer
from flux_runtime.models.dit.flux3 import Flux3Transformer

__all__ = [
    "FLUX1_DEV",
    "FLUX1_SCHNELL",
    "FLUX2_DEV",
    "FLUX2_KLEIN_4B",
    "FLUX2_KLEIN_9B",
    "FLUX3_KLEIN",
    "FLUX3_KLEIN_BASE",
    "PRESETS",
    "TINY",
    "TINY_FLUX2",
    "TINY_FLUX3",
    "DiTConfig",
    "Flux1Transformer",
    "Flux2Transformer",
    "Flux3Transformer",
]
