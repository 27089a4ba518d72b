"""flux-gen on the built-in tiny FLUX.3 model: the file, its provenance, replay, one-line errors."""

from __future__ import annotations

import json

import numpy as np
import torch
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import MODEL_CHOICES, main
from flux_runtime.pipeline import Pipeline
from tests.cli.gen_helpers import assert_replays, pixels

BASE = ["--model", "tiny-flux3-random", "--steps", "2", "--height", "32", "--width", "48", "--quiet"]


def _run(*args: str):
    return CliRunner().invoke(main, [*BASE, *args], catch_exceptions=False)


def test_generates_replays_and_matches_the_library(tmp_path) -> None:
    assert {"tiny-flux3-random", "flux3-klein", "flux3-klein-base"} <= set(MODEL_CHOICES)
    out = tmp_path / "fox.png"
    res = _run("--prompt", "a red fox", "--seed", "5", "--out", str(out))
    assert res.exit_code == 0, res.output
    with Image.open(out) as im:
        info = json.loads(im.text["flux_runtime"])
        assert im.size == (48, 32)
    assert info["model"] == "tiny-flux3-random" and info["guidance"] == 3.5 and info["num_steps"] == 2
    pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    want = pipe("a red fox", seed=5, height=32, width=48, num_steps=2, output_type="np").images[0]
    assert np.array_equal(pixels(out), want)
    assert_replays(out, tmp_path / "again.png")


def test_options_of_other_families_are_refused(tmp_path) -> None:
    res = _run("--prompt", "a", "--negative-prompt", "b", "--out", str(tmp_path / "x.png"))
    assert (
        res.exit_code != 0
        and "--negative-prompt needs a FLUX.1 model; tiny-flux3-random is FLUX.3" in res.output
    )


def test_options_of_other_families_fail_before_the_model_loads(tmp_path, monkeypatch) -> None:
    from flux_runtime.pipeline import Pipeline

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before the options were checked")

    monkeypatch.setattr(Pipeline, "from_pretrained", never)
    for extra, message in (
        (["--negative-prompt", "b"], "--negative-prompt needs a FLUX.1 model"),
        (["--negative-prompt", "b", "--true-cfg", "2"], " need a FLUX.1 model"),
    ):
        res = _run("--prompt", "a", *extra, "--out", str(tmp_path / "x.png"))
        assert res.exit_code == 1 and message in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1
