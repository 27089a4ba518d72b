"""scripts/eval_high_image.py runs its arms end to end (on the CPU: the script's own check, no FP8 arms)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_arms_run_and_the_reference_is_itself(tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "eval_high_image.py"), "tiny", "--size", "32", "--steps", "2",
         "--device", "cpu", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    arms = json.loads(out.read_text())["arms"]
    assert list(arms) == ["float32 lossless", "float32 high", "float32 high, attention sdpa"]
    assert arms["float32 lossless"]["psnr_vs_lossless_db"] == float("inf")
    # off a GPU `high` runs lossless (and says so), so every picture is the reference's
    assert all(a["quality"] == "lossless" and a["psnr_vs_lossless_db"] == float("inf") for a in arms.values())
    assert all(a["attention"] == "sdpa" and a["loop_s"] > 0 for a in arms.values())


def test_the_fp8_arms_run_static_scales_included(tmp_path: Path) -> None:
    """In bf16 the FP8 arms run too (torch's CPU `_scaled_mm`), the last two with static input scales."""
    out = tmp_path / "eval.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "eval_high_image.py"), "tiny", "--size", "32", "--steps", "2",
         "--device", "cpu", "--dtype", "bf16", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    arms = json.loads(out.read_text())["arms"]
    assert list(arms)[3:] == [
        "fp8 high", "fp8 high, attention sdpa", "fp8 lossless", "fp8 static high", "fp8 static lossless",
    ]  # fmt: skip
    assert [a["precision"] for a in arms.values()][2:] == ["bf16"] + ["fp8-dynamic"] * 3 + ["fp8-static"] * 2
    # FP8 moves the picture, and static scales move it again
    assert arms["fp8 lossless"]["psnr_vs_lossless_db"] < float("inf")
    assert arms["fp8 static lossless"]["psnr_vs_lossless_db"] != arms["fp8 lossless"]["psnr_vs_lossless_db"]
