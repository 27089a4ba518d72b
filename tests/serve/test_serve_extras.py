"""`flux-serve` without its optional extras: one line naming the install command, no traceback, before any
model is loaded. Collected without the serve extra too (it needs only click)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from flux_runtime.serve import command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("hidden", "args", "line"),
    [
        ("uvicorn", [], "Error: flux-serve needs the serve extra (uvicorn is missing): pip install 'flux-runtime[serve]'"),
        ("fastapi", ["--replicas", "2"], "Error: flux-serve needs the serve extra (fastapi is missing)"),
        ("ray", ["--replicas", "2"],
         "Error: flux-serve --replicas needs the ray extra (ray is missing): pip install 'flux-runtime[ray]'"),
    ],
)  # fmt: skip
def test_a_missing_extra_is_one_line(monkeypatch, hidden, args, line):
    monkeypatch.setitem(sys.modules, hidden, None)  # an import of it fails as if it were not installed
    monkeypatch.setattr(command, "serve", lambda load, opts: pytest.fail("served without its extra"))
    result = CliRunner().invoke(command.main, ["--device", "cpu", *args])
    assert result.exit_code == 1
    assert result.output.startswith(line) and len(result.output.splitlines()) == 1, result.output


def test_a_missing_extra_in_a_real_process_has_no_traceback():
    code = "import sys; sys.modules['uvicorn'] = None; from flux_runtime.serve.command import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, "--model", "tiny"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 1
    assert (
        out.stderr
        == "Error: flux-serve needs the serve extra (uvicorn is missing): pip install 'flux-runtime[serve]'\n"
    )


def test_ray_options_go_with_replicas():
    result = CliRunner().invoke(command.main, ["--gpus-per-replica", "1"])
    assert result.exit_code == 2 and "--gpus-per-replica goes with --replicas" in result.output
