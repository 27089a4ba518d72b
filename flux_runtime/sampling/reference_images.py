"""FLUX.2 reference images (editing): preprocessing, VAE encoding through a callable, tokens and their ids.

Each reference image is checked, shrunk to at most 1024² pixels, center-cropped to a multiple of 16 and
scaled to [-1, 1]; the VAE encodes it (the latent distribution's mean), the latents are patchified and
BatchNorm-normalized like the generated image's, and their tokens follow the noise tokens in the sequence
with ids `(10 + 10k, i, j, 0)` for reference k, a separate time coordinate per image. The transformer sees
them at every step; they are never updated (`denoise(..., reference_tokens=...)`).

Follows `Flux2Pipeline.__call__` step 4, `Flux2ImageProcessor` (`check_image_input`, `_resize_to_target_area`,
its crop-only `_resize_and_crop`, `VaeImageProcessor.preprocess`), `prepare_image_latents`,
`_encode_vae_image` and `_prepare_image_ids` (diffusers 0.42.1, identical in `Flux2KleinPipeline`).
The VAE comes in as `encode_fn`, so this module imports no models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flux_runtime.sampling.flux2 import bn_normalize, flux2_image_ids, flux2_pack, patchify
from flux_runtime.sampling.latents import VAE_SCALE_FACTOR, _check_positive_int

EncodeFn = Callable[[Tensor], Tensor]
"""`encode_fn(image (1, 3, H, W) in [-1, 1], VAE dtype and device) -> latent mean (1, 32, H/8, W/8)`.

The pipeline passes its VAE encoder returning the posterior's mode (`latent_dist.mode()`), not a sample."""

# Flux2ImageProcessor.check_image_input defaults and Flux2Pipeline.__call__'s area cap.
REFERENCE_MIN_SIDE = 64
REFERENCE_MAX_ASPECT = 8
REFERENCE_MAX_AREA = 1024 * 1024
# `_prepare_image_ids(scale=10)`: reference k sits at time 10 + 10k; the generated image at time 0.
REFERENCE_TIME_SCALE = 10


def reference_time(k: int) -> int:
    """The time coordinate of reference image k (0-based): 10, 20, 30, …"""
    return REFERENCE_TIME_SCALE + REFERENCE_TIME_SCALE * k


def not_pil(what: str, value: object, expected: str = "a PIL image") -> str:
    """The message for `value` given where `expected` belongs: its type, and how to make a PIL image of it."""
    kind = type(value).__name__
    if kind == "ndarray":
        how = "PIL.Image.fromarray(array) (uint8, height x width x 3)"
    elif kind == "Tensor":
        how = "PIL.Image.fromarray(t.mul(255).round().byte().permute(1, 2, 0).cpu().numpy()) for a (3, H, W) one in [0, 1]"
    elif isinstance(value, (str, Path)):
        how = f"PIL.Image.open({str(value)!r})"
    else:
        return f"{what} must be {expected}, got {kind}"
    return f"{what} must be {expected}, got {kind}: pass {how}"


# PIL modes whose pixels are not 8-bit: their convert("RGB") / convert("L") clips at 255 (16-bit, 32-bit
# integer) or truncates floats in [0, 1] to 0, a silently white or black picture
WIDE_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N", "F")


def wide_pixels(what: str, image: Image.Image) -> str | None:
    """The error for a PIL image whose pixels are wider than 8 bits, or None for an 8-bit one."""
    if image.mode not in WIDE_MODES:
        return None
    return (
        f"{what} has {image.mode} pixels (more than 8 bits), which RGB conversion would clip to white or black: "
        "give an 8-bit image, e.g. Image.fromarray((a / a.max() * 255).round().astype('uint8')) of its values a"
    )


def require_image(what: str, value: object, error: type[Exception] = ValueError) -> Image.Image:
    """`value` if it can be the picture `what`; else `error` saying why (not a PIL image, or pixels wider
    than 8 bits)."""
    if not isinstance(value, Image.Image):
        raise error(not_pil(what, value))
    wide = wide_pixels(what, value)
    if wide is not None:
        raise error(wide)
    return value


def check_reference_image(image: object) -> None:
    """Raise ValueError unless `image` is a PIL image with both sides ≥ 64 px and an aspect ratio ≤ 8.

    `Flux2ImageProcessor.check_image_input`, on the image as given (before any resize), in our words.
    """
    image = require_image("reference image", image)
    width, height = image.size
    if width < REFERENCE_MIN_SIDE or height < REFERENCE_MIN_SIDE:
        raise ValueError(
            f"reference image {width}x{height} is too small: both sides must be at least {REFERENCE_MIN_SIDE} px"
        )
    aspect = max(width / height, height / width)
    if aspect > REFERENCE_MAX_ASPECT:
        raise ValueError(
            f"reference image {width}x{height} has aspect ratio {aspect:.1f}; the limit is {REFERENCE_MAX_ASPECT}"
        )


