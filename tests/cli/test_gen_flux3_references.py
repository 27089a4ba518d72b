"""flux-gen --image on the built-in tiny FLUX.3 model: the crop-back, the references' provenance, replay (and its
refusal of a changed or gone reference), one-line errors for bad references."""

from __future__ import annotations

import json

import numpy as np
import torch
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import main
from flux_runtime.pipeline import Pipeline
from flux_runtime.pipeline.flux2 import image_fingerprint
from tests.cli.gen_helpers import assert_replays, pixels

BASE = ["--model", "tiny-flux3-random", "--steps", "2", "--quiet"]


def _run(*args: str):
    return CliRunner().invoke(main, [*BASE, *args], catch_exceptions=False)


def _save(path, w: int, h: int, seed: int):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def test_one_reference_is_cropped_back_recorded_and_replayed(tmp_path) -> None:
    ref = _save(tmp_path / "ref.png", 40, 28, seed=1)
    out = tmp_path / "edit.png"
    res = _run("--prompt", "the same, at night", "--image", str(ref), "--seed", "3", "--out", str(out))
    assert res.exit_code == 0, res.output
    with Image.open(out) as im:
        info = json.loads(im.text["flux_runtime"])
        assert im.size == (40, 28)  # generated on its 64x64 canvas, cropped back to the reference
    (rec,) = info["reference_images"]
    with Image.open(ref) as im:
        assert rec["path"] == str(ref.resolve()) and rec["sha256"] == image_fingerprint(im)
    assert info["reference_crop"] == [12, 18, 52, 46] and (info["height"], info["width"]) == (64, 64)
    pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    with Image.open(ref) as im:
        want = pipe("the same, at night", image=im, seed=3, num_steps=2, output_type="np").images[0]
    assert np.array_equal(pixels(out), want)

    assert_replays(out, tmp_path / "again.png")

    _save(ref, 40, 28, seed=2)  # the reference changes
    res = CliRunner().invoke(main, ["--replay", str(out), "--out", str(tmp_path / "x.png"), "--quiet"])
    assert res.exit_code == 1 and f"its reference image {ref.resolve()} has changed since" in res.output
    ref.unlink()
    res = CliRunner().invoke(main, ["--replay", str(out), "--out", str(tmp_path / "y.png"), "--quiet"])
    assert res.exit_code == 1 and "is gone" in res.output


def test_two_references_replay_at_their_size(tmp_path) -> None:
    a, b = _save(tmp_path / "a.png", 36, 30, seed=1), _save(tmp_path / "b.png", 20, 44, seed=2)
    out = tmp_path / "two.png"
    res = _run("--prompt", "both", "--image", str(a), "--image", str(b), "--out", str(out))
    assert res.exit_code == 0, res.output
    with Image.open(out) as im:
        info = json.loads(im.text["flux_runtime"])
        assert im.size == (36, 28)  # the first reference, cropped to the 4 px grid
    assert [r["path"] for r in info["reference_images"]] == [str(a.resolve()), str(b.resolve())]
    assert "reference_crop" not in info
    assert_replays(out, tmp_path / "again.png")


def test_bad_references_fail_in_one_line(tmp_path) -> None:
    bad = tmp_path / "not-an-image.png"
    bad.write_text("hello")
    res = _run("--prompt", "a", "--image", str(bad), "--out", str(tmp_path / "x.png"))
    assert res.exit_code == 1 and "cannot read image" in res.output and "Traceback" not in res.output
    ref = _save(tmp_path / "ref.png", 40, 28, seed=1)
    res = _run("--prompt", "a", *["--image", str(ref)] * 11, "--out", str(tmp_path / "y.png"))
    assert res.exit_code == 1 and "11 reference images given; FLUX.3 takes at most 10" in res.output
    assert len(res.output.strip().splitlines()) == 1
