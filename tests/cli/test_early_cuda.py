"""`cli.early_cuda`: which `--device` values start the CUDA context early, and the driver calls it makes."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from flux_runtime.cli import early_cuda


@pytest.mark.parametrize(
    ("device", "index"),
    [(None, 0), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), (" cuda:1 ", 1), ("cpu", None), ("mps", None),
     ("cuda:x", None), ("cudax", None)],
)  # fmt: skip
def test_the_ordinal_a_device_names(device: str | None, index: int | None) -> None:
    assert early_cuda.ordinal(device) == index


class FakeDriver:
    """The three driver entry points, recording their arguments; `fail` names one that returns an error."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail

    def _result(self, name: str) -> int:
        return 100 if name == self.fail else 0

    def cuInit(self, flags: int) -> int:
        self.calls.append(("cuInit", flags))
        return self._result("cuInit")

    def cuDeviceGet(self, device: Any, index: int) -> int:
        self.calls.append(("cuDeviceGet", index))
        ctypes.cast(device, ctypes.POINTER(ctypes.c_int)).contents.value = 7
        return self._result("cuDeviceGet")

    def cuDevicePrimaryCtxRetain(self, context: Any, device: ctypes.c_int) -> int:
        self.calls.append(("cuDevicePrimaryCtxRetain", device.value))
        return self._result("cuDevicePrimaryCtxRetain")


def test_the_primary_context_of_the_named_device_is_retained(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(early_cuda.ctypes, "CDLL", lambda name: driver)
    assert early_cuda.retain_primary_context(2)
    assert driver.calls == [("cuInit", 0), ("cuDeviceGet", 2), ("cuDevicePrimaryCtxRetain", 7)]


def test_a_failing_driver_call_stops_there(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver(fail="cuInit")
    monkeypatch.setattr(early_cuda.ctypes, "CDLL", lambda name: driver)
    assert not early_cuda.retain_primary_context(0)
    assert driver.calls == [("cuInit", 0)]


def test_no_driver_library_is_nothing() -> None:
    assert not early_cuda.retain_primary_context(0, library="libno-such-driver.so.1")


def test_start_runs_once_and_only_for_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(early_cuda, "_thread", None)
    monkeypatch.setattr(early_cuda, "retain_primary_context", seen.append)
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    monkeypatch.setattr(early_cuda.sys.modules["torch"].cuda, "is_initialized", lambda: False)
    assert not early_cuda.start("cpu")
    assert early_cuda.start("cuda:1")
    assert not early_cuda.start("cuda:1")
    early_cuda.join()
    assert seen == [1]
    assert early_cuda.os.environ["CUDA_MODULE_LOADING"] == "LAZY"


def test_start_leaves_an_initialised_torch_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early_cuda, "_thread", None)
    monkeypatch.setattr(early_cuda.sys.modules["torch"].cuda, "is_initialized", lambda: True)
    assert not early_cuda.start("cuda")


@pytest.mark.gpu
def test_gpu_torch_uses_the_context_made_before_it() -> None:
    """In a fresh process: the driver's primary context retained first, then torch's allocations and kernels on
    that device work and the context torch runs in is the one retained."""
    import subprocess
    import sys

    code = (
        "import ctypes\n"
        "from flux_runtime.cli import early_cuda\n"
        "assert early_cuda.retain_primary_context(0)\n"
        "cuda = ctypes.CDLL('libcuda.so.1')\n"
        "dev, retained, current = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()\n"
        "cuda.cuDeviceGet(ctypes.byref(dev), 0)\n"
        "cuda.cuDevicePrimaryCtxRetain(ctypes.byref(retained), dev)\n"
        "import torch\n"
        "x = torch.arange(4.0, device='cuda:0') * 2\n"
        "assert x.tolist() == [0.0, 2.0, 4.0, 6.0]\n"
        "cuda.cuCtxGetCurrent(ctypes.byref(current))\n"
        "assert current.value == retained.value, (current.value, retained.value)\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
