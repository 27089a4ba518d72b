"""flux-gen --ip-adapter: the image it writes is the pipeline's, its record names the adapter and the images,
--replay remakes it, and bad inputs fail in one line before any model loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from flux_runtime.cli.gen import main
from flux_runtime.pipeline import Pipeline
from tests.cli.gen_helpers import assert_replays, pixels, record
from tests.ip_adapter.ip_fixtures import picture
from tests.random_models import save_tensors

SIZE = ["--height", "32", "--width", "32", "--steps", "2", "--seed", "3", "--quiet"]


def _run(*args: str):
    return CliRunner().invoke(main, [*SIZE, *args])


def test_flux_gen_with_an_ip_adapter_records_it_and_replays(ip_files: dict, tmp_path) -> None:
    image, negative = tmp_path / "style.png", tmp_path / "neg.png"
    picture(1).save(image)
    picture(2).save(negative)
    out = tmp_path / "out.png"
    res = _run(
        "--model", str(ip_files["pipe"]), "--prompt", "a fox", "--ip-adapter", f"{ip_files['adapter']}:0.7",
        "--ip-image-encoder", str(ip_files["clip"]), "--ip-image", str(image), "--negative-ip-image",
        str(negative), "--negative-prompt", "blurry", "--true-cfg", "2", "--out", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    info = record(out)
    assert info["ip_adapter"]["scale"] == 0.7 and info["ip_adapter"]["image_encoder"] == str(ip_files["clip"])
    assert info["ip_adapter_images"]["ip_adapter_image"]["path"] == str(image.resolve())
    # the pipeline's own image for the same call
    from PIL import Image

    pipe = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=torch.float32)
    pipe.load_ip_adapter(ip_files["adapter"], 0.7, image_encoder=ip_files["clip"])
    want = pipe(
        "a fox", height=32, width=32, num_steps=2, seed=3, ip_adapter_image=Image.open(image),
        negative_ip_adapter_image=Image.open(negative), negative_prompt="blurry", true_cfg_scale=2.0,
    ).images[0]  # fmt: skip
    assert np.array_equal(pixels(out), np.asarray(want))
    assert_replays(out, tmp_path / "again.png")
    picture(5).save(image)  # the image prompt changed since: the replay refuses
    res = CliRunner().invoke(main, ["--replay", str(out), "--out", str(tmp_path / "x.png"), "--quiet"])
    assert res.exit_code == 1 and "style.png has changed since" in res.output


def test_bad_ip_adapter_options_fail_before_the_load(ip_files: dict, tmp_path, monkeypatch) -> None:
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Pipeline, "from_pretrained", no_load)
    image = tmp_path / "style.png"
    picture(1).save(image)
    not_image = tmp_path / "notes.png"
    not_image.write_text("not a picture")
    lora = save_tensors({"x.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "lora.safetensors")
    model, adapter, clip = str(ip_files["pipe"]), str(ip_files["adapter"]), str(ip_files["clip"])
    base = ["--model", model, "--prompt", "a fox"]
    cases = [
        ([*base, "--ip-image", str(image)], "--ip-image needs --ip-adapter"),
        ([*base, "--ip-adapter", adapter], "--ip-adapter needs --ip-image"),
        ([*base, "--ip-adapter", str(tmp_path / "gone.safetensors"), "--ip-image", str(image)], "neither an existing"),
        ([*base, "--ip-adapter", str(lora), "--ip-image", str(image)], "not a FLUX IP-Adapter"),
        (
            [*base, "--ip-adapter", adapter, "--ip-image", str(image), "--ip-image-encoder", str(tmp_path)],
            "is not a CLIP vision encoder",
        ),
        ([*base, "--ip-adapter", adapter, "--ip-image", str(not_image)], "cannot read image"),
        (
            ["--model", "tiny-flux2", "--prompt", "a fox", "--ip-adapter", adapter, "--ip-image", str(image),
             "--ip-image-encoder", clip],
            "--ip-adapter, --ip-image, --ip-image-encoder need a FLUX.1 model; tiny-flux2 is FLUX.2",
        ),
    ]  # fmt: skip
    for args, message in cases:
        res = _run(*args, "--out", str(tmp_path / "o.png"))
        assert res.exit_code != 0, args
        assert message in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.parametrize("flag", ["--ip-adapter", "--ip-image"])
def test_help_names_the_options(flag: str) -> None:
    res = CliRunner().invoke(main, ["--help"])
    assert flag in res.output
