"""FLUX autoencoders written from the Black Forest Labs architecture."""

from flux_runtime.models.vae.flux1 import FLUX1_VAE, TINY_VAE, VAE_PRESETS, Flux1VAE, VAEConfig, VAEShape
from flux_runtime.models.vae.flux2 import (
    FLUX2_VAE,
    FLUX2_VAE_PRESETS,
    TINY_FLUX2_VAE,
    Flux2VAE,
    Flux2VAEConfig,
)

__all__ = [
    "FLUX1_VAE",
    "FLUX2_VAE",
    "FLUX2_VAE_PRESETS",
    "TINY_FLUX2_VAE",
    "TINY_VAE",
    "VAE_PRESETS",
    "Flux1VAE",
    "Flux2VAE",
    "Flux2VAEConfig",
    "VAEConfig",
    "VAEShape",
]
