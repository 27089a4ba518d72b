"""scripts/bench_gguf.py --tiny: the GGUF step bench's whole part 2 on the CPU, on a shrunk FLUX.1.

A real parity check beside the smoke run: our GGUF model (random blocks) is written as a GGUF file, diffusers
loads it with `from_single_file` and a `GGUFQuantizationConfig` (its `GGUFLinear`s dequantizing with torch before
every matmul), and its step must be `torch.equal` to ours in `lossless` and to the bf16 twin holding our
dequantized weights."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
TYPES = ("Q8_0", "Q4_K")


def test_tiny_bench_matches_diffusers_gguf_step(tmp_path):
    out = tmp_path / "bench.json"
    files = tmp_path / "files"
    files.mkdir()
    cmd = [
        sys.executable, str(ROOT / "scripts" / "bench_gguf.py"), "--tiny", "--step-types", ",".join(TYPES),
        "--tmp", str(files), "--json", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "dequant" not in result and "diffusers_skipped" not in result
    for name in TYPES:
        step = result["steps"][name]
        assert math.isfinite(step["reference_std"]) and step["reference_std"] > 0
        # ours (off and lossless), the bf16 twin and diffusers' GGUF step: one output
        assert all(v is True for v in step["equal"].values()), step["equal"]
        dif = step["diffusers"]
        assert dif["equal_ours_lossless"] is True, dif
        assert dif["names"] == "diffusers'"  # the shrunk model's file: see bfl_names
        # diffusers made GGUF layers of the file's blocks: `name` wherever the rows hold whole blocks, Q8_0 for
        # the 64 latent channels of the K-quants' image embedder
        assert dif["gguf_linears"] == ({name: 50} if name == "Q8_0" else {name: 49, "Q8_0": 1})
        weights = step["weights_bytes"]
        assert weights[f"GGUF {name} (ours)"] == weights[f"GGUF {name} (diffusers)"] < weights["bf16 twin"]
        assert set(step["step_ms"]) == set(step["equal"]) == set(step["peak_bytes"])
        assert 0 < result["summary"][name]["weights_over_bf16"] < (0.6 if name == "Q8_0" else 0.35)
    assert not list(files.iterdir())  # each GGUF file deleted once diffusers loaded it
    assert "| diffusers GGUF Q4_K, eager |" in run.stdout
