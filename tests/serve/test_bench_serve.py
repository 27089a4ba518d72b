"""scripts/bench_serve.py: its random-weight FLUX.1 [dev] pipeline (built here at the tiny presets' sizes),
the child that serves it with flux-serve's options, and one short run of the whole bench on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from scripts import bench_serve
from tests.serve.server import ROOT


def _tiny_random(seed: int):
    from flux_runtime.models.dit import PRESETS
    from flux_runtime.models.vae.flux1 import VAE_PRESETS
    from flux_runtime.text.tiny import tiny_clip_config, tiny_t5_config
    from flux_runtime.text.tokenizers import load_clip_tokenizer, load_t5_tokenizer, tiny_tokenizer_path

    clip = tiny_clip_config(len(load_clip_tokenizer(tiny_tokenizer_path("clip"))))
    t5 = tiny_t5_config(len(load_t5_tokenizer(tiny_tokenizer_path("t5"))))
    return bench_serve.random_flux1_pipeline(
        device="cpu", dtype=torch.float32, cuda_graphs=False, dit=PRESETS["tiny"], vae=VAE_PRESETS["tiny"],
        clip=clip, t5=t5, seed=seed,
    )  # fmt: skip


def test_random_pipeline_is_flux1_dev_seeded_and_runs():
    kw = dict(seed=1, width=32, height=32, num_steps=2, max_sequence_length=16)
    state = torch.random.get_rng_state()
    a, b, c = _tiny_random(0), _tiny_random(0), _tiny_random(1)
    assert torch.equal(torch.random.get_rng_state(), state)  # building leaves the global generator alone
    out = a("a red fox", **kw)
    assert torch.isfinite(out.latents).all()
    assert torch.equal(out.latents, b("a red fox", **kw).latents)
    assert not torch.equal(out.latents, c("a red fox", **kw).latents)
    assert (out.info["model"], out.info["weights"]) == ("flux1-dev", "flux1-dev-random-seed0")
    # served as flux1-dev: its defaults (28 steps, 1024², 512 text tokens), not a tiny model's
    assert (a.default_steps, a.default_size, a.default_max_sequence_length) == (28, 1024, 512)
    assert not [n for n, p in a.transformer.named_parameters() if p.is_meta or p.requires_grad]


def test_child_serves_the_random_pipeline_with_flux_serve_options(monkeypatch):
    seen: dict = {}

    def build(**kw):
        seen["build"] = kw
        return "the pipeline"

    monkeypatch.setattr(bench_serve, "random_flux1_pipeline", build)
    monkeypatch.setattr(
        "flux_runtime.serve.command.serve", lambda load, opts: seen.update(load=load, opts=opts)
    )
    bench_serve.serve_random(["--model", "flux1-dev", "--device", "cpu", "--max-batch", "3", "--no-batching"])
    assert "build" not in seen  # built by the server's worker thread, once the port answers
    assert seen["load"]() == "the pipeline"
    assert (seen["opts"]["model"], seen["opts"]["max_batch"], seen["opts"]["no_batching"]) == (
        "flux1-dev",
        3,
        True,
    )
    assert seen["build"]["dtype"] == torch.float32 and seen["build"]["cuda_graphs"] is True
    with pytest.raises(SystemExit, match="builds flux1-dev, not 'flux2-dev'"):
        bench_serve.serve_random(["--model", "flux2-dev", "--device", "cpu"])


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert bench_serve.percentile(values, 50) == 50 and bench_serve.percentile(values, 99) == 99
    assert bench_serve.percentile([3.0, 1.0, 2.0], 99) == 3.0 and bench_serve.percentile([1.0], 50) == 1.0


@pytest.mark.slow
def test_bench_runs_both_modes_on_the_cpu(tmp_path):
    out = tmp_path / "summary.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_serve.py"), "--device", "cpu", "--size", "64",
           "--steps", "1", "--requests", "4", "--concurrency", "2", "--max-batch", "2", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])  # the last line is the JSON summary
    assert summary == json.loads(out.read_text())
    for mode in ("batching", "no_batching"):
        r = summary[mode]
        assert (r["requests"], r["answered"], r["every_request_answered_once_with_its_seed"]) == (4, 4, True)
        assert (r["size"], r["steps"], r["device"]) == ("64x64", 1, "cpu")
        assert r["images_per_min"] > 0 and 0 < r["p50_s"] <= r["p99_s"]
    assert summary["no_batching"]["mean_batch"] == 1.0 and 1.0 <= summary["batching"]["mean_batch"] <= 2.0
    assert summary["batching_speedup"] > 0


def test_ray_overhead_is_the_ray_runs_ratios():
    one = {"images_per_min": 12.0, "p50_s": 5.0, "p99_s": 6.0}
    ray = {"images_per_min": 11.7, "p50_s": 5.1, "p99_s": 6.6}
    assert bench_serve.ray_overhead(one, ray) == {
        "images_per_min_ratio": 0.975, "throughput_loss_pct": 2.5, "p50_ratio": 1.02, "p99_ratio": 1.1,
    }  # fmt: skip
    assert bench_serve.ray_overhead({**one, "images_per_min": 0.0, "p50_s": None}, ray)["p50_ratio"] is None
    keys = [bench_serve.mode_key(b, n) for b, n in ((True, None), (False, None), (True, 1), (False, 2))]
    assert keys == ["batching", "no_batching", "batching_ray1", "no_batching_ray2"]


@pytest.mark.slow
def test_bench_compares_one_process_with_one_ray_replica_on_the_cpu(tmp_path):
    pytest.importorskip("ray.serve", reason="needs the ray extra (pip install 'flux-runtime[ray]')")
    out = tmp_path / "summary.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_serve.py"), "--device", "cpu", "--size", "64",
           "--steps", "1", "--requests", "4", "--concurrency", "2", "--max-batch", "2", "--modes", "batching",
           "--compare-replicas", "--json", str(out), "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    summary = json.loads(out.read_text())
    one, ray = summary["batching"], summary["batching_ray1"]
    for r in (one, ray):
        assert (r["requests"], r["answered"], r["every_request_answered_once_with_its_seed"]) == (4, 4, True)
        assert (r["size"], r["steps"], r["device"]) == ("64x64", 1, "cpu")
        assert r["pipeline_calls"] >= 2  # the metrics of the replica, read through Ray's proxy
    assert "replicas" not in one and ray["replicas"] == 1 and ray["server_exit"] == 0
    assert sum(ray["answers_per_replica"].values()) == 4 and len(ray["answers_per_replica"]) == 1
    assert ray["ray_processes_left"] == []  # Ray shut down with the server
    overhead = summary["ray_overhead"]["batching"]
    assert overhead["images_per_min_ratio"] == round(ray["images_per_min"] / one["images_per_min"], 4)
    assert "Ray Serve, 1 replica(s) vs one process, batching" in done.stdout
