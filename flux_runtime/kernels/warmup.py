"""A process's one-time Triton start-up cost, paid on a side thread while the weights load.

Before Triton can look up any kernel, even one its disk cache holds, it names its cache by hashing its own
compiler sources and its libtriton library (hundreds of MB), once per process. In a fresh `flux-gen` on the
H200 that was 0.38 s inside the first denoising step, after the weights had loaded. `start(device)` computes
that key on a daemon thread as the load begins: the load is file reads and copies to the GPU, `hashlib` lets go
of the GIL on large buffers, so the two overlap. `finish()` (at the start of a pipeline call) waits for the thread,
so that Triton never computes the key a second time beside it.

Nothing here changes which kernels run or their bits: only when a cost is paid. On a machine without a CUDA device
or Triton, or with a Triton that names its key otherwise, `start` does nothing and the key is computed where Triton
first needs it, as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from flux_runtime.kernels.triton_utils import ON_GPU, triton

_thread: threading.Thread | None = None
_lock = threading.Lock()


def triton_key_function() -> Callable[[], str] | None:
    """Triton's per-process cache key function (cached by Triton after its first call), or None where this
    Triton has none under that name."""
    if triton is None:
        return None
    try:
        from triton.runtime import cache
    except ImportError:
        return None
    key = getattr(cache, "triton_key", None)
    return key if callable(key) else None


def start(device: torch.device) -> bool:
    """Begin computing Triton's cache key on a daemon thread when `device` is a CUDA device the fused kernels
    will run on; once per process. Returns whether a thread was started by this call."""
    global _thread
    if device.type != "cuda" or not ON_GPU:
        return False
    key = triton_key_function()
    if key is None:
        return False
    with _lock:
        if _thread is not None:
            return False
        _thread = threading.Thread(target=_compute, args=(key,), name="flux-triton-key", daemon=True)
        _thread.start()
    return True


def _compute(key: Callable[[], str]) -> None:
    # an error here is Triton's to raise again where it needs the key, on the main thread
    with contextlib.suppress(Exception):
        key()


def finish() -> None:
    """Wait for `start`'s thread, if one runs (a no-op afterwards)."""
    thread = _thread
    if thread is not None and thread.is_alive():
        thread.join()
