"""A rank that dies or stops answering ends the run with one clear error, not a hang; `flux-gen --gpus`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import dies_mid_run, stalls

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_killed_rank_ends_the_others_run_with_one_error():
    main, dead = run_ranks(2, dies_mid_run, "tiny", 60.0, allow_dead=True)
    assert dead is None  # rank 1 was killed at its second step
    assert main["error"] == "LostRank"
    assert main["message"].startswith("rank 0: another rank of the parallel run stopped answering during ")
    assert main["seconds"] < 30  # a closed connection is seen at once, long before the 60 s timeout


@pytest.mark.slow
def test_a_silent_rank_times_out():
    main, _ = run_ranks(2, stalls, 2.0)
    assert main["error"] == "LostRank" and "during a test broadcast" in main["message"]
    assert 1.5 < main["seconds"] < 20


COMMON = ["--prompt", "a red circle", "--width", "64", "--height", "64", "--steps", "2"]


def _flux_gen(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "flux_runtime.cli.gen", "--model", "tiny", "--device", "cpu", "-q", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_flux_gen_gpus_spawns_ranks_and_rank0_writes_the_image(tmp_path):
    import torch

    from flux_runtime.pipeline import Pipeline
    from flux_runtime.pipeline.provenance import read_provenance

    two = _flux_gen(*COMMON, "--gpus", "2", "--out", str(tmp_path / "two.png"))
    assert two.returncode == 0, two.stderr
    assert two.stdout.split() == [str(tmp_path / "two.png")]  # printed once, by rank 0
    one = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    image = one("a red circle", width=64, height=64, num_steps=2, output_type="np").images[0]
    assert np.array_equal(np.asarray(Image.open(tmp_path / "two.png")), image)
    assert read_provenance(tmp_path / "two.png")["parallel"] == {
        "world_size": 2,
        "sequence_parallel": 2,
        "cfg_parallel": False,
    }


def test_flux_gen_gpus_checks_before_starting_ranks(tmp_path):
    from click.testing import CliRunner

    from flux_runtime.cli.gen import main

    (tmp_path / "taken.png").write_bytes(b"")
    args = [
        "--model",
        "tiny",
        "--device",
        "cpu",
        *COMMON,
        "--gpus",
        "2",
        "--out",
        str(tmp_path / "taken.png"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and result.output.count("already exists") == 1
