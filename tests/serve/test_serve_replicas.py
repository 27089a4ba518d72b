"""`flux-serve --replicas 2` on a local Ray instance, two CPU replicas of `tiny`: requests spread across both
(by the X-Flux-Replica header), the same image and provenance as the one-process server for a seed, the API
keys, every replica's metrics from any replica, and a killed replica replaced while the openai client's
retries keep every request answered.

Needs the ray extra (skipped without it); slow: Ray's daemons and two replicas take about 30 s to come up on
2 cores, the whole module about 2 minutes.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest
import torch

from flux_runtime.pipeline import Pipeline
from tests.serve.images import png_with_info, served
from tests.serve.server import Server

pytest.importorskip("ray.serve", reason="needs the ray extra (pip install 'flux-runtime[ray]')")
pytestmark = pytest.mark.slow

GEN = "/v1/images/generations"
KEY = "sk-replicas-5b1e"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--replicas", "2", "--device", "cpu", "--model", "tiny", "--no-batching",
                 store=tmp_path_factory.mktemp("s"), env={"FLUX_SERVE_API_KEY": KEY}, own_pid=False,
                 start_s=300)  # fmt: skip
    yield srv
    assert srv.stop() == 0


def _post(server: Server, body: dict) -> httpx.Response:
    return httpx.post(server.url + GEN, json=body, headers=AUTH, timeout=300)


def test_requests_spread_across_both_replicas(server):
    # long enough to overlap: Ray's router sends a request to the less busy of the replicas
    bodies = [{"prompt": f"spread {i}", "seed": i, "size": "64x64", "steps": 8} for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda b: _post(server, b), bodies))
    assert [r.status_code for r in answers] == [200] * len(bodies)
    replicas = [r.headers["X-Flux-Replica"] for r in answers]
    assert len(set(replicas)) == 2, replicas
    for r, name in zip(answers, replicas, strict=True):
        assert png_with_info(r.json()["data"][0]["b64_json"])[1]["served_replica"] == name


def test_the_same_image_as_one_process(server):
    r = _post(server, {"prompt": "a red circle", "seed": 7, "size": "64x64", "steps": 2})
    ((image, info),) = served(r)
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    direct = pipe("a red circle", seed=7, width=64, height=64, num_steps=2)
    assert image.convert("RGB").tobytes() == direct.images[0].tobytes()
    # what the one-process server records, and the replica besides
    assert {k: v for k, v in info.items() if k != "served_replica"} == {
        **direct.info,
        "prompt": "a red circle",
        "seed": 7,
        "index": 0,
        "num_images": 1,
    }


def test_keys_and_probes_as_one_process(server):
    assert httpx.post(server.url + GEN, json={"prompt": "x"}, timeout=60).status_code == 401
    assert httpx.get(server.url + "/metrics", timeout=60).status_code == 401
    assert httpx.get(server.url + "/ready", timeout=60).status_code == 200
    assert httpx.get(server.url + "/health", timeout=60).json()["replica"]


def test_metrics_of_every_replica_from_any(server):
    deadline = time.monotonic() + 60
    while True:  # each replica pushes its series every few seconds
        text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=60).text
        lines = [line for line in text.splitlines() if line.startswith("flux_serve_images_total{")]
        if len(lines) == 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(lines) == 2 and all('replica="' in line for line in lines), text
    assert text.count("# TYPE flux_serve_images_total counter") == 1


def test_a_killed_replica_is_replaced_and_the_service_answers_throughout(server):
    health = httpx.get(server.url + "/health", timeout=60).json()
    before = {httpx.get(server.url + "/health", timeout=60).json()["replica"] for _ in range(20)}
    slow = {"prompt": "slow", "size": "64x64", "steps": 200}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_post, server, {**slow, "seed": s}) for s in range(4)]
        time.sleep(3)
        os.kill(health["pid"], signal.SIGKILL)  # a replica this test's server started
        codes = [f.result().status_code for f in running]  # httpx's timeout: an answer, never a hang
    assert all(c == 200 or c >= 500 for c in codes), codes
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=5)
    for i in range(10):  # while Ray starts the replacement, the client's retries get every image
        out = client.images.generate(prompt=f"after {i}", size="64x64", response_format="b64_json",
                                     extra_body={"seed": i, "steps": 1})  # fmt: skip
        assert out.data[0].b64_json
    deadline = time.monotonic() + 180
    while True:
        after = {httpx.get(server.url + "/health", timeout=60).json()["replica"] for _ in range(20)}
        if (len(after) == 2 and health["replica"] not in after) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(after) == 2 and health["replica"] not in after and len(before) >= 1, (before, after)


def test_build_reads_a_ray_config_as_flux_serve_options(monkeypatch):
    from ray.serve import Application

    from flux_runtime.serve.replicas import build

    monkeypatch.setenv("FLUX_SERVE_API_KEY", KEY)
    app = build({"model": "tiny", "replicas": 3, "device": "cpu", "no_batching": True, "max_queue": 8})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="FLUX_SERVE_API_KEY"):
        build({"model": "tiny", "api_keys": [KEY]})


def _raylets() -> int:
    """How many Ray node processes (raylet, gcs_server) run on this machine now."""
    import subprocess

    out = subprocess.run(["ps", "-eo", "comm"], capture_output=True, text=True).stdout.split()
    return sum(name in ("raylet", "gcs_server") for name in out)


def test_a_signal_before_the_replicas_are_ready_takes_ray_down(tmp_path):
    """SIGTERM while the replicas still load: flux-serve ends with status 0, saying so, and the local Ray
    instance it started is gone (no raylet or GCS process left behind)."""
    import socket
    import subprocess
    import sys

    from tests.serve.server import ROOT

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    before = _raylets()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "flux_runtime.serve", "--replicas", "1", "--device", "cpu", "--model", "tiny",
         "--port", str(port), "--store-dir", str(tmp_path)],
        env={**env, "FLUX_SERVE_API_KEY": KEY}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = []
    for line in proc.stdout:  # Ray is up and the replica is loading: the deployment has begun
        lines.append(line)
        if "replicas of tiny on Ray Serve" in line:
            break
    assert _raylets() > before, "".join(lines)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert "stopped before every replica was ready" in output or "every replica is ready" in output, output
    deadline = time.monotonic() + 30
    while _raylets() > before and time.monotonic() < deadline:
        time.sleep(1)
    assert _raylets() == before, output