def preprocess_reference_images(
    images: Image.Image | Sequence[Image.Image], *, vae_scale_factor: int = VAE_SCALE_FACTOR
) -> list[Tensor]:
    """PIL reference images to fp32 tensors `(1, 3, h, w)` in [-1, 1], `h`, `w` multiples of 16; one per image.

    All images are checked first (`check_reference_image`), then each, as `Flux2Pipeline.__call__` does:
    1. if it has more than 1024² pixels, resize (LANCZOS) to `int(W·s) x int(H·s)`, `s = sqrt(1024² / (W·H))`;
    2. center-crop (no resize) to the sides floored to a multiple of `2 * vae_scale_factor`, the crop box
       starting at `((W − w) // 2, (H − h) // 2)`;
    3. convert to RGB, `uint8 → float32 / 255`, NCHW, `2x − 1`.
    The tensor keeps numpy's channels-last memory (a transposed view, strides `(h·w·3, 1, w·3, 3)`) as
    diffusers' does, so the VAE sees the same layout. The first image's `(h, w)` is the pipeline's default
    output size when none is given.
    """
    _check_positive_int("vae_scale_factor", vae_scale_factor)
    given = [images] if isinstance(images, Image.Image) else list(images)
    if not given:
        raise ValueError("no reference images given")
    for image in given:
        check_reference_image(image)
    return [_preprocess(image, 2 * vae_scale_factor) for image in given]


def _preprocess(image: Image.Image, multiple: int) -> Tensor:
    width, height = image.size
    if width * height > REFERENCE_MAX_AREA:
        # Flux2ImageProcessor._resize_to_target_area
        scale = math.sqrt(REFERENCE_MAX_AREA / (width * height))
        image = image.resize((int(width * scale), int(height * scale)), Image.Resampling.LANCZOS)
        width, height = image.size
    w, h = (width // multiple) * multiple, (height // multiple) * multiple
    if w == 0 or h == 0:
        raise ValueError(f"reference image {width}x{height} is smaller than {multiple} px after resizing")
    # Flux2ImageProcessor._resize_and_crop: a center crop only
    left, top = (width - w) // 2, (height - h) // 2
    image = image.crop((left, top, left + w, top + h)).convert("RGB")
    # VaeImageProcessor.pil_to_numpy, numpy_to_pt, normalize
    array = np.stack([np.array(image).astype(np.float32) / 255.0], axis=0)  # (1, h, w, 3)
    pixels = torch.from_numpy(array.transpose(0, 3, 1, 2))  # (1, 3, h, w), channels-last memory
    return 2.0 * pixels - 1.0


def check_references(who: str, batch: int, images: Sequence[Tensor]) -> None:
    """A positive `batch` and at least one reference image (`who` names the caller in the error)."""
    _check_positive_int("batch", batch)
    if len(images) == 0:
        raise ValueError(f"{who}: no reference images given")


def encode_reference(
    who: str, encode_fn: EncodeFn, image: Tensor, k: int, device: torch.device | str, dtype: torch.dtype
) -> Tensor:
    """`encode_fn` of reference `k`, a `(1, 3, H, W)` image cast to `dtype` on `device`; its latents must be
    `(1, C, h, w)` (`who` names the caller in errors)."""
    if image.ndim != 4 or image.shape[:2] != (1, 3):
        raise ValueError(f"{who}: reference {k} must be (1, 3, H, W), got {tuple(image.shape)}")
    latents = encode_fn(image.to(device=device, dtype=dtype))
    if latents.ndim != 4 or latents.shape[0] != 1:
        raise ValueError(
            f"{who}: encode_fn returned shape {tuple(latents.shape)} for reference {k}, expected (1, C, h, w)"
        )
    return latents


def encoded_references(
    who: str,
    images: Sequence[Tensor],
    encode_fn: EncodeFn,
    mean: Tensor,
    std: Tensor,
    *,
    batch: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> Iterator[tuple[int, Tensor]]:
    """`(k, grid)` for each reference k: `encode_reference` (`dtype`, `device`), `patchify`, `bn_normalize` with
    `mean`/`std` from `latent_bn_stats`, a `(1, 4C, h/2, w/2)` grid; `check_references` first (`who` names
    the caller in errors)."""
    check_references(who, batch, images)
    for k, image in enumerate(images):
        latents = encode_reference(who, encode_fn, image, k, device, dtype)
        yield k, bn_normalize(patchify(latents), mean, std)


def encode_reference_images(
    images: Sequence[Tensor],
    encode_fn: EncodeFn,
    mean: Tensor,
    std: Tensor,
    *,
    batch: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """Encode preprocessed reference images into tokens `(batch, L_ref, 128)` and ids `(L_ref, 4)` int64.

    For each image k (`Flux2Pipeline.prepare_image_latents`): cast to the VAE's `dtype` on `device`,
    `encode_fn` → `(1, 32, h, w)`, `patchify`, `bn_normalize` with `mean`/`std` from `latent_bn_stats`, pack
    to `(h/2)·(w/2)` tokens with ids `(reference_time(k), i, j, 0)`. The tokens of all images are
    concatenated in order and repeated for each of `batch` images; they stay in the VAE's dtype (the loop
    casts the model input, as diffusers casts `cat([latents, image_latents])` to the transformer's dtype).
    Append the ids after the generated image's: `torch.cat([flux2_image_ids(h, w), ref_ids])`.
    """
    tokens: list[Tensor] = []
    ids: list[Tensor] = []
    references = encoded_references(
        "encode_reference_images", images, encode_fn, mean, std, batch=batch, device=device, dtype=dtype
    )
    for k, grid in references:  # (1, 128, h/2, w/2)
        ph, pw = grid.shape[-2:]  # the latent grid halved
        ids.append(flux2_image_ids(2 * ph, 2 * pw, time=reference_time(k), device=device))
        tokens.append(flux2_pack(grid).squeeze(0))  # (h/2·w/2, 128)
    ref_tokens = torch.cat(tokens, dim=0).unsqueeze(0).repeat(batch, 1, 1)  # (B, L_ref, 128)
    return ref_tokens, torch.cat(ids, dim=0)  # (L_ref, 4)
