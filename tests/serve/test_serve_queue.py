"""`flux-serve`'s queue on `tiny-random` (content does not matter): a full queue answers 503 with
Retry-After, a disconnected client's queued request is dropped unrun, a timeout answers 504, and SIGTERM
finishes what is queued before the process exits."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket

import httpx
import pytest

from tests.serve.server import Server

GEN = "/v1/images/generations"
SLOW = {"prompt": "slow", "size": "64x64", "steps": 12, "seed": 1}
QUICK = {"prompt": "quick", "size": "64x64", "steps": 1, "seed": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(
        "--model", "tiny-random", "--max-queue", "1", "--no-batching", store=tmp_path_factory.mktemp("s")
    )
    yield srv
    srv.stop()


def _post(server: Server, body: dict) -> httpx.Response:
    return httpx.post(server.url + GEN, json=body, timeout=120)


def test_full_queue_answers_503_and_a_disconnected_request_is_dropped(server):
    images = server.metric("flux_serve_images_total")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(_post, server, SLOW)
        server.wait_metric("flux_serve_running", 1)
        # a raw client queues a request, then hangs up before the worker reaches it
        body = json.dumps(QUICK).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
            server.wait_metric("flux_serve_queue_depth", 1)
            full = _post(server, QUICK)  # the one queue place is taken
        server.wait_metric('flux_serve_dropped_total{reason="disconnected"}', 1)
        assert server.metric("flux_serve_queue_depth") == 0
        assert slow.result().status_code == 200
    assert full.status_code == 503 and int(full.headers["Retry-After"]) > 0
    assert full.json()["error"]["code"] == "queue_full"
    assert server.metric("flux_serve_images_total") == images + 1  # the dropped request never ran


def test_timeout_answers_504_and_the_server_goes_on(server):
    r = _post(server, {**SLOW, "steps": 400, "timeout": 0.5})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert _post(server, QUICK).status_code == 200  # the abandoned run stopped at its next step


def test_sigterm_finishes_the_queued_requests(tmp_path):
    srv = Server("--model", "tiny-random", "--max-queue", "4", store=tmp_path)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = pool.submit(_post, srv, SLOW)
        srv.wait_metric("flux_serve_running", 1)
        queued = [pool.submit(_post, srv, {**QUICK, "seed": s}) for s in (5, 6)]
        srv.wait_metric("flux_serve_queue_depth", 2)
        code = srv.stop()
        answers = [f.result() for f in (running, *queued)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down cleanly
