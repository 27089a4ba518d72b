"""flux-gen's first run against a local stand-in of the Hub (`online`): a model id is fetched (its plan only)
and used, `--download-only` prefetches, `--offline` touches nothing, and the failures are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from PIL import Image

from flux_runtime.cli.gen import main

SCHNELL = "black-forest-labs/FLUX.1-schnell"


def _run(*args: str):
    return CliRunner().invoke(main, [*args, "--quiet"], catch_exceptions=False)


def test_a_first_run_fetches_the_model_and_draws(online, tmp_path) -> None:
    out = tmp_path / "fox.png"
    res = _run("--model", "flux1-schnell", "--prompt", "a fox", "--steps", "1", "--width", "64", "--height", "64",
               "--device", "cpu", "--out", str(out))  # fmt: skip
    assert res.exit_code == 0, res.output
    with Image.open(out) as im:
        info = json.loads(im.text["flux_runtime"])
    assert info["hub"] == {"repo": SCHNELL, "revision": online.repos[SCHNELL].sha}
    assert "flux1-schnell.safetensors" not in online.fetched(SCHNELL)


def test_download_only_says_what_it_fetched(online) -> None:
    res = CliRunner().invoke(main, ["--model", "flux1-schnell", "--download-only"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith(f"flux-gen: {SCHNELL} (") and "files," in line and "fetched" in line
    assert "repository's" in line
    res = _run("--model", "flux1-schnell", "--download-only")
    assert res.exit_code == 0 and res.output.strip().endswith("all already in the cache")
    res = _run("--model", "tiny", "--download-only")
    assert res.exit_code == 0 and "nothing to fetch for tiny" in res.output


def test_offline_and_gated_runs_end_in_one_line(online, tmp_path) -> None:
    res = _run("--model", "flux1-schnell", "--prompt", "a fox", "--offline", "--out", str(tmp_path / "x.png"))
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert f"'{SCHNELL}' is not in the local Hugging Face cache" in res.output
    res = _run("--model", "flux1-schnell", "--download-only", "--offline")
    assert (
        res.exit_code == 1
        and "--download-only fetches from the Hugging Face Hub: drop --offline" in res.output
    )
    assert online.log == []
    res = _run("--model", "flux1-dev", "--prompt", "a fox", "--out", str(tmp_path / "x.png"))
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert "black-forest-labs/FLUX.1-dev is gated: accept its licence" in res.output
    assert "hf auth login" in res.output and online.fetched() == []


def test_hf_endpoint_points_a_fresh_process_at_the_hub(online, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(
        HF_ENDPOINT=online.url,
        HF_HUB_CACHE=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="0",
        HF_TOKEN_PATH=str(tmp_path / "token"),
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
    )
    cmd = [
        sys.executable,
        "-m",
        "flux_runtime.cli.gen",
        "--model",
        "flux1-schnell",
        "--download-only",
        "--quiet",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "transformer/diffusion_pytorch_model-00003-of-00003.safetensors" in online.fetched(SCHNELL)
    assert (tmp_path / "cache" / "models--black-forest-labs--FLUX.1-schnell").is_dir()
