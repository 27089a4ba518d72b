"""flux-gen with FLUX.3's prompt upsampler (a tiny random Qwen3.5 folder): the caption in the PNG, a replay that
needs no upsampler, --no-upsample, and the options refused where they do not apply."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import main
from flux_runtime.pipeline import Pipeline
from tests.flux3_upsampler_fixtures import make_tiny_upsampler

BASE = ["--model", "tiny-flux3-random", "--steps", "2", "--height", "32", "--width", "48", "--quiet"]


@pytest.fixture(scope="module")
def upsampler(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_upsampler(tmp_path_factory.mktemp("pup"), seed=6)


def _run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _info_and_pixels(path):
    with Image.open(path) as im:
        return json.loads(im.text["flux_runtime"]), np.asarray(im.convert("RGB"))


def test_upsampled_caption_is_recorded_and_replayed_without_the_upsampler(upsampler, tmp_path) -> None:
    local = shutil.copytree(upsampler, tmp_path / "pup")
    out = tmp_path / "fox.png"
    res = _run(*BASE, "--prompt", "a red fox", "--prompt-upsampler", str(local), "--out", str(out))
    assert res.exit_code == 0, res.output
    info, pixels = _info_and_pixels(out)
    assert info["prompt"] == "a red fox" and info["upsample"] == "on" and info["upsampled_prompt"]
    assert info["prompt_upsampler"]["model"] == str(local)
    pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    pipe.set_prompt_upsampler(local)
    want = pipe("a red fox", seed=0, height=32, width=48, num_steps=2, output_type="np")
    assert want.info["upsampled_prompt"] == info["upsampled_prompt"] and np.array_equal(
        pixels, want.images[0]
    )

    shutil.rmtree(local)  # the replay encodes the recorded caption: no upsampler needed
    again = tmp_path / "again.png"
    res = _run("--replay", str(out), "--out", str(again), "--quiet")
    assert res.exit_code == 0, res.output
    info2, pixels2 = _info_and_pixels(again)
    assert np.array_equal(pixels2, pixels) and info2["upsample"] == "given"
    assert info2["upsampled_prompt"] == info["upsampled_prompt"] and info2["prompt"] == "a red fox"

    res = _run("--replay", str(out), "--no-upsample", "--out", str(tmp_path / "x.png"), "--quiet")
    assert res.exit_code != 0 and "--replay takes --no-upsample from the image" in res.output


def test_no_upsample_and_refusals(upsampler, tmp_path) -> None:
    out = tmp_path / "plain.png"
    res = _run(
        *BASE,
        "--prompt",
        "a red fox",
        "--prompt-upsampler",
        str(upsampler),
        "--no-upsample",
        "--out",
        str(out),
    )
    assert res.exit_code == 0, res.output
    info, _ = _info_and_pixels(out)
    assert info["upsample"] == "off" and "upsampled_prompt" not in info
    res = _run(
        *BASE,
        "--prompt",
        "a",
        "--prompt-upsampler",
        str(tmp_path / "nothing"),
        "--out",
        str(tmp_path / "y.png"),
    )
    assert (
        res.exit_code == 1 and "is neither a local folder nor in the local Hugging Face cache" in res.output
    )
    assert "--no-upsample" in res.output and len(res.output.strip().splitlines()) == 1
    res = _run(
        "--model", "tiny-flux2-random", "--prompt", "a", "--no-upsample", "--steps", "1", "--quiet",
        "--out", str(tmp_path / "z.png"),
    )  # fmt: skip
    assert (
        res.exit_code == 1 and "--no-upsample needs a FLUX.3 model; tiny-flux2-random is FLUX.2" in res.output
    )


def test_layout_boxes_are_recorded_and_replayed(upsampler, tmp_path) -> None:
    local = shutil.copytree(upsampler, tmp_path / "pup")
    boxes = [{"id": "fox_1", "desc": "a red fox", "bbox": [0.3, 0.2, 0.9, 0.7]}, {"bbox": [0, 0, 0.2, 1]}]
    out = tmp_path / "fox.png"
    res = _run(
        *BASE, "--prompt", "a red fox", "--prompt-upsampler", str(local), "--boxes", json.dumps(boxes),
        "--out", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    info, pixels = _info_and_pixels(out)
    assert info["boxes"] == boxes and info["prompt_upsampler"]["mode"] == "t2i_bbox"
    pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    pipe.set_prompt_upsampler(local)
    want = pipe("a red fox", seed=0, height=32, width=48, num_steps=2, boxes=boxes, output_type="np")
    assert want.info["upsampled_prompt"] == info["upsampled_prompt"] and np.array_equal(
        pixels, want.images[0]
    )
    file = tmp_path / "boxes.json"  # the same boxes from a file
    file.write_text(json.dumps(boxes))
    res = _run(
        *BASE, "--prompt", "a red fox", "--prompt-upsampler", str(local), "--boxes", str(file),
        "--out", str(tmp_path / "file.png"),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert _info_and_pixels(tmp_path / "file.png")[0]["upsampled_prompt"] == info["upsampled_prompt"]

    shutil.rmtree(local)  # the replay encodes the recorded caption, layout table included
    again = tmp_path / "again.png"
    res = _run("--replay", str(out), "--out", str(again), "--quiet")
    assert res.exit_code == 0, res.output
    info2, pixels2 = _info_and_pixels(again)
    assert np.array_equal(pixels2, pixels) and info2["upsample"] == "given"
    assert info2["upsampled_prompt"] == info["upsampled_prompt"]
    res = _run("--replay", str(out), "--boxes", str(file), "--out", str(tmp_path / "x.png"), "--quiet")
    assert res.exit_code != 0 and "--replay takes --boxes from the image" in res.output


def test_bad_boxes_fail_in_one_line_before_loading(tmp_path) -> None:
    out = ["--out", str(tmp_path / "x.png")]
    for value, message in [
        ("nothing.json", "--boxes nothing.json: neither a JSON list (starting with '[') nor a file"),
        ("[{", "--boxes: not valid JSON"),
        ('[{"bbox": [0, 0, 1, 1], "colour": "red"}]', "boxes: box 0 has unknown key(s) 'colour'"),
        ('[{"from": "ref_image_0", "src_bbox": [0, 0, 1, 1]}]', "no reference images were given"),
    ]:
        # a model that is not on this machine: the boxes are refused before it is looked for
        res = _run("--model", "flux3-klein", "--prompt", "a", "--boxes", value, *out)
        assert res.exit_code != 0 and message in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1
    res = _run(
        "--model", "tiny-flux2-random", "--prompt", "a", "--boxes", '[{"bbox": [0, 0, 1, 1]}]', "--steps", "1",
        "--quiet", *out,
    )  # fmt: skip
    assert res.exit_code == 1 and "--boxes needs a FLUX.3 model; tiny-flux2-random is FLUX.2" in res.output
