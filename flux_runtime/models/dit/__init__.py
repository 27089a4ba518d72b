"""FLUX diffusion transformers written from the Black Forest Labs architecture."""

from flux_runtime.models.dit.config import FLUX1_DEV, FLUX1_SCHNELL, PRESETS, TINY, DiTConfig
from flux_runtime.models.dit.flux1 import Flux1Transformer

__all__ = ["FLUX1_DEV", "FLUX1_SCHNELL", "PRESETS", "TINY", "DiTConfig", "Flux1Transformer"]
