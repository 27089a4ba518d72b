"""/health and /ready around the load: the app in process (starlette's TestClient runs its lifespan), its
loader held until the test lets it go; the warm-up call is made before /ready says yes; a failed load is
/ready's 503 in process and one line from `flux-serve`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from flux_runtime.pipeline import Pipeline
from flux_runtime.serve.app import ImageStore, Limits, create_app
from tests.serve.images import served

ROOT = Path(__file__).resolve().parents[2]


class Recording:
    """A pipeline that notes, for each call, its arguments and whether the server said ready before it."""

    def __init__(self, pipe: Any) -> None:
        self.pipe, self.calls, self.worker = pipe, [], None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((kwargs, self.worker.ready.is_set()))
        return self.pipe(*args, **kwargs)


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)


def _wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 60
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.05)


def test_ready_only_once_loaded_and_warm(pipe, tmp_path):
    go = threading.Event()
    recording = Recording(pipe)

    def load() -> Any:
        go.wait(60)
        return recording

    app = create_app(load, model="tiny", store=ImageStore(tmp_path, 4), limits=Limits(retry_after=3))
    recording.worker = app.state.worker
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["ready"] is False
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.headers["Retry-After"] == "3"
        assert ready.json()["error"]["code"] == "model_loading"
        r = client.post("/v1/images/generations", json={"prompt": "early", "size": "64x64"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
        assert r.headers["Retry-After"] == "3"
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"  # needs no model
        go.set()
        _wait_ready(client)
        assert client.get("/health").json()["ready"] is True
        # the warm-up: one 1-step call at the default size, made before /ready said yes
        assert len(recording.calls) == 1
        warm, was_ready = recording.calls[0]
        assert warm["num_steps"] == 1 and not was_ready
        r = client.post("/v1/images/generations", json={"prompt": "a red circle", "seed": 7, "size": "64x64",
                                                        "steps": 2})  # fmt: skip
        ((image, info),) = served(r)
        assert "served_replica" not in info  # one process: no replica to name
    direct = pipe("a red circle", seed=7, width=64, height=64, num_steps=2).images[0]
    assert image.convert("RGB").tobytes() == direct.tobytes()


def test_a_failed_load_is_not_ready(tmp_path):
    def load() -> Any:
        raise OSError("no such checkpoint")

    app = create_app(load, model="gone", store=ImageStore(tmp_path, 4), limits=Limits())
    with TestClient(app) as client:
        app.state.worker.loaded.wait(30)
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed"
        assert client.get("/health").status_code == 200
        assert not app.state.worker.healthy


def test_flux_serve_ends_a_failed_load_in_one_line(tmp_path):
    missing = tmp_path / "no-checkpoint"
    out = subprocess.run(
        [sys.executable, "-m", "flux_runtime.serve", "--model", str(missing), "--port", "0", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
