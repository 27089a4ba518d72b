"""Start a real `flux-serve` process on 127.0.0.1 (a free port) for the tests, and stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """A `python -m flux_runtime.serve` child process; `url` is its base address."""

    def __init__(
        self,
        *args: str,
        store: Path,
        env: dict[str, str] | None = None,
        own_pid: bool = True,
        start_s: float = 90,
    ) -> None:
        """`own_pid`: /health names this process (not so under Ray, where a replica answers)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # this checkout first, then whatever the caller's path holds (the device's private site of the serve wheels)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flux_runtime.serve",
                "--port",
                str(self.port),
                "--store-dir",
                str(store),
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flux-serve exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=1)
                if health.status_code == 200:
                    # the process started here, not another that took the same port first
                    assert not own_pid or health.json()["pid"] == self.proc.pid, (
                        f"{self.url} is another server"
                    )
                    if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                        return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"flux-serve was not ready within {start_s:.0f} s")

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        """The value of one sample line of /metrics (`name` with its labels), 0 when absent."""
        for line in httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_metric(self, name: str, value: float, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.metric(name) != value:
            assert time.monotonic() < deadline, f"{name} never became {value} (is {self.metric(name)})"
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
