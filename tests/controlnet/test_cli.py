"""flux-gen with ControlNets: the image equals the Python pipeline's, the PNG records the ControlNets and
replays; bad input is one line before any model loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import main
from flux_runtime.pipeline import Pipeline
from tests.cli.gen_helpers import assert_replays, pixels, record
from tests.controlnet.test_inputs import TINY
from tests.controlnet_fixtures import make_diffusers_controlnet
from tests.random_models import save_diffusers, save_tensors

BASE = ["--model", "tiny", "--height", "32", "--width", "48", "--steps", "3", "--quiet", "--device", "cpu"]


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-nets")
    return {k: save_diffusers(make_diffusers_controlnet(k, **TINY), root / k) for k in ("instantx", "union")}


def write_image(path, seed: int):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, size=(32, 48, 3), dtype=np.uint8), "RGB").save(path)
    return path


def run(*args: str):
    return CliRunner().invoke(main, [*BASE, *args], catch_exceptions=False)


def test_two_controlnets_equal_the_pipeline_and_replay(nets, tmp_path):
    edges, depth = write_image(tmp_path / "edges.png", 1), write_image(tmp_path / "depth.png", 2)
    out = tmp_path / "out.png"
    res = run(
        "--prompt", "a cat", "--controlnet", f"{nets['instantx']}:0.8", "--controlnet", str(nets["union"]),
        "--control-image", str(edges), "--control-image", str(depth), "--control-mode", "none",
        "--control-mode", "depth", "--control-range", "0:0.75", "--out", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    pipe = Pipeline.from_pretrained(
        "tiny", device="cpu", dtype=torch.float32, controlnet=[nets["instantx"], nets["union"]]
    )
    want = pipe(
        "a cat", height=32, width=48, num_steps=3, control_image=[Image.open(edges), Image.open(depth)],
        controlnet_conditioning_scale=[0.8, 1.0], control_mode=[None, "depth"], control_guidance_end=0.75,
    )  # fmt: skip
    assert np.array_equal(pixels(out), np.asarray(want.images[0]))
    info = record(out)
    assert [(n["kind"], n["scale"], n.get("mode")) for n in info["controlnets"]] == [
        ("instantx", 0.8, None), ("union", 1.0, 2)
    ]  # fmt: skip
    assert info["controlnets"][0]["guidance_end"] == 0.75
    assert_replays(out, tmp_path / "again.png")
    write_image(depth, 9)  # a control image changed since: the replay refuses
    res = CliRunner().invoke(main, ["--replay", str(out), "--out", str(tmp_path / "x.png"), "--quiet"])
    assert res.exit_code == 1 and "depth.png has changed since" in res.output


def test_bad_controlnet_input_is_one_line(nets, tmp_path):
    edges = write_image(tmp_path / "edges.png", 1)
    lora = save_tensors({"lora_unet_a.lora_down.weight": torch.zeros(2, 2)}, tmp_path / "lora.safetensors")
    cases = [
        (["--controlnet", str(tmp_path / "missing")], "--controlnet: "),
        (["--controlnet", str(lora), "--control-image", str(edges)], "not a FLUX.1 ControlNet"),
        (["--controlnet", str(nets["instantx"])], "give one --control-image per --controlnet"),
        (["--controlnet", str(nets["union"]), "--control-image", str(edges)], "give control_mode"),
        (["--control-range", "0.5:0.2"], "is not START:END"),
        (["--model", "tiny-flux2", "--controlnet", str(nets["instantx"]), "--control-image", str(edges)],
         "need a FLUX.1 model"),
    ]  # fmt: skip
    for args, message in cases:
        res = CliRunner().invoke(main, [*BASE, "--prompt", "a cat", *args])
        assert res.exit_code != 0 and message in res.output, (args, res.output)
        assert "Traceback" not in res.output
