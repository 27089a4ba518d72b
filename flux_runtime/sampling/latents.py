"""FLUX.1 latents: image-size checks, seeded noise, 2x2 packing to tokens, and image position ids.

Sizes come in two units. `check_image_size`, `latent_size` and `prepare_noise` take the image in pixels;
`unpack` and `image_ids` take the latent grid `(h, w)` that `latent_size` returns (`h = H / 8`), which
packing halves into `(h/2)·(w/2)` tokens of 64 channels. Everything follows `FluxPipeline`'s
`prepare_latents`, `_pack_latents`, `_unpack_latents` and `_prepare_latent_image_ids` (diffusers 0.42.1).
"""

from __future__ import annotations

import torch
from torch import Tensor

# FLUX.1's VAE: 16 latent channels, 8x spatial compression (`2 ** (len(block_out_channels) - 1)`).
LATENT_CHANNELS = 16
VAE_SCALE_FACTOR = 8


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} {value!r} must be a positive integer")


def _check_even_grid(name: str, h: int, w: int) -> None:
    """A ValueError, naming the function `name`, unless the latent grid `h` x `w` has positive, even sides."""
    _check_positive_int("h", h)
    _check_positive_int("w", w)
    if h % 2 or w % 2:
        raise ValueError(f"{name}: latent grid {h}x{w} must have even sides")


def _latent_shape(name: str, latents: Tensor) -> tuple[int, int, int, int]:
    """`(B, C, h, w)` of 4-d `latents` with even `h` and `w`, else a ValueError naming the function `name`."""
    if latents.ndim != 4:
        raise ValueError(f"{name}: expected latents (B, C, h, w), got shape {tuple(latents.shape)}")
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"{name}: latent grid {h}x{w} must have even sides")
    return b, c, h, w


def check_image_size(height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR) -> None:
    """Raise ValueError unless `height` and `width` (pixels) are positive multiples of `2 * vae_scale_factor`.

    The VAE downsamples by `vae_scale_factor` and packing takes 2x2 latent patches, so a side must be a
    multiple of 16. diffusers warns and silently floors instead; we refuse, so the image has the size asked.
    """
    _check_positive_int("vae_scale_factor", vae_scale_factor)
    multiple = 2 * vae_scale_factor
    for name, value in (("height", height), ("width", width)):
        _check_positive_int(name, value)
        if value % multiple:
            raise ValueError(f"{name} {value} is not divisible by {multiple}")


