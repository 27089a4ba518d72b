"""FLUX.3 reference images: the canvas and crop rules, VAE encoding through a callable, tokens and their ids.

FLUX.3 conditions on 1 to 10 reference images, all in one `image_cond` token stream seen at t = 0. How a reference
is prepared depends on how many there are:

- one reference is kept whole: shrunk (LANCZOS, aspect kept) until its *canvas* (its sides rounded up to the token
  grid, each clamped to 64..4096 px) fits in 4 MP, then centred on that canvas with the margin filled by its own
  reflection. Without a size given, the image is generated at the canvas size and cropped back to the reference's
  box when decoded (`PreparedReferences.crop`);
- several are each shrunk (LANCZOS) to at most 1 MP and centre-cropped to the token grid; nothing is cropped back.

Each prepared image is RGB in [-1, 1] `(1, 3, h, w)`, encoded by the VAE (the posterior's mode), patchified to
128 channels, BatchNorm-normalised with the VAE's running statistics, and packed row-major to tokens; reference k
has ids `(0, i/2, j/2, -1 - k)`. The token multiple is the VAE factor times the 2x2 patch (16 px for FLUX.3).

Follows diffusers 0.42.1's `Flux3ProcessImagesInputStep`, `Flux3ImageProcessor` (`preprocess` with
`resize_mode="fill"` / `"crop"`), `Flux3VaeEncoderStep`, `Flux3ImageCondInputStep` and
`Flux3PrepareImageCondLatentsStep`, rounding for rounding. The VAE comes in as `encode_fn`, so this module imports
no models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flux_runtime.sampling.flux2 import flux2_pack
from flux_runtime.sampling.flux3 import flux3_image_ids
from flux_runtime.sampling.latents import _check_positive_int
from flux_runtime.sampling.reference_images import EncodeFn, encoded_references, not_pil, require_image

# BFL's limits: references per call, the single reference's canvas (area, sides), several references' area.
MAX_REFERENCES = 10
CANVAS_MAX_AREA = 4 * 1024 * 1024
CANVAS_MAX_SIDE = 4096
CANVAS_MIN_SIDE = 64
MULTI_REFERENCE_MAX_AREA = 1024 * 1024
# The factor the single reference's scale is backed off by until its rounded-up canvas fits the area.
CANVAS_BACKOFF = 0.995

Box = tuple[int, int, int, int]
"""(left, top, right, bottom) in pixels."""


@dataclass(frozen=True)
class PreparedReferences:
    """The references as the VAE sees them, and where the single reference sits on its canvas.

    `pixels`: one fp32 `(1, 3, h, w)` tensor in [-1, 1] per reference (numpy's channels-last memory, as diffusers'
    tensors have it); `crop`: the (left, top, right, bottom) box of a single reference inside its padded canvas, or
    None for several references.
    """

    pixels: list[Tensor]
    crop: Box | None

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the first reference: the generation size when none is given."""
        h, w = self.pixels[0].shape[-2:]
        return int(h), int(w)


def check_flux3_references(images: object) -> list[Image.Image]:
    """The references as a list of PIL images, or a ValueError saying what is wrong with them."""
    given = [images] if isinstance(images, Image.Image) else images
    if not isinstance(given, (list, tuple)):
        raise ValueError(not_pil("image", images, "a PIL image or a list of them"))
    if not given:
        raise ValueError("image is an empty list: pass None for no reference images")
    if len(given) > MAX_REFERENCES:
        raise ValueError(f"{len(given)} reference images given; FLUX.3 takes at most {MAX_REFERENCES}")
    for k, value in enumerate(given):
        image = require_image(f"reference image {k}", value)
        if image.width < 1 or image.height < 1:
            raise ValueError(f"reference image {k} is empty ({image.width}x{image.height})")
    return list(given)


def prepare_flux3_references(
    images: Image.Image | Sequence[Image.Image], *, multiple: int = 16
) -> PreparedReferences:
    """Check and prepare FLUX.3 reference images for the VAE (see the module docstring for the rules).

    `multiple` is the token size in pixels: the VAE's spatial factor times 2 (16 for FLUX.3's VAE). Several
    references need each side at least `multiple` px after shrinking; a ValueError says which one is not.
    """
    _check_positive_int("multiple", multiple)
    given = check_flux3_references(images)
    if len(given) == 1:
        image = _shrink_to_canvas(given[0], multiple)
        canvas_h, canvas_w = canvas_size(image.height, image.width, multiple)
        box = _centred_box(image, canvas_h, canvas_w)
        return PreparedReferences([_to_tensor(_reflect_pad(image, box, canvas_h, canvas_w, multiple))], box)
    pixels = []
    for k, image in enumerate(given):
        image = _shrink_to_area(image, MULTI_REFERENCE_MAX_AREA)
        w, h = image.width - image.width % multiple, image.height - image.height % multiple
        if w == 0 or h == 0:
            raise ValueError(
                f"reference image {k} is {image.width}x{image.height}: with several references each side must be "
                f"at least {multiple} px"
            )
        left, top = (image.width - w) // 2, (image.height - h) // 2
        pixels.append(_to_tensor(image.crop((left, top, left + w, top + h))))
    return PreparedReferences(pixels, None)


