"""Run a function on n CPU processes joined by gloo, as `torchrun` would start them, and collect results."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, n: int, port: int, target: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(1)  # the CI machine has 2 cores for all ranks
    try:
        results.put((rank, "ok", target(rank, n, *args)))
    except BaseException as e:  # reported to the test, which fails naming the rank
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    n: int, target: Callable[..., Any], *args: Any, timeout: float = 180.0, allow_dead: bool = False
) -> list[Any]:
    """`target(rank, n, *args)` on n spawned processes; their results in rank order.

    A rank that raises fails the call with its traceback; with `allow_dead`, a rank that ends without a
    result (killed) gives None instead.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, n, port, target, args, results)) for r in range(n)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n:
            try:
                rank, status, value = results.get(timeout=0.2)
                got[rank] = (status, value)
                continue
            except queue.Empty:
                pass
            if allow_dead and all(not p.is_alive() for r, p in enumerate(procs) if r not in got):
                while not results.empty():  # a result sent just before its rank ended
                    rank, status, value = results.get(timeout=1)
                    got[rank] = (status, value)
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(n)) - set(got))
                raise TimeoutError(f"ranks {missing} gave no result in {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(got.items()) if s == "error"]
    assert not errors, "\n".join(errors)
    return [got[r][1] if r in got else None for r in range(n)]
