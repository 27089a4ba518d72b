"""FLUX.2 latents: 128-channel noise, tokens and 4-axis ids, patchify, and the VAE's BatchNorm normalization.

FLUX.2's VAE has 32 latent channels and 8x compression; its 2x2 latent patches are folded into channels
(`patchify`, `(B, 32, h, w) → (B, 128, h/2, w/2)`), and each position of that grid is one token of 128
channels (`flux2_pack`). The noise is drawn directly in the patchified shape, so a seed gives other noise
than FLUX.1's `(B, 16, h, w)` draw. Latents are normalized by the VAE's BatchNorm running statistics
over the 128 patchified channels instead of FLUX.1's scale/shift.

Sizes: `check_image_size`, `latent_size` and `num_image_tokens` (latents.py) hold for FLUX.2 unchanged
(sides a multiple of 16 px, latent grid `h = H / 8`); functions here that take `(h, w)` take that latent
grid, as FLUX.1's `unpack` and `image_ids` do. Everything follows `Flux2Pipeline` / `Flux2KleinPipeline`
(diffusers 0.42.1): `prepare_latents`, `_pack_latents`, `_unpack_latents_with_ids`, `_patchify_latents`,
`_unpatchify_latents`, `_prepare_latent_ids`, `_prepare_text_ids` and the BatchNorm lines of `__call__`
and `_encode_vae_image`.

The order `Flux2Pipeline` / `Flux2KleinPipeline.__call__` runs them in (tests/sampling/test_flux2_euler.py
does exactly this against both pipelines):
1. text: `prompt_embeds` (B, S, D) and `flux2_text_ids(S)`; klein with `klein_uses_cfg`: the negative `""` too;
2. references (optional): `preprocess_reference_images`, `latent_bn_stats`, `encode_reference_images`;
3. `flux2_pack(flux2_prepare_noise(..., dtype=prompt_embeds.dtype))`, ids
   `cat([flux2_image_ids(h, w), ref_ids])`, `get_schedule(N, L, config=FLUX2_SCHEDULE)` with L the
   generated tokens only;
4. `denoise(model_fn, ..., guidance=dev ? full([1], g, fp32).expand(B) : None, reference_tokens=...)`,
   with `negative_model_fn` and `true_cfg_scale=guidance_scale` for klein CFG;
5. `unpatchify(bn_denormalize(flux2_unpack(latents, h, w), mean, std))` → VAE decoder → `to_pil_images`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flux_runtime.sampling.latents import (
    VAE_SCALE_FACTOR,
    _check_even_grid,
    _check_positive_int,
    _latent_shape,
    draw_noise,
    latent_size,
)

# FLUX.2's VAE: 32 latent channels; a token holds one 2x2 patch of them.
FLUX2_LATENT_CHANNELS = 32
FLUX2_TOKEN_CHANNELS = 4 * FLUX2_LATENT_CHANNELS


def flux2_prepare_noise(batch: int, height: int, width: int, *, dtype: torch.dtype, **draw: Any) -> Tensor:
    """Initial noise `(batch, 128, h/2, w/2)` in `dtype` for a `height` x `width` image (pixels).

    Same bits as `Flux2Pipeline.prepare_latents` (`randn_tensor` of the patchified shape, drawn directly in
    `dtype`; the pipeline passes the text embeddings' dtype, bf16). The other keywords are `prepare_noise`'s,
    with its defaults: `device`, `seed` / `generator` (a seed draws the whole batch on a fresh CPU generator;
    a list of `batch` generators draws one `(1, 128, h/2, w/2)` sample each) and `vae_scale_factor`.
    `(h, w) = latent_size(height, width)`; `flux2_pack` makes tokens.
    """
    _check_positive_int("batch", batch)
    h, w = latent_size(height, width, draw.pop("vae_scale_factor", VAE_SCALE_FACTOR))
    return draw_noise((batch, FLUX2_TOKEN_CHANNELS, h // 2, w // 2), dtype=dtype, **draw)


def flux2_pack(grid: Tensor) -> Tensor:
    """Patchified latents `(B, C, h/2, w/2)` to tokens `(B, (h/2)·(w/2), C)`, row-major (n = i·(w/2) + j).

    `reshape(B, C, L).permute(0, 2, 1)` as diffusers' `_pack_latents`: a transposed *view* with strides
    `(C·L, 1, L)`, not a copy, so the first model call sees the very memory layout diffusers passes.
    """
    if grid.ndim != 4:
        raise ValueError(f"flux2_pack: expected latents (B, C, h/2, w/2), got shape {tuple(grid.shape)}")
    b, c, ph, pw = grid.shape
    return grid.reshape(b, c, ph * pw).permute(0, 2, 1)  # (B, L, C)


def flux2_unpack(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of `flux2_pack`: tokens `(B, (h/2)·(w/2), C)` to a contiguous grid `(B, C, h/2, w/2)`.

    `h`, `w` are the latent grid (`latent_size`). Equal to `_unpack_latents_with_ids` with the ids of
    `flux2_image_ids`: its scatter by `(i, j)` is the identity on row-major tokens, and its `torch.stack`
    returns a contiguous tensor, as this does.
    """
    _check_even_grid("flux2_unpack", h, w)
    ph, pw = h // 2, w // 2
    if tokens.ndim != 3 or tokens.shape[1] != ph * pw:
        raise ValueError(
            f"flux2_unpack: expected tokens (B, {ph * pw}, C) for a {h}x{w} latent grid, "
            f"got shape {tuple(tokens.shape)}"
        )
    b, _, c = tokens.shape
    return tokens.reshape(b, ph, pw, c).permute(0, 3, 1, 2).contiguous()  # (B, C, h/2, w/2)


def patchify(latents: Tensor) -> Tensor:
    """VAE latents `(B, C, h, w)` to `(B, 4C, h/2, w/2)`: channel `c·4 + dy·2 + dx` holds pixel (2i+dy, 2j+dx).

    diffusers' `_patchify_latents` (used on VAE-encoded reference images before normalization).
    """
    b, c, h, w = _latent_shape("patchify", latents)
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2)
    x = x.permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(grid: Tensor) -> Tensor:
    """Inverse of `patchify`: `(B, 4C, h/2, w/2)` to `(B, C, h, w)`, the VAE decoder's input layout.

    diffusers' `_unpatchify_latents` (at decode, after `bn_denormalize`).
    """
    if grid.ndim != 4 or grid.shape[1] % 4:
        raise ValueError(f"unpatchify: expected latents (B, 4C, h/2, w/2), got shape {tuple(grid.shape)}")
    b, c4, ph, pw = grid.shape
    x = grid.reshape(b, c4 // 4, 2, 2, ph, pw)
    x = x.permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c4 // 4, ph * 2, pw * 2)


def flux2_image_ids(h: int, w: int, *, time: int = 0, device: torch.device | str = "cpu") -> Tensor:
    """Position ids `((h/2)·(w/2), 4)` int64 of the tokens of an `h` x `w` latent grid: row n = `(time, i, j, 0)`.

    `torch.cartesian_prod` over (t, h, w, l) as `_prepare_latent_ids` (generated image, `time` 0) and
    `_prepare_image_ids` (reference image k, `time = reference_time(k)`). Integers, so never rounded.
    diffusers expands the generated image's ids to `(B, L, 4)` with identical rows; every batch element
    uses these.
    """
    _check_even_grid("flux2_image_ids", h, w)
    if isinstance(time, bool) or not isinstance(time, int) or time < 0:
        raise ValueError(f"time {time!r} must be a non-negative integer")
    t = torch.tensor([time])
    ids = torch.cartesian_prod(t, torch.arange(h // 2), torch.arange(w // 2), torch.arange(1))
    return ids.to(device)  # (L, 4)


def flux2_text_ids(length: int, *, device: torch.device | str = "cpu") -> Tensor:
    """Position ids `(length, 4)` int64 of the text tokens: row l = `(0, 0, 0, l)`.

    The pipeline (not the text encoder) makes them: `Flux2Pipeline._prepare_text_ids`, one identical
    `(L, 4)` block per batch element; text uses only the fourth (sequence) axis.
    """
    _check_positive_int("length", length)
    zero = torch.arange(1)
    return torch.cartesian_prod(zero, zero, zero, torch.arange(length)).to(device)  # (L, 4)


def latent_bn_stats(running_mean: Tensor, running_var: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The VAE BatchNorm's `(mean, std)` as `(1, C, 1, 1)` tensors, `std = sqrt(running_var + eps)`.

    Computed in the statistics' own dtype and device (the VAE's: bf16 when the VAE is bf16), as diffusers
    does before casting to the latents' dtype; `eps` is the VAE config's `batch_norm_eps` (1e-4). Pass the
    result to `bn_normalize` / `bn_denormalize`.
    """
    if running_mean.shape != running_var.shape or running_mean.ndim != 1:
        raise ValueError(
            f"latent_bn_stats: expected running_mean and running_var (C,), got {tuple(running_mean.shape)} "
            f"and {tuple(running_var.shape)}"
        )
    return running_mean.view(1, -1, 1, 1), torch.sqrt(running_var.view(1, -1, 1, 1) + eps)


def _bn_cast(latents: Tensor, mean: Tensor, std: Tensor, name: str) -> tuple[Tensor, Tensor]:
    if latents.ndim != 4 or mean.numel() != latents.shape[1] or std.numel() != latents.shape[1]:
        raise ValueError(
            f"{name}: expected patchified latents (B, C, h, w) with C = {mean.numel()} statistics, "
            f"got shape {tuple(latents.shape)} and std of {std.numel()}"
        )
    # diffusers: `.view(1, -1, 1, 1).to(latents.device, latents.dtype)` after the sqrt
    mean = mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = std.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    return mean, std


def bn_normalize(latents: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """`(latents − mean) / std` on patchified latents `(B, 128, h/2, w/2)`: a VAE-encoded reference image.

    `mean`, `std` from `latent_bn_stats`, cast to the latents' dtype and device first; two ops in that dtype
    (`Flux2Pipeline._encode_vae_image`).
    """
    mean, std = _bn_cast(latents, mean, std, "bn_normalize")
    return (latents - mean) / std


def bn_denormalize(latents: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """`latents · std + mean` on the sampled, unpacked latents `(B, 128, h/2, w/2)`: the decoder's input.

    Inverse of `bn_normalize`, same casts; multiply then add in the latents' dtype (`__call__`'s decode).
    """
    mean, std = _bn_cast(latents, mean, std, "bn_denormalize")
    return latents * std + mean


def klein_uses_cfg(guidance_scale: float, is_distilled: bool) -> bool:
    """Whether `Flux2KleinPipeline` runs classifier-free guidance: `guidance_scale > 1` on a base model.

    Distilled klein checkpoints (`model_index.json` `is_distilled: true`) ignore the scale (diffusers warns);
    with CFG on, each step also runs the negative prompt `""` and mixes `neg + scale · (pos − neg)`
    (`denoise(..., negative_model_fn=..., true_cfg_scale=guidance_scale)`).
    """
    return guidance_scale > 1 and not is_distilled
