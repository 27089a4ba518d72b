"""flux-gen on the built-in tiny FLUX.2 model: files, provenance, reference-image editing, replay, one-line errors."""

from __future__ import annotations

import numpy as np
import torch
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import MODEL_CHOICES, main
from flux_runtime.pipeline import Pipeline
from flux_runtime.pipeline.flux2 import image_fingerprint
from flux_runtime.pipeline.sources import MODEL_IDS
from tests.cli.gen_helpers import assert_replays, pixels, record
from tests.sampling.flux2_helpers import random_image

BASE = ["--model", "tiny-flux2-random", "--steps", "2", "--max-sequence-length", "48", "--quiet"]


def _run(*args: str):
    return CliRunner().invoke(main, [*BASE, *args], catch_exceptions=False)


def test_models_are_offered() -> None:
    for name in ("tiny-flux2", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b"):
        assert name in MODEL_CHOICES and name in MODEL_IDS


def test_writes_png_with_flux2_defaults_and_provenance(tmp_path) -> None:
    out = tmp_path / "fox.png"
    res = _run("--prompt", "a red fox", "--seed", "5", "--height", "32", "--width", "48", "--out", str(out))
    assert res.exit_code == 0, res.output
    with Image.open(out) as im:
        assert im.size == (48, 32)
    info = record(out)
    assert info["prompt"] == "a red fox" and info["seed"] == 5 and info["num_steps"] == 2
    assert (
        info["model"] == "tiny-flux2-random"
        and info["weights"] == "tiny-flux2-seed0"
        and info["quality"] == "lossless"
    )
    assert (
        info["guidance"] == 4.0
    )  # diffusers' FLUX.2 default (tiny-flux2 is an undistilled klein: CFG scale)
    assert info["reference_images"] == [] and info["kernels"] == "off" and info["dtype"] == "float32"
    # the same call through the library gives the same pixels
    pipe = Pipeline.from_pretrained("tiny-flux2-random", device="cpu", dtype=torch.float32)
    want = pipe(
        "a red fox", seed=5, height=32, width=48, num_steps=2, max_sequence_length=48, output_type="np"
    )
    assert np.array_equal(pixels(out), want.images[0])


def test_image_edits_and_replays(tmp_path) -> None:
    ref = tmp_path / "ref.png"
    random_image(64, 72, seed=4).save(ref)
    first, again = tmp_path / "edit.png", tmp_path / "again.png"
    # guidance 1: no CFG, to keep the test fast; the recorded guidance is replayed too
    res = _run(
        "--prompt", "make it blue", "--image", str(ref), "--seed", "2", "--guidance", "1", "--out", str(first)
    )
    assert res.exit_code == 0, res.output
    with Image.open(first) as im:
        assert im.size == (64, 72)  # the reference's size by default
    with Image.open(ref) as image:
        image.load()
        recorded = {"path": str(ref.resolve()), "width": 64, "height": 72, "sha256": image_fingerprint(image)}
        pipe = Pipeline.from_pretrained("tiny-flux2-random", device="cpu", dtype=torch.float32)
        want = pipe(
            "make it blue",
            image=image,
            seed=2,
            guidance=1.0,
            num_steps=2,
            max_sequence_length=48,
            output_type="np",
        )
    info = record(first)
    assert info["reference_images"] == [recorded] and info["guidance"] == 1.0
    assert np.array_equal(pixels(first), want.images[0])

    assert_replays(first, again)

    # the reference changed or gone: replay refuses in one line
    random_image(64, 72, seed=5).save(ref)
    res = CliRunner().invoke(main, ["--replay", str(first), "--out", str(tmp_path / "x.png")])
    assert res.exit_code != 0 and f"its reference image {ref.resolve()} has changed since" in res.output
    ref.unlink()
    res = CliRunner().invoke(main, ["--replay", str(first), "--out", str(tmp_path / "x.png")])
    assert res.exit_code != 0 and f"its reference image {ref.resolve()} is gone" in res.output
    assert "Traceback" not in res.output


def test_two_reference_images(tmp_path) -> None:
    a, b = tmp_path / "a.png", tmp_path / "b.jpg"
    random_image(64, 64, seed=1).save(a)
    random_image(72, 64, seed=2).save(b)
    out = tmp_path / "two.png"
    size = ["--height", "16", "--width", "24"]
    res = _run("--prompt", "a and b", "-i", str(a), "-i", str(b), "--guidance", "1", *size, "--out", str(out))
    assert res.exit_code == 0, res.output
    with Image.open(out) as im:
        assert im.size == (24, 16)
    refs = record(out)["reference_images"]
    assert [r["path"] for r in refs] == [str(a.resolve()), str(b.resolve())]
    assert [(r["width"], r["height"]) for r in refs] == [(64, 64), (72, 64)]


def test_errors_are_one_line(tmp_path) -> None:
    small, text = tmp_path / "small.png", tmp_path / "notes.png"
    random_image(32, 80).save(small)
    text.write_text("not an image")
    fox = random_image(64, 64)
    fox.save(tmp_path / "fox.png")
    cases = [
        (["--height", "30", "--width", "32"], "height 30 is not divisible by 4"),
        (["--image", str(small)], "reference image 32x80 is too small"),
        (["--image", str(text)], "cannot read image"),
        (["--image", str(tmp_path / "missing.png")], "does not exist"),
        (
            ["--model", "tiny", "--image", str(tmp_path / "fox.png")],
            "--image needs a FLUX.2 model; tiny is FLUX.1",
        ),
    ]
    for args, message in cases:
        res = CliRunner().invoke(main, [*BASE, "--prompt", "a", *args, "--out", str(tmp_path / "e.png")])
        assert res.exit_code != 0, args
        assert message in res.output, (args, res.output)
        assert "Traceback" not in res.output


def test_replay_of_an_in_memory_reference_is_refused(tmp_path) -> None:
    pipe = Pipeline.from_pretrained("tiny-flux2-random", device="cpu", dtype=torch.float32)
    out = pipe("a cat", image=random_image(64, 64), num_steps=1, max_sequence_length=16)
    from flux_runtime.pipeline.provenance import save_png

    png = tmp_path / "mem.png"
    save_png(out.images[0], png, out.info)
    res = CliRunner().invoke(main, ["--replay", str(png), "--out", str(tmp_path / "x.png")])
    assert res.exit_code != 0 and "reference image 0 was passed in memory, not as a file" in res.output
