"""`flux-serve --lora PATH[:SCALE]` (repeatable): a real server with two LoRAs fused at load answers the same
image as a pipeline with the same LoRAs, each PNG records them; a missing or damaged LoRA is one line before
any model loads."""

from __future__ import annotations

import httpx
import pytest
import torch
from click.testing import CliRunner

from flux_runtime.pipeline import Pipeline
from flux_runtime.serve import command
from tests.lora.test_cli_lora import _lora
from tests.serve.images import served
from tests.serve.server import Server

GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return _lora(root, "a.safetensors", 1), _lora(root, "b.safetensors", 2)


@pytest.mark.slow
def test_the_served_image_is_the_pipelines_with_the_same_loras(loras, tmp_path):
    a, b = loras
    srv = Server("--model", "tiny", "--device", "cpu", "--lora", f"{a}:0.5", "--lora", str(b), store=tmp_path)
    try:
        r = httpx.post(
            srv.url + GEN, json={"prompt": "a fox", "seed": 4, "size": "64x64", "steps": 2}, timeout=120
        )
    finally:
        srv.stop()
    ((image, info),) = served(r)
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    plain = pipe("a fox", seed=4, width=64, height=64, num_steps=2)
    pipe.load_lora(a, 0.5)
    pipe.load_lora(b)
    direct = pipe("a fox", seed=4, width=64, height=64, num_steps=2)
    assert image.convert("RGB").tobytes() == direct.images[0].tobytes()
    assert image.convert("RGB").tobytes() != plain.images[0].tobytes()  # the LoRAs change the picture
    assert [(lo["name"], lo["scale"]) for lo in info["loras"]] == [
        ("a.safetensors", 0.5),
        ("b.safetensors", 1.0),
    ]
    assert info["loras"] == direct.info["loras"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{missing}", "is neither an existing file or folder"),
        ("{a}:inf", "the scale inf must be a finite number"),
        ("{damaged}", "not a safetensors file"),
    ],
)
def test_a_bad_lora_is_one_line_before_the_model_loads(loras, tmp_path, monkeypatch, spec, message):
    from flux_runtime.pipeline import Pipeline as P

    monkeypatch.setattr(P, "from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"not a safetensors file at all")
    names = {"missing": tmp_path / "missing.safetensors", "a": loras[0], "damaged": damaged}
    result = CliRunner().invoke(
        command.main, ["--model", "tiny", "--device", "cpu", "--lora", spec.format(**names)]
    )
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: --lora "), result.output
    assert message in lines[0], result.output
