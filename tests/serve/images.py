"""Image helpers the serve tests share: uploads made from a seed, and served PNGs read back with their provenance."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
from PIL import Image


def random_png(w: int, h: int, seed: int, mode: str = "RGB") -> bytes:
    """A w x h PNG of uniform random pixels from `seed` (`mode` "RGB", or "L" for a mask)."""
    array = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    image = Image.fromarray(array) if mode == "RGB" else Image.fromarray(array[..., 0], "L")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decoded(data: bytes) -> Image.Image:
    """An upload as the server reads it."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def png_with_info(b64: str) -> tuple[Image.Image, dict]:
    """A `b64_json` answer: the image and the provenance in its PNG chunk."""
    image = decoded(base64.b64decode(b64))
    return image, json.loads(image.text["flux_runtime"])


def served(r: httpx.Response) -> list[tuple[Image.Image, dict]]:
    """Every image of a 200 answer, with its provenance."""
    assert r.status_code == 200, r.text
    return [png_with_info(item["b64_json"]) for item in r.json()["data"]]


def same_bits(got: Image.Image, direct: Image.Image) -> None:
    """A served image holds exactly the pipeline's pixels."""
    assert got.size == direct.size
    assert got.convert("RGB").tobytes() == direct.tobytes()


def first_rgb(r: httpx.Response) -> tuple[Image.Image, dict]:
    """The first image of a 200 answer as RGB, with its provenance."""
    image, info = served(r)[0]
    return image.convert("RGB"), info
