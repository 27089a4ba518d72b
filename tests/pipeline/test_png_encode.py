"""`png_encode`: the banded, threaded PNG writer gives the image's pixels and text back through PIL, bit for bit."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from flux_runtime.pipeline import png_encode
from flux_runtime.pipeline.png_encode import encode_png, filter_rows

TEXT = [("flux_runtime", '{"seed": 0}'), ("Description", "un renard roux"), ("Software", "flux-runtime")]


def _decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


@pytest.mark.parametrize(
    ("height", "width", "mode"),
    [(1, 1, "RGB"), (13, 7, "RGB"), (257, 300, "L"), (130, 64, "RGBA"), (200, 96, "RGB")],
)
@pytest.mark.parametrize("content", ["noise", "smooth"])
def test_pixels_and_text_come_back(height: int, width: int, mode: str, content: str) -> None:
    channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    rng = np.random.default_rng(height * width)
    if content == "noise":
        pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    else:  # gradients: every filter wins somewhere
        y, x = np.mgrid[0:height, 0:width]
        pixels = np.stack([(x * 3 + y * (c + 1)) % 256 for c in range(channels)], axis=-1).astype(np.uint8)
    array = pixels[..., 0] if mode == "L" else pixels
    back = _decoded(encode_png(Image.fromarray(array, mode), TEXT, level=4))
    assert back.mode == mode and np.array_equal(np.asarray(back), array)
    assert {k: back.text[k] for k, _ in TEXT} == dict(TEXT)


def test_bands_narrower_than_the_window_keep_their_dictionary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bands of 3 rows of a 40-pixel-wide image hold 363 bytes each: each band's dictionary reaches back over
    many bands, and the joined stream still inflates to the image (threads or not)."""
    monkeypatch.setattr(png_encode, "BAND_ROWS", 3)
    rng = np.random.default_rng(1)
    pixels = np.repeat(
        rng.integers(0, 256, (1, 40, 3), dtype=np.uint8), 100, axis=0
    )  # repeats: back references
    pixels[::7] = rng.integers(0, 256, (15, 40, 3), dtype=np.uint8)
    for threads in (1, 4):
        monkeypatch.setattr(png_encode, "MAX_THREADS", threads)
        back = _decoded(encode_png(Image.fromarray(pixels), [], level=4))
        assert np.array_equal(np.asarray(back), pixels)


def test_a_text_outside_latin1_is_written_as_itxt() -> None:
    data = encode_png(Image.new("RGB", (4, 4)), [("Description", "un bonhomme de neige ☃")], level=4)
    assert b"iTXt" in data and b"tEXt" not in data
    assert _decoded(data).text["Description"] == "un bonhomme de neige ☃"


def test_other_modes_are_left_to_pil() -> None:
    assert encode_png(Image.new("P", (4, 4)), [], level=4) is None
    assert encode_png(Image.new("I;16", (4, 4)), [], level=4) is None


def test_each_row_takes_the_filter_with_the_smallest_signed_sum() -> None:
    """A ramp along x filters to a constant under sub (type 1); the same row repeated filters to zeros under up
    (type 2); the first row of an image has nothing above it."""
    ramp = np.tile(np.arange(0, 240, 3, dtype=np.uint8)[:, None], (1, 3)).reshape(1, -1)
    rows = np.concatenate([ramp, ramp])
    out = filter_rows(rows, np.zeros(rows.shape[1], dtype=np.uint8), bpp=3)
    assert out[0, 0] == 1 and (out[0, 4:] == 3).all()
    assert out[1, 0] == 2 and (out[1, 1:] == 0).all()
