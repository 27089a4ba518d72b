"""Tiny random FLUX.2 transformers written by diffusers, their BFL single-file twins, and inputs."""

from __future__ import annotations

from pathlib import Path

import torch

from flux_runtime.weights import flux2_layout
from tests.random_models import bfl_transformer_state_dict, randomised, save_tensors
from tests.random_models import save_diffusers as save_diffusers  # the family's name for it

# The shape of `TINY_FLUX2` in diffusers' vocabulary (guidance_embeds picks [dev] or [klein]).
TINY_KW = dict(
    patch_size=1,
    in_channels=128,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=96,
    mlp_ratio=3.0,
    axes_dims_rope=(8, 8, 8, 8),
    rope_theta=2000,
)
TXT_DIM = TINY_KW["joint_attention_dim"]


def make_diffusers_flux2(guidance: bool, seed: int = 0, **overrides):
    """A tiny `Flux2Transformer2DModel` with every parameter (QK-norm weights too) randomised."""
    from diffusers import Flux2Transformer2DModel

    return randomised(Flux2Transformer2DModel, seed, **{**TINY_KW, "guidance_embeds": guidance, **overrides})


def bfl_state_dict(model, prefix: str = "") -> dict[str, torch.Tensor]:
    """`model`'s weights under BFL flux2 keys, converted by our layout table."""
    return bfl_transformer_state_dict(model, flux2_layout, "guidance_embeds", prefix)


def save_bfl(model, path: Path, prefix: str = "") -> Path:
    """Write `model`'s weights in the BFL single-file layout (optionally with a key prefix)."""
    return save_tensors(bfl_state_dict(model, prefix), path)


def image_ids(h: int, w: int, t: int = 0) -> torch.Tensor:
    """(h*w, 4) int64 ids `(t, i, j, 0)` in row-major token order, as the pipelines build them."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w), torch.tensor([0]))


def text_ids(n: int) -> torch.Tensor:
    """(n, 4) int64 ids `(0, 0, 0, l)`."""
    return torch.cartesian_prod(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.arange(n))


def make_inputs(
    batch: int,
    h: int,
    w: int,
    txt_len: int,
    dtype: torch.dtype,
    seed: int = 0,
    ref: tuple[int, int] | None = None,
):
    """Packed latents on an h×w token grid (plus an optional reference image's tokens), text states,
    int64 ids, timestep/1000 in the model dtype and fp32 guidance 4.0 (what the pipelines pass)."""
    gen = torch.Generator().manual_seed(seed)
    img_ids = image_ids(h, w)
    if ref is not None:
        img_ids = torch.cat([img_ids, image_ids(*ref, t=10)])
    img = torch.randn(batch, img_ids.shape[0], 128, generator=gen).to(dtype)
    txt = torch.randn(batch, txt_len, TXT_DIM, generator=gen).to(dtype)
    timesteps = (torch.tensor([988.40863, 500.0][:batch] * (batch // 2 + 1))[:batch]).to(dtype) / 1000
    guidance = torch.full((batch,), 4.0, dtype=torch.float32)
    return img, img_ids, txt, text_ids(txt_len), timesteps, guidance
