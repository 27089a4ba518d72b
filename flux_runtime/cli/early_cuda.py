"""The GPU's CUDA context made on a side thread while `flux-gen` imports torch.

A fresh process pays for the CUDA context (driver initialisation, the device's primary context) the first time
torch touches the GPU: 0.34 s on the H200, after torch's import (3.5 s there) and before the first weight can be
copied. The driver does not need torch for this: `start(device)` calls it through `ctypes` on a daemon thread as
the command begins (a foreign call lets go of the GIL, so the import goes on beside it) and retains the device's
primary context, the one torch's runtime then finds already made and uses.

It does the same as torch would, earlier, for the one device the command runs on; it changes nothing that runs
on it. Where the driver library is missing, the device is not a CUDA one, or any driver call fails, it does
nothing and torch makes the context as before. `CUDA_MODULE_LOADING=LAZY` (torch's own setting, which torch sets
before it initialises the driver) is set first, as the driver reads it when it initialises.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading

_DEVICE = re.compile(r"^cuda(?::(\d+))?$")

_thread: threading.Thread | None = None


def ordinal(device: str | None) -> int | None:
    """The CUDA ordinal a `--device` value names (None or "cuda": 0), or None when it names no CUDA device."""
    if device is None:
        return 0
    match = _DEVICE.match(device.strip())
    return None if match is None else int(match.group(1) or 0)


def start(device: str | None) -> bool:
    """Retain the primary CUDA context of `device` (a `--device` value) on a daemon thread, once per process, on
    Linux and before torch has initialised CUDA; returns whether a thread was started."""
    global _thread
    index = ordinal(device)
    if index is None or _thread is not None or not sys.platform.startswith("linux"):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    _thread = threading.Thread(
        target=retain_primary_context, args=(index,), name="flux-cuda-context", daemon=True
    )
    _thread.start()
    return True


def retain_primary_context(index: int, library: str = "libcuda.so.1") -> bool:
    """Initialise the driver and retain device `index`'s primary context; False (and nothing kept) where the
    library cannot be opened or a call fails."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError:
        return False
    device, context = ctypes.c_int(), ctypes.c_void_p()
    return (
        cuda.cuInit(0) == 0
        and cuda.cuDeviceGet(ctypes.byref(device), index) == 0
        and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
    )


def started() -> bool:
    """Whether `start` began the context: one process, on a CUDA device, on Linux."""
    return _thread is not None


def join() -> None:
    """Wait for `start`'s thread, if one runs."""
    if _thread is not None:
        _thread.join()
