"""FLUX.3 reference preparation equals diffusers' `Flux3ImageProcessor` (one reference: the 4 MP canvas, reflect
padding and its crop box; several: 1 MP and a centre crop), and bad references fail in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flux_runtime.sampling.flux3_references import (
    MAX_REFERENCES,
    encode_flux3_references,
    prepare_flux3_references,
)


def _image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    return image.convert(mode) if mode != "RGB" else image


def _diffusers(images: list[Image.Image], multiple: int):
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

    processor = Flux3ImageProcessor(vae_scale_factor=multiple)
    mode = "fill" if len(images) == 1 else "crop"
    out = [processor.preprocess(image, resize_mode=mode) for image in images]
    return [t for t, _ in out], out[0][1]["reference_crop"]


@pytest.mark.parametrize(
    ("size", "mode", "multiple"),
    [
        ((40, 28), "RGB", 4),  # smaller than the 64 px minimum canvas
        ((10, 7), "RGB", 16),  # under one token: mirrored with the edge pixel
        ((3000, 2000), "RGB", 16),  # 6 MP: shrunk to fit the 4 MP canvas
        ((2049, 2047), "RGB", 16),  # within a token of the cap: the scale is backed off
        ((5000, 90), "RGB", 16),  # the 4096 px side cap
        ((123, 77), "RGBA", 16),
        ((96, 64), "P", 16),  # already on the grid: no padding
    ],
    ids=str,
)
def test_one_reference_equals_diffusers(size, mode, multiple):
    image = _image(*size, mode=mode)
    got = prepare_flux3_references(image, multiple=multiple)
    want, box = _diffusers([image], multiple)
    (pixels,) = got.pixels
    assert pixels.shape == want[0].shape and pixels.stride() == want[0].stride()
    assert torch.equal(pixels, want[0]) and got.crop == box
    assert got.size == tuple(want[0].shape[-2:])


@pytest.mark.parametrize("multiple", [4, 16])
def test_several_references_equal_diffusers(multiple):
    images = [_image(1500, 900, seed=1), _image(33, 50, "RGBA", seed=2), _image(64, 64, "L", seed=3)]
    got = prepare_flux3_references(images, multiple=multiple)
    want, box = _diffusers(images, multiple)
    assert got.crop is None and box is None
    assert len(got.pixels) == 3
    for g, w in zip(got.pixels, want, strict=True):
        assert g.shape == w.shape and torch.equal(g, w)


def test_bad_references_are_refused_in_one_line():
    with pytest.raises(ValueError, match="empty list"):
        prepare_flux3_references([])
    with pytest.raises(ValueError, match="must be a PIL image or a list"):
        prepare_flux3_references("cat.png")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reference image 1 must be a PIL image, got ndarray"):
        prepare_flux3_references([_image(32, 32), np.zeros((3, 3))])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=f"11 reference images given; FLUX.3 takes at most {MAX_REFERENCES}"):
        prepare_flux3_references([_image(32, 32)] * 11)
    with pytest.raises(ValueError, match="reference image 1 is 10x40: with several references each side"):
        prepare_flux3_references([_image(32, 32), _image(10, 40)])


def test_encoding_packs_normalises_and_numbers_the_references():
    refs = prepare_flux3_references([_image(32, 16), _image(16, 48)], multiple=4)

    def encode(x: torch.Tensor) -> torch.Tensor:  # a 2x "VAE" with 2 channels: the pixels' first two, pooled
        return torch.nn.functional.avg_pool2d(x[:, :2], 2)

    mean, std = torch.full((1, 8, 1, 1), 0.5), torch.full((1, 8, 1, 1), 2.0)
    tokens, ids = encode_flux3_references(
        refs.pixels, encode, mean, std, batch=3, vae_dtype=torch.float32, dtype=torch.bfloat16
    )
    # 32x16 px -> 16x8 latent -> 8x4 tokens; 16x48 -> 4x12: 32 + 48 tokens of 2 * 4 channels
    assert tokens.shape == (3, 80, 8) and tokens.dtype == torch.bfloat16 and ids.shape == (80, 4)
    assert ids[:32, 3].eq(-1).all() and ids[32:, 3].eq(-2).all()
    assert ids[1].tolist() == [0.0, 0.0, 0.5, -1.0] and ids[32 + 4].tolist() == [0.0, 0.5, 0.0, -2.0]
    first = encode(refs.pixels[0])[0, :, :2, :2].reshape(2, 4)  # token 0: channel c*4 + dy*2 + dx
    assert torch.equal(tokens[1, 0], ((first.reshape(8) - 0.5) / 2.0).to(torch.bfloat16))
