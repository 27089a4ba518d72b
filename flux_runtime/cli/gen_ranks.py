"""`flux-gen --gpus N`: this process as one rank of a parallel run, or the supervisor that starts N of them.

`--gpus N` checks what needs no model and fetches what the cache lacks once, then runs the command again as N
ranks (`parallel.launch`); under torchrun each process is a rank already. A failed run says one message, not
one per rank (`rank_errors`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from flux_runtime.cli.gen_download import fetch
from flux_runtime.cli.gen_run import plan


def launched_rank(opts: dict[str, Any]) -> int | None:
    """This process's rank when it is one of a parallel run (torchrun, or `--gpus` starting it), else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if opts["gpus"] is None:
        opts["gpus"] = world
    elif opts["gpus"] != world:
        raise click.ClickException(f"--gpus {opts['gpus']}, but this run was started with {world} ranks")
    return int(os.environ["RANK"]) if world > 1 else None


def spawn_ranks(opts: dict[str, Any]) -> None:
    """Check what needs no model, then run this command as --gpus ranks and exit with the run's status."""
    from flux_runtime.parallel.launch import relaunch_command, supervise

    plan(opts, main_rank=True)
    fetch(opts)  # once, here: the ranks read the cache
    status = supervise(relaunch_command(), opts["gpus"], say=lambda m: click.echo(f"flux-gen: {m}", err=True))
    sys.exit(status)


@contextmanager
def rank_errors(rank: int | None, debug: bool) -> Iterator[None]:
    """One message per failed run, not one per rank: rank 0 alone reports the errors every rank meets (bad
    input, files); a rank that only lost its peers leaves the report to the `--gpus` supervisor (exit
    LOST_PEER); any other error is reported by the rank it happened on, naming it."""
    if rank is None or debug:
        yield
        return
    from flux_runtime.cli.errors import is_foreseen, one_line
    from flux_runtime.parallel.launch import LOST_PEER, is_supervised

    try:
        yield
    except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, KeyboardInterrupt):
        if rank == 0:
            raise
        sys.exit(1)
    except Exception as e:
        lost = type(e).__name__ == "LostRank"
        if lost and is_supervised():
            sys.exit(LOST_PEER)
        if rank != 0 and (is_foreseen(e) or lost):
            sys.exit(1)
        raise click.ClickException(one_line(e) if rank == 0 else f"rank {rank}: {one_line(e)}") from None
