"""Tiny random FLUX.1 transformers written by diffusers, and their BFL single-file twins."""

from __future__ import annotations

from pathlib import Path

import torch

from flux_runtime.weights import flux1_layout
from tests.random_models import bfl_transformer_state_dict, randomised, save_tensors
from tests.random_models import save_diffusers as save_diffusers  # the family's name for it

TINY_KW = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(8, 12, 12),
)


def make_diffusers_transformer(guidance: bool, seed: int = 0, **overrides):
    """A tiny `FluxTransformer2DModel` with every parameter (norm weights too) randomised."""
    from diffusers import FluxTransformer2DModel

    return randomised(FluxTransformer2DModel, seed, **{**TINY_KW, "guidance_embeds": guidance, **overrides})


def save_bfl(model, path: Path, prefix: str = "") -> Path:
    """Write `model`'s weights in the BFL single-file layout (optionally with a key prefix)."""
    return save_tensors(bfl_transformer_state_dict(model, flux1_layout, "guidance_embeds", prefix), path)


def make_inputs(batch: int, h: int, w: int, txt_len: int, dtype: torch.dtype, seed: int = 0):
    """Packed latents on an h×w token grid, text states, pooled vector, timestep/1000, guidance."""
    gen = torch.Generator().manual_seed(seed)
    img = torch.randn(batch, h * w, 64, generator=gen).to(dtype)
    txt = torch.randn(batch, txt_len, 32, generator=gen).to(dtype)
    y = torch.randn(batch, 32, generator=gen).to(dtype)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    img_ids = img_ids.reshape(h * w, 3).to(dtype)
    txt_ids = torch.zeros(txt_len, 3, dtype=dtype)
    timesteps = (torch.tensor([988.40863, 500.0][:batch] * (batch // 2 + 1))[:batch]).to(dtype) / 1000
    guidance = torch.full((batch,), 3.5, dtype=torch.float32)
    return img, img_ids, txt, txt_ids, timesteps, y, guidance
