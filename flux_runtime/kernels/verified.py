"""Fused-kernel signatures verified bit-exact on this machine, remembered across processes.

`dispatch` verifies each lossless kernel on the first call of each signature: the kernel and its reference both
run and must agree bit for bit. In a fresh process that check cost about a quarter of a second of the first
denoising step on the H200 (both paths run, and each comparison waits for the GPU), every time, though the answer
cannot change while nothing it depends on does: the kernel's code, the reference's (both in this package's
`kernels/`), torch, CUDA, Triton, the GPU model and its driver. So a passed verification is written down under a
key naming all of those, and a later process on the same machine with the same key takes the kernel at once, as
Triton's disk cache spares it the compilation. A mismatch or a rejected input is never written: it is checked
again, and reported again, in every process.

The record is one file per environment key under `$FLUX_RUNTIME_CACHE` (default `$XDG_CACHE_HOME/flux-runtime`,
else `~/.cache/flux-runtime`), one line per signature (its SHA-256), appended with `O_APPEND` so processes running
together never lose or tear a line; a line of any other length is ignored. `FLUX_VERIFY_CACHE=0` turns it off
(every process verifies), as the test suite does. Only CUDA devices use it: where the fused kernels run on the
CPU (the Triton interpreter), verification stays per process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch

from flux_runtime.kernels.triton_utils import triton

DEVICES = ("cuda",)  # the device types whose passes are remembered
_PLAIN = (bool, int, float, str, type(None))
_lock = threading.Lock()
_known: dict[Path, set[str]] = {}  # each record file's lines, read once per process


def enabled() -> bool:
    """Whether passed verifications are remembered (`FLUX_VERIFY_CACHE`, default on; 0 turns it off)."""
    return os.environ.get("FLUX_VERIFY_CACHE", "1") != "0"


def cache_dir() -> Path:
    """Where the records live: `$FLUX_RUNTIME_CACHE`, else `$XDG_CACHE_HOME/flux-runtime`, else
    `~/.cache/flux-runtime`."""
    root = os.environ.get("FLUX_RUNTIME_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "flux-runtime"


@functools.cache
def _kernel_sources() -> str:
    """SHA-256 of every module of `flux_runtime.kernels` (the kernels and the references they are checked
    against): any edit there starts a new record."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def environment(device: torch.device) -> str:
    """The key of everything a verification's outcome depends on besides the signature, for `device`'s GPU."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _environment(index)


@functools.cache
def _environment(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
    parts = [
        _kernel_sources(), torch.__version__, torch.version.cuda,
        getattr(triton, "__version__", None), props.name, f"{props.major}.{props.minor}", driver,
    ]  # fmt: skip
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def line_of(sig: tuple[Any, ...]) -> str | None:
    """The record line of a dispatch signature (its SHA-256), or None when a part of it is not plain data
    (an object whose text would not name it in another process): such a signature is verified every time."""
    parts: list[Any] = []
    for part in sig:
        if isinstance(part, tuple) and len(part) == 5 and isinstance(part[3], torch.device):
            shape, stride, dtype, device, align = part  # a tensor's, from `dispatch._signature`
            parts.append([list(shape), list(stride), str(dtype), device.type, align])
        elif isinstance(part, _PLAIN) or (
            isinstance(part, tuple) and all(isinstance(p, _PLAIN) for p in part)
        ):
            parts.append(repr(part))
        else:
            return None
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _record_file(device: torch.device) -> Path:
    return cache_dir() / f"verified-{environment(device)}.txt"


def _lines(path: Path) -> set[str]:
    """The record's lines (read once per process; this process's own additions are kept in memory too)."""
    with _lock:
        known = _known.get(path)
        if known is None:
            try:
                text = path.read_text(encoding="ascii", errors="replace")
            except OSError:
                text = ""
            known = _known[path] = {line for line in text.split("\n") if len(line) == 64}
        return known


def was_verified(sig: tuple[Any, ...], device: torch.device) -> bool:
    """Whether an earlier process with this environment verified `sig` on this kind of GPU."""
    if device.type not in DEVICES or not enabled():
        return False
    line = line_of(sig)
    return line is not None and line in _lines(_record_file(device))


def remember(sig: tuple[Any, ...], device: torch.device) -> None:
    """Write down that `sig` passed on `device` (best effort: a cache that cannot be written is skipped)."""
    if device.type not in DEVICES or not enabled():
        return
    line = line_of(sig)
    if line is None:
        return
    path = _record_file(device)
    known = _lines(path)
    if line in known:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode("ascii"))  # one short write: appended whole, never interleaved
        finally:
            os.close(fd)
    except OSError:
        return
    with _lock:
        known.add(line)


def forget() -> None:
    """Drop what this process read of the records (they are read again on next use)."""
    with _lock:
        _known.clear()
