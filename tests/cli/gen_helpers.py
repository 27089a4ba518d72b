"""What the flux-gen tests share: reading back the PNGs the command wrote, and replaying one of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import main


def pixels(path: Path) -> np.ndarray:
    """A written image's pixels, as RGB."""
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def record(path: Path) -> dict[str, Any]:
    """A written image's provenance record."""
    with Image.open(path) as im:
        return json.loads(im.text["flux_runtime"])


def assert_replays(png: Path, again: Path) -> None:
    """`flux-gen --replay png --out again` succeeds and writes png's very pixels."""
    res = CliRunner().invoke(
        main, ["--replay", str(png), "--out", str(again), "--quiet"], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    assert np.array_equal(pixels(again), pixels(png))
