"""Tiny random FLUX.1 and FLUX.2 autoencoders written by diffusers, and their BFL single-file twins."""

from __future__ import annotations

from pathlib import Path

import torch

from flux_runtime.weights import vae2_layout, vae_layout
from tests.random_models import jiggle, randomised, save_tensors

# Two levels (32, 64): a 2x autoencoder with a width change, so `nin_shortcut` appears in both halves.
# 32 groups as BFL's code fixes them, FLUX.1's 16 latent channels and factors.
TINY_VAE_KW = dict(
    in_channels=3,
    out_channels=3,
    block_out_channels=(32, 64),
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=32,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def make_diffusers_vae(seed: int = 0, **overrides):
    """A tiny `AutoencoderKL` with every parameter (GroupNorm weights and biases too) randomised."""
    from diffusers import AutoencoderKL

    n = len(overrides.get("block_out_channels", TINY_VAE_KW["block_out_channels"]))
    types = dict(down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n)
    kw = {**TINY_VAE_KW, **types, **overrides}
    return randomised(AutoencoderKL, seed, **kw)


def save_diffusers_vae(model, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def bfl_state_dict(model) -> dict[str, torch.Tensor]:
    """`model`'s weights under BFL's `ae.safetensors` names, built with our rule table."""
    sd = model.state_dict()
    cfg = model.config
    widths = cfg.block_out_channels
    ch_mult = tuple(w // widths[0] for w in widths)
    table = vae_layout.rules(ch_mult, cfg.layers_per_block)
    return {r.bfl: vae_layout.diffusers_to_bfl(r, sd[r.diffusers]).contiguous() for r in table}


def save_bfl_vae(model, path: Path, prefix: str = "", extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model`'s weights in the BFL single-file layout (optionally prefixed, with other keys)."""
    out = {prefix + k: v for k, v in bfl_state_dict(model).items()}
    return save_tensors({**out, **(extra or {})}, path)


def make_image(batch: int, h: int, w: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random image batch in about [-1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, 3, h, w, generator=gen) * 2 - 1).to(dtype)


# ---- FLUX.2 (`AutoencoderKLFlux2`)

# Two levels (32, 64) as above, FLUX.2's 32 latent channels (128 BatchNorm channels, the DiT's token
# width) and otherwise diffusers' class defaults, so the config diffusers writes is the one a BFL file
# converts to (sample_size 1024 included).
TINY_FLUX2_VAE_KW = dict(block_out_channels=(32, 64), layers_per_block=1)


def make_diffusers_flux2_vae(seed: int = 0, **overrides):
    """A tiny `AutoencoderKLFlux2`: every parameter randomised, BatchNorm statistics too.

    Running means around 0 and variances in [0.25, 2.25], so normalising moves every channel
    differently and the bf16 `sqrt(var + eps)` rounds.
    """
    from diffusers import AutoencoderKLFlux2

    n = len(overrides.get("block_out_channels", TINY_FLUX2_VAE_KW["block_out_channels"]))
    types = dict(down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n)
    torch.manual_seed(seed)
    model = AutoencoderKLFlux2(**{**TINY_FLUX2_VAE_KW, **types, **overrides})
    gen = torch.Generator().manual_seed(seed + 1)
    jiggle(model, gen)
    with torch.no_grad():
        bn = model.bn
        bn.running_mean.copy_(0.3 * torch.randn(bn.running_mean.shape, generator=gen))
        bn.running_var.copy_(0.25 + 2 * torch.rand(bn.running_var.shape, generator=gen))
    return model.eval()


def bfl_flux2_state_dict(model, counter: bool = False) -> dict[str, torch.Tensor]:
    """`model`'s weights under BFL's FLUX.2 `ae.safetensors` names, built with our rule table.

    `counter` adds the BatchNorm's `num_batches_tracked` (optional in both layouts).
    """
    sd = model.state_dict()
    cfg = model.config
    widths = cfg.block_out_channels
    table = vae2_layout.rules(tuple(w // widths[0] for w in widths), cfg.layers_per_block)
    out = {r.bfl: vae_layout.diffusers_to_bfl(r, sd[r.diffusers]).contiguous() for r in table}
    if counter:
        out["bn.num_batches_tracked"] = sd["bn.num_batches_tracked"]
    return out


def save_bfl_flux2_vae(
    model, path: Path, prefix: str = "", counter: bool = False, extra: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write `model`'s weights in BFL's FLUX.2 single-file layout (optionally prefixed, with other keys)."""
    out = {prefix + k: v for k, v in bfl_flux2_state_dict(model, counter).items()}
    return save_tensors({**out, **(extra or {})}, path)