def latent_size(height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR) -> tuple[int, int]:
    """The latent grid `(h, w)` for an image of `height` x `width` pixels, e.g. 1024x768 → (128, 96).

    Validated with `check_image_size`; diffusers' formula `2 * (H // (2 * vae_scale_factor))`.
    """
    check_image_size(height, width, vae_scale_factor)
    return 2 * (height // (2 * vae_scale_factor)), 2 * (width // (2 * vae_scale_factor))


def num_image_tokens(height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR) -> int:
    """Number of packed image tokens for `height` x `width` pixels, e.g. 4096 at 1024²; the schedule's input."""
    h, w = latent_size(height, width, vae_scale_factor)
    return (h // 2) * (w // 2)


def prepare_noise(
    batch: int,
    height: int,
    width: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    vae_scale_factor: int = VAE_SCALE_FACTOR,
) -> Tensor:
    """Initial noise `(batch, 16, h, w)` in `dtype` on `device` for a `height` x `width` image (pixels).

    Same bits as `FluxPipeline.prepare_latents` (diffusers `randn_tensor`): the noise is drawn directly in
    `dtype` (the pipeline passes the text embeddings' dtype, bf16), not drawn in fp32 and cast. Pass exactly
    one of:
    - `seed`: a fresh CPU generator `torch.Generator("cpu").manual_seed(seed)` draws the whole batch, which
      is then moved to `device`, so a seed gives the same image on any machine;
    - `generator`: used as diffusers uses it (a CPU generator draws on the CPU; one on `device`'s type draws
      there); a list of `batch` generators draws one `(1, 16, h, w)` sample each, concatenated.
    Returns the unpacked grid; `pack` turns it into tokens.
    """
    _check_positive_int("batch", batch)
    h, w = latent_size(height, width, vae_scale_factor)
    return draw_noise(
        (batch, LATENT_CHANNELS, h, w), dtype=dtype, device=device, seed=seed, generator=generator
    )


def draw_noise(
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> Tensor:
    """Standard normal noise of `shape` (batch first) with diffusers' `randn_tensor` seed semantics.

    The rules `prepare_noise` documents (exactly one of `seed` / `generator`; a CPU generator draws on the
    CPU and the result is moved; a list draws one sample per generator), for any latent layout: FLUX.1
    draws `(B, 16, h, w)`, FLUX.2 `(B, 128, h/2, w/2)`.
    """
    batch = shape[0]
    if (seed is None) == (generator is None):
        raise ValueError("pass exactly one of seed or generator")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed {seed!r} must be an integer")
        generator = torch.Generator("cpu").manual_seed(seed)
    assert generator is not None
    if isinstance(generator, list) and len(generator) != batch:
        raise ValueError(f"got {len(generator)} generators for a batch of {batch}; pass one per image")

    device = torch.device(device)
    gen_type = generator[0].device.type if isinstance(generator, list) else generator.device.type
    if gen_type == device.type:
        rand_device = device
    elif gen_type == "cpu":
        rand_device = torch.device("cpu")
    else:
        raise ValueError(f"cannot draw noise for {device} with a {gen_type} generator")

    if isinstance(generator, list) and len(generator) == 1:
        generator = generator[0]
    if isinstance(generator, list):
        samples = [
            torch.randn((1, *shape[1:]), generator=g, device=rand_device, dtype=dtype) for g in generator
        ]
        return torch.cat(samples, dim=0).to(device)
    return torch.randn(shape, generator=generator, device=rand_device, dtype=dtype).to(device)


def pack(latents: Tensor) -> Tensor:
    """2x2-patchify latents `(B, C, h, w)` into tokens `(B, (h/2)·(w/2), 4C)`.

    Token `n = i·(w/2) + j` (row-major over patches), channel `c·4 + dy·2 + dx`; the same layout as BFL's
    `"b c (h ph) (w pw) -> b (h w) (c ph pw)"`. Pure data movement, dtype and device kept.
    """
    b, c, h, w = _latent_shape("pack", latents)
    x = latents.view(b, c, h // 2, 2, w // 2, 2)
    x = x.permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)  # (B, L, 4C)


def unpack(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of `pack`: tokens `(B, (h/2)·(w/2), 4C)` back to latents `(B, C, h, w)`.

    `h`, `w` are the latent grid (`latent_size`), not pixels.
    """
    _check_even_grid("unpack", h, w)
    if tokens.ndim != 3 or tokens.shape[1] != (h // 2) * (w // 2) or tokens.shape[2] % 4:
        raise ValueError(
            f"unpack: expected tokens (B, {(h // 2) * (w // 2)}, 4C) for a {h}x{w} latent grid, "
            f"got shape {tuple(tokens.shape)}"
        )
    b, _, channels = tokens.shape
    x = tokens.view(b, h // 2, w // 2, channels // 4, 2, 2)
    x = x.permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, h, w)  # (B, C, h, w)


def image_ids(h: int, w: int, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """Position ids `((h/2)·(w/2), 3)` of the packed tokens of an `h` x `w` latent grid: row n = `[0, i, j]`.

    Built in fp32 on the CPU, then cast to `dtype` and moved, as diffusers does with `prompt_embeds.dtype`
    (bf16): exact up to 256 patches a side (4096 px); beyond that bf16 rounds the positions like diffusers.
    """
    _check_even_grid("image_ids", h, w)
    ph, pw = h // 2, w // 2
    ids = torch.zeros(ph, pw, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(ph)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(pw)[None, :]
    return ids.reshape(ph * pw, 3).to(device=device, dtype=dtype)
