"""`flux-gen --gpus N`: start N ranks of the same command and end them all when one fails, with one message.

Each rank is a child process running the command again with the rendezvous variables `torchrun` would set
(`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` on a free local port), NVLink multicast
off, and `FLUX_PARALLEL_SUPERVISED=1`. A rank that only lost contact with another one exits with
`LOST_PEER` and says nothing (the supervisor names the cause); a rank that failed for its own reason
prints its one line. When any rank fails, the supervisor stops the others (at once for a rank that was killed;
after up to 10 s for one that exited, so that rank 0 can print the error every rank met) with SIGTERM, then
SIGKILL, and, when the failing rank could not say why (killed, or crashed), says it in one line.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

# NVLink multicast (NVLS) stays off: on shared hosts a program using it can take the GPUs out of service.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
LOST_PEER = 75  # exit status of a rank that stopped because another one did
SUPERVISED_ENV = "FLUX_PARALLEL_SUPERVISED"
_GRACE_S = 10.0


def is_supervised() -> bool:
    """Whether this process is a rank started by `supervise` (it then leaves lost-peer reports to it)."""
    return os.environ.get(SUPERVISED_ENV) == "1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of rank `rank` of a local run of `world_size` ranks."""
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST_ENV, **{SUPERVISED_ENV: "1"},
    )  # fmt: skip
    return env


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def supervise(
    command: Sequence[str], world_size: int, *, say: Callable[[str], None], poll_s: float = 0.05
) -> int:
    """Run `command` as ranks 0..world_size-1 and wait; returns the exit status for the whole run.

    0 when every rank succeeds. When one fails, the others are stopped and 1 is returned, after `say`
    has been given one line for a rank that died without a message of its own.
    """
    port = _free_port()
    procs = [subprocess.Popen(list(command), env=rank_env(r, world_size, port)) for r in range(world_size)]
    stopped: set[int] = set()  # ranks we ended ourselves
    failed: list[tuple[int, int]] = []  # (rank, status) in the order seen
    try:
        while any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):
                status = p.poll()
                if status not in (None, 0) and r not in stopped and all(r != f for f, _ in failed):
                    failed.append((r, status))
            if failed:
                if failed[0][1] >= 0:  # it exited: the others may be about to report the same error
                    _wait_all(procs, _GRACE_S)
                _stop([p for p in procs if p.poll() is None], stopped, procs)
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop([p for p in procs if p.poll() is None], stopped, procs)
        raise
    for r, p in enumerate(procs):
        status = p.wait()
        if status != 0 and r not in stopped and all(r != f for f, _ in failed):
            failed.append((r, status))
    if not failed:
        return 0
    # the cause: the first rank that failed for its own reason, not one that only lost its peers
    own = [(r, s) for r, s in failed if s != LOST_PEER]
    if not own:
        say("the ranks lost contact with each other (a collective timed out); the run is stopped")
        return 1
    rank, status = own[0]
    if status < 0 or status != 1:  # status 1: the rank printed its own error line
        say(f"rank {rank} of {world_size} {_describe(status)}; the other ranks were stopped")
    return 1


def _wait_all(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _stop(alive: list[subprocess.Popen], stopped: set[int], procs: list[subprocess.Popen]) -> None:
    """SIGTERM the ranks still running, SIGKILL those still there after a grace period."""
    for p in alive:
        stopped.add(procs.index(p))
        p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in alive:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def relaunch_command() -> list[str]:
    """This flux-gen command line, to run again as each rank."""
    return [sys.executable, "-m", "flux_runtime.cli.gen", *sys.argv[1:]]
