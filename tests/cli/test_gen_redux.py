"""flux-gen --redux: the image's variation equals the pipeline's, is recorded, replays, and bad input is one
line before any model work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import main
from flux_runtime.pipeline import Pipeline
from tests.cli.gen_helpers import assert_replays, pixels, record
from tests.redux_fixtures import save_bfl_redux, save_redux

BASE = ["--model", "tiny", "--height", "32", "--width", "32", "--steps", "2", "--quiet"]


def _run(*args: str):
    return CliRunner().invoke(main, [*BASE, *args])


def _write(path, seed: int):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, size=(24, 40, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen-redux")
    return save_redux(root / "redux", 32), save_bfl_redux(root / "flux1-redux-dev.safetensors", 32)


@pytest.mark.slow  # three tiny runs: flux-gen, the pipeline, the replay
def test_redux_run_equals_the_pipeline_and_replays(files, tmp_path):
    folder, _ = files
    single = save_bfl_redux(tmp_path / "flux1-redux-dev.safetensors", 32)
    a, b = _write(tmp_path / "a.png", 1), _write(tmp_path / "b.png", 2)
    out = tmp_path / "out.png"
    res = _run(
        "--redux", str(single), "--redux-image-encoder", str(folder), "--image", str(a), "--image", str(b),
        "--redux-scale", "0.9", "--out", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    info = record(out)
    assert info["prompt"] is None and info["redux"]["path"] == str(single)
    assert info["redux"]["image_encoder"] == str(folder)
    assert info["redux"]["prompt_embeds_scale"] == [0.9, 0.9]
    assert [r["path"] for r in info["redux"]["images"]] == [str(a.resolve()), str(b.resolve())]

    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32, redux=single,
                                    redux_image_encoder=folder)  # fmt: skip
    with Image.open(a) as ia, Image.open(b) as ib:
        want = pipe(image=[ia, ib], prompt_embeds_scale=0.9, height=32, width=32, num_steps=2).images[0]
    assert np.array_equal(pixels(out), np.asarray(want))
    assert_replays(out, tmp_path / "again.png")

    _write(b, 9)  # an image changed since: the replay refuses
    res = CliRunner().invoke(main, ["--replay", str(out), "--out", str(tmp_path / "x.png"), "--quiet"])
    assert res.exit_code == 1 and "b.png has changed since" in res.output
    save_bfl_redux(single, 32, seed=12)  # so did the Redux
    res = CliRunner().invoke(main, ["--replay", str(out), "--out", str(tmp_path / "x.png"), "--quiet"])
    assert res.exit_code == 1 and f"its Redux {single} has changed since" in res.output


def test_redux_with_a_prompt_from_the_folder(files, tmp_path):
    folder, _ = files
    out = tmp_path / "p.png"
    res = _run(
        "--redux", str(folder), "--image", str(_write(tmp_path / "a.png", 3)), "-p", "a fox", "-o", str(out)
    )
    assert res.exit_code == 0, res.output
    assert record(out)["prompt"] == "a fox" and record(out)["redux"]["image_encoder"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--redux", "{folder}"], "--redux needs --image"),
        (["--redux", "{single}", "--image", "{image}"], "name its SigLIP image encoder too"),
        (["--redux", "{missing}", "--image", "{image}"], "neither an existing file or folder"),
        (["--redux-image-encoder", "{folder}", "-p", "x"], "--redux-image-encoder needs --redux"),
        (["--redux-scale", "0.5", "-p", "x"], "--redux-scale needs --redux"),
        (["--redux", "{folder}", "--image", "{image}", "--strength", "0.5"], "drop --strength"),
        (["--redux", "{folder}", "--image", "{image}", "--gpus", "2"], "--redux runs on one GPU for now"),
        (
            ["--redux", "{folder}", "--image", "{image}", "--model", "tiny-flux2"],
            "--redux needs a FLUX.1 model",
        ),
    ],
)
def test_bad_redux_options_fail_before_the_load(files, tmp_path, monkeypatch, args, message):
    from flux_runtime.pipeline import Pipeline as Loaded

    def boom(*a, **k):
        raise AssertionError("the model loaded before the options were checked")

    monkeypatch.setattr(Loaded, "from_pretrained", boom)
    folder, single = files
    names = dict(
        folder=folder, single=single, missing=tmp_path / "no.safetensors", image=_write(tmp_path / "i.png", 1)
    )
    res = _run(*(a.format(**names) for a in args), "--out", str(tmp_path / "o.png"))
    assert res.exit_code != 0 and message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
