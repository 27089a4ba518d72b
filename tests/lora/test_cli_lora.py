"""`flux-gen --lora PATH[:SCALE]` (repeatable): the PNG records each LoRA, --replay refuses a changed one."""

from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner

from flux_runtime.cli.gen import main, parse_lora
from flux_runtime.pipeline import Pipeline
from flux_runtime.pipeline.provenance import read_provenance
from tests.lora import lora_fixtures as lf

BASE = ["--model", "tiny", "--steps", "1", "--width", "64", "--height", "64", "--quiet", "--device", "cpu"]


def _lora(tmp_path, name, seed):
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in pipe.transformer.named_modules()
        if hasattr(m, "in_features")
    }
    return lf.kohya_file(
        tmp_path / name, shapes, ["double_blocks.0.img_attn.qkv", "single_blocks.0.linear2"], seed=seed
    )


def test_parse_lora():
    assert parse_lora("a/b.safetensors:0.7") == ("a/b.safetensors", 0.7)
    assert parse_lora("a/b.safetensors") == ("a/b.safetensors", 1.0)
    assert parse_lora("org/name:-1") == ("org/name", -1.0)
    assert parse_lora("C:\\x.safetensors") == ("C:\\x.safetensors", 1.0)


@pytest.mark.slow
def test_gen_with_loras_records_and_replays(tmp_path):
    a, b = _lora(tmp_path, "a.safetensors", 1), _lora(tmp_path, "b.safetensors", 2)
    out = tmp_path / "o.png"
    res = CliRunner().invoke(
        main,
        [*BASE, "-p", "a fox", "--lora", f"{a}:0.5", "--lora", str(b), "-o", str(out)],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    rec = read_provenance(out)
    assert [(lo["name"], lo["scale"]) for lo in rec["loras"]] == [
        ("a.safetensors", 0.5),
        ("b.safetensors", 1.0),
    ]
    lf.assert_lora_changes_image_and_replays(tmp_path, [*BASE, "-p", "a fox"], out)

    res = CliRunner().invoke(main, ["--replay", str(out), "--lora", str(a), "-o", str(tmp_path / "x.png")])
    assert res.exit_code != 0 and "--replay takes --lora" in res.output
    shutil.copy(b, a)  # a's bytes change
    res = CliRunner().invoke(main, ["--replay", str(out), "-o", str(tmp_path / "y.png"), "--device", "cpu"])
    assert res.exit_code == 1 and f"its LoRA {a.resolve()} has changed since" in res.output


def test_missing_lora_fails_before_the_model_loads(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(Pipeline, "from_pretrained", boom)
    res = CliRunner().invoke(
        main,
        [*BASE, "-p", "x", "--lora", str(tmp_path / "gone.safetensors:2"), "-o", str(tmp_path / "o.png")],
    )
    assert res.exit_code == 1 and "--lora:" in res.output and "gone.safetensors" in res.output