def canvas_size(height: int, width: int, multiple: int) -> tuple[int, int]:
    """(height, width) of an image's canvas: each side rounded up to `multiple`, clamped to 64..4096 px."""
    return tuple(  # type: ignore[return-value]
        min(CANVAS_MAX_SIDE, max(CANVAS_MIN_SIDE, -(-side // multiple) * multiple))
        for side in (height, width)
    )


def _shrink_to_canvas(image: Image.Image, multiple: int) -> Image.Image:
    """The single reference shrunk (aspect kept, sides rounded) until its canvas fits `CANVAS_MAX_AREA` and its
    sides `CANVAS_MAX_SIDE`; the first scale is the area's exact one, backed off by 0.5% while the rounded-up
    canvas is still too large. The image itself when it already fits."""
    w0, h0 = image.size
    scale = min(1.0, math.sqrt(CANVAS_MAX_AREA / (w0 * h0)), CANVAS_MAX_SIDE / max(w0, h0))
    while True:
        h, w = (max(1, round(side * scale)) for side in (h0, w0))
        canvas_h, canvas_w = canvas_size(h, w, multiple)
        if canvas_h * canvas_w <= CANVAS_MAX_AREA:
            break
        scale *= CANVAS_BACKOFF
    if (w, h) == image.size:
        return image
    return image.resize((w, h), resample=Image.Resampling.LANCZOS, reducing_gap=None)


def _shrink_to_area(image: Image.Image, area: int) -> Image.Image:
    """Shrunk (LANCZOS) to `int(W·s) x int(H·s)`, `s = sqrt(area / (W·H))`, if it has more than `area` pixels."""
    w, h = image.size
    if w * h <= area:
        return image
    scale = math.sqrt(area / (w * h))
    return image.resize((int(w * scale), int(h * scale)), Image.Resampling.LANCZOS)


def _centred_box(image: Image.Image, canvas_h: int, canvas_w: int) -> Box:
    left, top = (canvas_w - image.width) // 2, (canvas_h - image.height) // 2
    return left, top, left + image.width, top + image.height


def _reflect_pad(image: Image.Image, box: Box, canvas_h: int, canvas_w: int, multiple: int) -> Image.Image:
    """The image centred in `box` on a canvas_h x canvas_w canvas, the margin its reflection (edge pixel not
    repeated); an image with a side of at most one token is mirrored with its edge pixel instead."""
    if image.size == (canvas_w, canvas_h):
        return image
    left, top, right, bottom = box
    padding = ((top, canvas_h - bottom), (left, canvas_w - right), (0, 0))
    mode = "reflect" if min(image.size) > multiple else "symmetric"
    return Image.fromarray(np.pad(np.asarray(image.convert("RGB")), padding, mode=mode))


def _to_tensor(image: Image.Image) -> Tensor:
    """RGB, `uint8 → float32 / 255`, NCHW as a transposed view of the numpy array, `2x − 1`: (1, 3, h, w)."""
    array = np.stack([np.array(image.convert("RGB")).astype(np.float32) / 255.0], axis=0)  # (1, h, w, 3)
    return 2.0 * torch.from_numpy(array.transpose(0, 3, 1, 2)) - 1.0


def encode_flux3_references(
    pixels: Sequence[Tensor],
    encode_fn: EncodeFn,
    mean: Tensor,
    std: Tensor,
    *,
    batch: int,
    vae_dtype: torch.dtype,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """Encode prepared references into one token stream `(batch, L_ref, 128)` in `dtype` and ids `(L_ref, 4)` fp32.

    Per reference k: cast to the VAE's `vae_dtype` on `device`, `encode_fn` → `(1, 32, h, w)`, `patchify`,
    `bn_normalize` with `latent_bn_stats`' mean/std (in the VAE's dtype), packed row-major with ids
    `flux3_image_ids(h/2, w/2, l = -1 - k)`. All references' tokens are concatenated in order, repeated for the
    `batch` images and cast to `dtype` (the transformer's), as diffusers feeds `image_cond_hidden_states`.
    """
    tokens: list[Tensor] = []
    ids: list[Tensor] = []
    references = encoded_references(
        "encode_flux3_references", pixels, encode_fn, mean, std, batch=batch, device=device, dtype=vae_dtype
    )
    for k, grid in references:  # (1, 128, h/2, w/2)
        grid = grid.repeat_interleave(batch, dim=0)
        tokens.append(flux2_pack(grid))  # (B, h/2·w/2, 128)
        ids.append(flux3_image_ids(*grid.shape[-2:], l_coord=-1 - k, device=device))
    return torch.cat(tokens, dim=1).to(device=device, dtype=dtype), torch.cat(ids, dim=0)
