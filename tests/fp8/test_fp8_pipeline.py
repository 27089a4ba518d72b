"""FP8 through the user paths: `fp8=True`, `flux-gen --fp8` (and its replay), `flux-convert quantize`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.convert import main as convert_main
from flux_runtime.cli.gen import main as gen_main
from flux_runtime.models.dit.layers import Fp8Linear
from flux_runtime.pipeline import Pipeline
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.weights.transformer import load_transformer


def _record(png):
    return json.loads(Image.open(png).text["flux_runtime"])


@pytest.mark.parametrize("model", ["tiny", "tiny-flux2"])
def test_fp8_pipeline_records_its_precision_and_stays_close(model):
    kw = dict(height=64, width=64, num_steps=2, seed=0, output_type="pt")
    fp8 = Pipeline.from_pretrained(model, device="cpu", dtype=torch.bfloat16, fp8=True)
    bf16 = Pipeline.from_pretrained(model, device="cpu", dtype=torch.bfloat16)
    a, b = fp8("a red fox", **kw), bf16("a red fox", **kw)
    assert a.info["precision"] == "fp8-dynamic" and a.info["fp8_at_load"] is True
    assert b.info["precision"] == "bf16"
    diff = (a.images.float() - b.images.float()).abs().mean().item()
    assert 0 < diff < 0.05


def test_fp8_needs_bf16_in_the_api():
    with pytest.raises(FluxError, match="bfloat16"):
        Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32, fp8=True)


def test_flux_gen_fp8_and_replay(tmp_path):
    runner = CliRunner()
    out = tmp_path / "a.png"
    r = runner.invoke(
        gen_main,
        ["--model", "tiny", "--prompt", "a red fox", "--fp8", "--out", str(out), "-q", "--steps", "2"],
    )
    assert r.exit_code == 0, r.output
    assert _record(out)["precision"] == "fp8-dynamic"
    again = tmp_path / "b.png"
    r = runner.invoke(gen_main, ["--replay", str(out), "--out", str(again), "-q"])
    assert r.exit_code == 0, r.output
    assert np.array_equal(np.array(Image.open(out)), np.array(Image.open(again)))


def test_quantize_writes_a_modelopt_folder_that_loads(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n\na blue square\n")
    dst = tmp_path / "fp8"
    r = CliRunner().invoke(
        convert_main,
        [
            "quantize",
            "tiny",
            str(dst),
            "--calibration-prompts",
            str(prompts),
            "--calibration-steps",
            "1",
            "--calibration-size",
            "32",
            "-q",
        ],
    )
    assert r.exit_code == 0, r.output
    cfg = json.loads((dst / "config.json").read_text())
    assert (
        cfg["quantization_config"]["quant_method"] == "modelopt"
        and cfg["quantization_config"]["quant_algo"] == "FP8"
    )
    from safetensors import safe_open

    with safe_open(str(dst / "diffusion_pytorch_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("transformer_blocks.0.attn.to_q.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("transformer_blocks.0.attn.to_q.input_scale").shape == ()
        assert f.get_tensor("transformer_blocks.0.norm1.linear.weight").dtype == torch.bfloat16
    assert "single_transformer_blocks.0.proj_mlp.weight_scale" in keys
    model = load_transformer(dst, dtype=torch.bfloat16)
    assert model.precision == "fp8-static"
    qkv = model.double_blocks[0].img_attn.qkv
    assert (
        isinstance(qkv, Fp8Linear)
        and qkv.input_scale is not None
        and qkv.weight_scale.numel() in (1, qkv.out_features)
    )

    # quantizing it again is refused; a missing prompts file is a one-line error
    r = CliRunner().invoke(convert_main, ["quantize", str(dst), str(tmp_path / "again"), "-q"])
    assert r.exit_code == 1
    r = CliRunner().invoke(
        convert_main,
        ["quantize", "tiny", str(tmp_path / "x"), "--calibration-prompts", str(tmp_path / "nope.txt")],
    )
    assert r.exit_code == 2 and "nope.txt" in r.output
