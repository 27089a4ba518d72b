"""flux-gen --attention: FP8 attention asked for from the command line, checked before the first image, replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image
from PIL.PngImagePlugin import PngInfo

import flux_runtime.cli.gen as gen
from flux_runtime.kernels import attention_backends as backends
from flux_runtime.pipeline.provenance import read_provenance

TINY = ["--model", "tiny", "--height", "32", "--width", "32", "--steps", "2", "--quiet", "--prompt", "a fox"]


def test_auto_runs_and_records_what_ran(tmp_path: Path) -> None:
    """On the CPU `--attention auto` cannot take FP8 attention: the image is made, the record says SDPA, and the
    process's setting is back to the default afterwards."""
    out = tmp_path / "a.png"
    res = CliRunner().invoke(gen.main, [*TINY, "--quality", "high", "--attention", "auto", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert read_provenance(out)["attention"] == "sdpa"
    assert backends.attention_preference() == "sdpa"


def test_fp8_attention_on_heads_it_does_not_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With FP8 attention runnable (stood in for here), a model whose heads are not 128 wide is refused in one line
    after its load, before any image, and no PNG is written."""
    monkeypatch.setattr(backends, "fp8_obstacle", lambda device, dtype, head_dim: None)
    out = tmp_path / "a.png"
    res = CliRunner().invoke(
        gen.main, [*TINY, "--quality", "high", "--attention", "fa3-fp8", "--out", str(out)]
    )
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert "--attention fa3-fp8 cannot run on this model: its heads are 48 wide" in lines[0]
    assert not out.exists() and backends.attention_preference() == "sdpa"


def test_a_replay_insists_on_the_recorded_fp8_attention(tmp_path: Path) -> None:
    """An image whose record says FP8 attention ran is replayed with `--attention fa3-fp8`: on a machine that
    cannot run it the replay stops in one line rather than remake it in bf16 attention."""
    made = tmp_path / "a.png"
    assert CliRunner().invoke(gen.main, [*TINY, "--out", str(made)]).exit_code == 0
    rec = {**read_provenance(made), "quality": "high", "attention": "fa3-fp8"}
    meta = PngInfo()
    meta.add_text("flux_runtime", json.dumps(rec))
    fp8 = tmp_path / "fp8.png"
    Image.open(made).save(fp8, pnginfo=meta)
    res = CliRunner().invoke(gen.main, ["--replay", str(fp8), "--out", str(tmp_path / "b.png"), "--quiet"])
    assert res.exit_code == 1, res.output
    assert "--attention fa3-fp8 cannot run here: on cpu" in res.output
    res = CliRunner().invoke(gen.main, ["--replay", str(made), "--out", str(tmp_path / "c.png"), "--quiet"])
    assert res.exit_code == 0, res.output
