"""`flux-gen` as a process: a run that succeeded ends without the interpreter's teardown, with everything it
printed and wrote intact; a failure exits the usual way, with its code and its one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flux_runtime.pipeline.provenance import read_provenance


def _flux_gen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flux_runtime.cli.gen", *args], capture_output=True, text=True, timeout=600
    )


def test_a_finished_run_keeps_its_output_and_files(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    done = _flux_gen(
        "--model", "tiny", "--prompts", str(prompts), "--steps", "2", "--width", "32", "--height", "32",
        "--out", str(tmp_path / "out"), "--timings",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = done.stdout.split()  # piped stdout is buffered: flushed before the process ends
    assert len(printed) == 2 and all(Path(p).is_file() for p in printed)
    assert [read_provenance(Path(p))["prompt"] for p in printed] == ["a red circle", "a blue square"]
    assert "timings: " in done.stderr


def test_a_failed_run_exits_with_its_code_and_one_line(tmp_path: Path) -> None:
    failed = _flux_gen("--model", "tiny", "--prompt", "x", "--image", str(tmp_path / "missing.png"))
    assert failed.returncode != 0 and "Traceback" not in failed.stderr
    assert "missing.png" in failed.stderr
