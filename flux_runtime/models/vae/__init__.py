"""FLUX autoencoders written from the Black Forest Labs architecture."""

from flux_runtime.models.vae.flux1 import FLUX1_VAE, TINY_VAE, VAE_PRESETS, Flux1VAE, VAEConfig

__all__ = ["FLUX1_VAE", "TINY_VAE", "VAE_PRESETS", "Flux1VAE", "VAEConfig"]
