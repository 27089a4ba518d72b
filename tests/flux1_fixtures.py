"""Tiny random FLUX.1 transformers written by diffusers, and their BFL single-file twins."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from flux_runtime.weights import flux1_layout

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

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**{**TINY_KW, "guidance_embeds": guidance, **overrides})
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def save_diffusers(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def save_bfl(model, path: Path, prefix: str = "") -> Path:
    """Write `model`'s weights in the BFL single-file layout (optionally with a key prefix)."""
    sd = model.state_dict()
    cfg = model.config
    table = flux1_layout.rules(cfg.num_layers, cfg.num_single_layers, cfg.guidance_embeds)
    out = {prefix + r.bfl: flux1_layout.diffusers_to_bfl(r, sd.__getitem__).contiguous() for r in table}
    save_file(out, str(path))
    return path


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
