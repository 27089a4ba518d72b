"""flux-gen with FLUX.1 inputs: img2img, inpainting and true CFG options, their provenance and replay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import main
from tests.cli.gen_helpers import assert_replays

BASE = ["--model", "tiny", "--height", "32", "--width", "32", "--steps", "3", "--quiet"]


def _run(*args: str):
    return CliRunner().invoke(main, [*BASE, *args], catch_exceptions=False)


def _write(path, seed: int, mode: str = "RGB"):
    rng = np.random.default_rng(seed)
    shape = (32, 32, 3) if mode == "RGB" else (32, 32)
    Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8), mode).save(path)
    return path


def test_inpainting_records_its_inputs_and_replays(tmp_path):
    image, mask = _write(tmp_path / "in.png", 1), _write(tmp_path / "mask.png", 2, "L")
    out, again = tmp_path / "out.png", tmp_path / "again.png"
    res = _run(
        "--prompt", "a cat", "--image", str(image), "--mask", str(mask), "--strength", "0.9",
        "--negative-prompt", "blurry", "--true-cfg", "2.0", "--out", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    with Image.open(out) as im:
        info = json.loads(im.text["flux_runtime"])
    assert info["strength"] == 0.9 and info["true_cfg_scale"] == 2.0 and info["negative_prompt"] == "blurry"
    assert info["input_images"]["image"]["path"] == str(image.resolve())
    assert set(info["input_images"]) == {"image", "mask_image"}
    assert_replays(out, again)
    _write(mask, 9, "L")  # the mask changed since: the replay refuses
    res = CliRunner().invoke(main, ["--replay", str(out), "--out", str(tmp_path / "x.png"), "--quiet"])
    assert res.exit_code == 1 and "mask.png has changed since" in res.output


def test_bad_flux1_inputs_are_one_line_errors(tmp_path):
    image = _write(tmp_path / "in.png", 1)
    res = _run("--prompt", "a cat", "--image", str(image), "--strength", "1.5")
    assert res.exit_code == 1 and "--strength 1.5 must be in (0, 1]" in res.output
    res = _run("--prompt", "a cat", "--mask", str(image))
    assert res.exit_code == 1 and "--mask needs --image" in res.output
    res = _run("--prompt", "a cat", "--control-image", str(image))
    assert res.exit_code == 1 and "no control input" in res.output


@pytest.fixture(scope="module")
def variant_folders(tmp_path_factory):
    """Tiny Kontext, Fill and Depth folders saved by diffusers (their model_index.json names the pipeline)."""
    from diffusers import FluxKontextPipeline

    from tests.pipeline.test_flux1_pipeline import _save_pipeline
    from tests.pipeline.test_flux1_variants import _save_variant

    root = tmp_path_factory.mktemp("cli-variants")
    dev = _save_pipeline(root / "dev", True)
    FluxKontextPipeline.from_pretrained(dev).save_pretrained(root / "kontext")
    return {
        "kontext": root / "kontext",
        "fill": _save_variant(dev, root / "fill", "FluxFillPipeline", 144),
        "control": _save_variant(dev, root / "depth", "FluxControlPipeline", 128),
    }


def _gen(model, *args: str):
    base = ["--model", str(model), "--height", "32", "--width", "32", "--steps", "2", "--quiet"]
    return CliRunner().invoke(main, [*base, "--max-sequence-length", "16", *args], catch_exceptions=False)


def test_kontext_fill_and_control_record_their_inputs_and_replay(variant_folders, tmp_path):
    image, mask = _write(tmp_path / "in.png", 1), _write(tmp_path / "mask.png", 2, "L")
    for variant, args, roles in (
        ("kontext", ["--image", str(image), "--max-area", "1024", "--no-auto-resize"], {"image"}),
        ("fill", ["--image", str(image), "--mask", str(mask)], {"image", "mask_image"}),
        ("control", ["--control-image", str(image)], {"control_image"}),
    ):
        out, again = tmp_path / f"{variant}.png", tmp_path / f"{variant}-again.png"
        res = _gen(variant_folders[variant], "--prompt", "a cat", *args, "--out", str(out))
        assert res.exit_code == 0, res.output
        with Image.open(out) as im:
            info = json.loads(im.text["flux_runtime"])
        assert info["variant"] == variant and set(info["input_images"]) == roles
        assert_replays(out, again)
    res = _gen(variant_folders["control"], "--prompt", "a cat", "--image", str(image), "--strength", "0.5")
    assert res.exit_code == 1 and "it takes no image" in res.output
    res = _gen(variant_folders["fill"], "--prompt", "a cat", "--image", str(image), "--max-area", "1024")
    assert res.exit_code == 1 and "--max-area and --no-auto-resize need a FLUX.1 Kontext model" in res.output
