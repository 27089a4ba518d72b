"""`flux-gen --timings`: where a run's time went, stage by stage, and its peak memory, in one line.

The stages are the ones a user waits through: importing the libraries, loading the weights, each image's
call, split into its text encoding, preparation, first denoising step, other steps and decoding (`stage`),
writing the PNGs. The line also gives the time from the process's
start to `main` (the interpreter and the command's own imports) when the platform says when it started, and
the peaks of host RSS and of GPU memory.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def _process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where that is not known."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
        ticks = os.sysconf("SC_CLK_TCK")
        uptime = float(open("/proc/uptime").read().split()[0])  # noqa: SIM115
        return uptime - int(fields[19]) / ticks
    except (OSError, ValueError, IndexError):
        return None


class Stopwatch:
    """Laps of named stages (a repeated name adds up), read out as one line."""

    def __init__(self) -> None:
        self.before_main = _process_age()
        self.start = time.perf_counter()
        self.laps: dict[str, float] = {}
        self._mark: float | None = None  # the last `stage` event's time

    @contextmanager
    def lap(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.laps[name] = self.laps.get(name, 0.0) + time.perf_counter() - t0

    def stage(self, stage: str, done: int, total: int) -> None:
        """A pipeline call's progress event (`progress=`): its text encoding, preparation (noise, input images),
        first denoising step, other steps and decoding each add to the lap of that name, timed with the GPU's
        work done (a wait at each of those six events, none inside the loop)."""
        if (stage, done) == ("encode", 0):
            lap = None  # the call begins
        elif stage == "denoise" and done == 1:
            lap = "first step"
        elif stage == "denoise" and done == total:
            lap = "other steps"
        else:
            lap = {("encode", 1): "encode", ("denoise", 0): "prepare", ("decode", 1): "decode"}.get(
                (stage, done)
            )
            if lap is None:
                return
        self._sync()
        now = time.perf_counter()
        if lap is not None and self._mark is not None:
            self.laps[lap] = self.laps.get(lap, 0.0) + now - self._mark
        self._mark = now

    @staticmethod
    def _sync() -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def line(self) -> str:
        """`start-up 0.4 s, imports 2.1 s, load 2.8 s, image 1 4.0 s, save 0.2 s, total 9.5 s; peak host RSS ...`."""
        total = time.perf_counter() - self.start
        parts = [] if self.before_main is None else [f"start-up {self.before_main:.2f} s"]
        parts += [f"{name} {seconds:.2f} s" for name, seconds in self.laps.items()]
        parts.append(f"total {total + (self.before_main or 0.0):.2f} s")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
            2**20 if sys.platform != "darwin" else 2**30
        )
        peaks = [f"peak host RSS {rss:.2f} GiB"]
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            peaks.append(f"peak GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        return "timings: " + ", ".join(parts) + "; " + ", ".join(peaks)
