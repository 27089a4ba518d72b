"""flux-serve's metrics in process: the GPU memory gauges (the allocator's counters, read at scrape time, and
the device's total), the images/s window, and an exposition that prometheus_client's parser reads back
without `_created` series. The GPU test reads a real device's counters."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flux_runtime.serve.worker import Metrics


def _values(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert not [s.name for s in samples if s.name.endswith("_created")]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}


def _memory(values: dict) -> dict[str, float]:
    return {dict(k[1])["kind"]: v for k, v in values.items() if k[0] == "flux_serve_gpu_memory_bytes"}


def test_gpu_memory_gauges_read_the_allocator_at_each_scrape(monkeypatch):
    counters = {"allocated": 1 << 30, "reserved": 3 << 30, "max_allocated": 2 << 30}

    class Props:
        total_memory = 141 << 30

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: counters["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["max_allocated"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    metrics = Metrics(torch.device("cuda"))
    assert _memory(_values(metrics)) == {**counters, "total": 141 << 30}
    counters["allocated"] = 5 << 30  # read again at the next scrape, not cached
    assert _memory(_values(metrics))["allocated"] == 5 << 30


def test_no_gpu_gauges_on_the_cpu():
    assert _memory(_values(Metrics(torch.device("cpu")))) == {}


def test_images_per_second_counts_the_window_or_the_uptime(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("flux_runtime.serve.worker.time.monotonic", lambda: now[0])
    metrics = Metrics(torch.device("cpu"))
    now[0] += 4.0
    metrics.generated(2)
    assert metrics.images_per_second() == pytest.approx(2 / 4.0)  # 4 s up: 2 images over 4 s
    now[0] += 56.0
    metrics.generated(4)
    assert metrics.images_per_second() == pytest.approx(6 / 60.0)
    now[0] += 30.0  # the first 2 images are older than the window now
    assert metrics.images_per_second() == pytest.approx(4 / 60.0)
    assert _values(metrics)[("flux_serve_images_total", ())] == 6


@pytest.mark.gpu
def test_gpu_memory_gauges_on_the_device():
    device = torch.device("cuda")
    metrics = Metrics(device)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    memory = _memory(_values(metrics))
    assert memory["allocated"] >= x.numel() and memory["reserved"] >= memory["allocated"]
    assert memory["max_allocated"] >= memory["allocated"]
    assert memory["total"] == torch.cuda.get_device_properties(device).total_memory
    del x
