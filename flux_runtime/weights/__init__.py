"""Checkpoint discovery, layout conversion and strict streaming loads."""

from flux_runtime.weights.controlnet import load_controlnet
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.transformer import load_transformer
from flux_runtime.weights.vae import load_vae

__all__ = ["WeightsError", "load_controlnet", "load_transformer", "load_vae"]
