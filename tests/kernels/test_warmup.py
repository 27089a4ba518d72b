"""`kernels.warmup`: Triton's per-process cache key computed once, on a side thread, for CUDA devices only."""

from __future__ import annotations

import threading

import pytest
import torch

from flux_runtime.kernels import warmup


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """No thread started yet, the GPU flag on, and a key function that records the thread it ran on."""
    ran: list[str] = []
    gate = threading.Event()

    def key() -> str:
        gate.wait(5)
        ran.append(threading.current_thread().name)
        return "key"

    monkeypatch.setattr(warmup, "_thread", None)
    monkeypatch.setattr(warmup, "ON_GPU", True)
    monkeypatch.setattr(warmup, "triton_key_function", lambda: key)
    monkeypatch.setattr(warmup, "_gate_for_test", gate, raising=False)
    return ran


def test_the_key_is_computed_once_on_a_side_thread(fresh: list[str]) -> None:
    assert warmup.start(torch.device("cuda", 0))
    assert not warmup.start(torch.device("cuda", 0))  # once per process
    assert fresh == []  # still running: start did not wait for it
    warmup._gate_for_test.set()  # type: ignore[attr-defined]
    warmup.finish()
    assert fresh == ["flux-triton-key"]
    warmup.finish()  # a no-op afterwards
    assert fresh == ["flux-triton-key"]


def test_nothing_starts_off_a_cuda_device(fresh: list[str]) -> None:
    assert not warmup.start(torch.device("cpu"))
    assert warmup._thread is None
    warmup.finish()
    assert fresh == []


def test_nothing_starts_under_the_interpreter_or_without_the_key(
    fresh: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(warmup, "ON_GPU", False)
    assert not warmup.start(torch.device("cuda"))
    monkeypatch.setattr(warmup, "ON_GPU", True)
    monkeypatch.setattr(warmup, "triton_key_function", lambda: None)
    assert not warmup.start(torch.device("cuda"))
    assert warmup._thread is None


def test_a_failing_key_leaves_the_error_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> str:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(warmup, "_thread", None)
    monkeypatch.setattr(warmup, "ON_GPU", True)
    monkeypatch.setattr(warmup, "triton_key_function", lambda: broken)
    assert warmup.start(torch.device("cuda"))
    warmup.finish()  # no exception escapes the thread or the join


def test_the_installed_triton_names_its_key_as_expected() -> None:
    pytest.importorskip("triton")
    key = warmup.triton_key_function()
    assert key is not None and key.__name__ == "triton_key"
