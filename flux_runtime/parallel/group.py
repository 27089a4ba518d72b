"""The process group of a parallel run: who this rank is, its device, the groups it shares work in.

One image is spread over `world_size` processes, one per GPU (NCCL), or one per CPU process (gloo, for
tests), joined by `torch.distributed`. The processes are started by `torchrun` or by `flux-gen --gpus N`
(`flux_runtime.parallel.launch`), which both set `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
`MASTER_PORT`. Every collective runs under the group's timeout, and each collective of this package
turns a failure (a rank that died, or stopped answering for `timeout_s`) into one `ParallelError`.

With `cfg=True` and an even world the ranks also form two halves, `[0, n/2)` for the conditional and
`[n/2, n)` for the unconditional branch of classifier-free guidance, and `n/2` pairs `{i, i + n/2}` that
swap their predictions once per step (`flux_runtime.parallel.cfg`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from flux_runtime.parallel.launch import NO_MULTICAST_ENV

log = logging.getLogger(__name__)

LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ParallelError(RuntimeError):
    """A parallel run cannot start (setup, a split the model cannot take) or go on, said in one line."""


class LostRank(ParallelError):
    """A collective failed: another rank died or did not answer within the timeout."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How one generation is spread over processes (`Pipeline.from_pretrained(..., parallel=...)`).

    `world_size`: processes (GPUs) in the run, all running the same program. `cfg`: when a call runs
    classifier-free guidance (FLUX.1 true CFG, FLUX.2 [klein] base), run its conditional and
    unconditional passes on two halves of the ranks, each half splitting the sequence (Ulysses) over
    its `world_size / 2` ranks; otherwise, and for calls without CFG, all ranks split the sequence.
    `timeout_s`: how long any collective may wait for another rank before the run ends with an error
    (loading the weights happens before the first one, so it also bounds how far apart the ranks load).
    """

    world_size: int
    cfg: bool = True
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ParallelError(f"parallel world_size must be a positive int, got {self.world_size!r}")
        if not self.timeout_s > 0:
            raise ParallelError(f"parallel timeout_s must be > 0, got {self.timeout_s!r}")


def as_config(parallel: ParallelConfig | int) -> ParallelConfig:
    """`parallel=N` is `ParallelConfig(world_size=N)`."""
    if isinstance(parallel, ParallelConfig):
        return parallel
    if isinstance(parallel, bool) or not isinstance(parallel, int):
        raise ParallelError(
            f"parallel must be a number of processes or a ParallelConfig, got {type(parallel).__name__}"
        )
    return ParallelConfig(world_size=parallel)


@dataclass(frozen=True)
class Group:
    """A set of ranks working on one thing: the torch process group (None = the default), its size and
    this process's rank in it."""

    pg: dist.ProcessGroup | None
    size: int
    rank: int


class World:
    """This process's place in a parallel run; made once per process by `join` (the groups are fixed)."""

    def __init__(self, config: ParallelConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.all = Group(None, self.size, self.rank)
        # `new_group` is collective: every rank makes the same groups in the same order
        self.halves: tuple[Group, Group] | None = None
        self.pair: Group | None = None
        if config.cfg and self.size % 2 == 0:
            half = self.size // 2
            pgs = [dist.new_group(list(range(i * half, (i + 1) * half))) for i in range(2)]
            mine = self.rank // half
            self.halves = tuple(Group(pg, half, self.rank % half) for pg in pgs)  # type: ignore[assignment]
            pairs = [dist.new_group([i, i + half]) for i in range(half)]
            self.pair = Group(pairs[self.rank % half], 2, mine)
        self._active: Plan | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0 encodes the prompts, decodes and writes the image."""
        return self.rank == 0

    def plan(self, cfg: bool) -> Plan:
        """The work split for a call: with CFG (and cfg parallelism) each half runs one branch."""
        if cfg and self.halves is not None:
            assert self.pair is not None
            branch = self.rank // (self.size // 2)
            return Plan(seq=self.halves[branch], branch=branch, pair=self.pair)
        return Plan(seq=self.all, branch=None, pair=None)

    def record(self, plan: Plan) -> dict[str, int | bool]:
        """What the provenance says of a call's split."""
        return {
            "world_size": self.size,
            "sequence_parallel": plan.seq.size,
            "cfg_parallel": plan.branch is not None,
        }

    @contextmanager
    def running(self, plan: Plan) -> Iterator[Plan]:
        """Make `plan` the one the sequence-parallel transformer follows while the block runs."""
        previous, self._active = self._active, plan
        try:
            yield plan
        finally:
            self._active = previous

    @property
    def active(self) -> Plan:
        """The plan of the call under way (all ranks split the sequence outside a call)."""
        return self._active if self._active is not None else Plan(seq=self.all, branch=None, pair=None)

    # ------------------------------------------------------------------ collectives with one clear error
    def broadcast(self, t: Tensor, what: str) -> Tensor:
        """`t` from rank 0 to every rank, in place (same shape and dtype on every rank)."""
        with collective(self.rank, what):
            dist.broadcast(t, src=0)
        return t

    def broadcast_objects(self, objs: list, what: str) -> list:
        """Small picklable values from rank 0 (shapes, dtypes), in place."""
        with collective(self.rank, what):
            dist.broadcast_object_list(objs, src=0)
        return objs

    def gather_objects(self, obj: Any, what: str) -> list:
        """A small picklable value from every rank, in rank order, on every rank."""
        out: list = [None] * self.size
        with collective(self.rank, what):
            dist.all_gather_object(out, obj)
        return out

    def barrier(self, what: str) -> None:
        with collective(self.rank, what):
            dist.barrier()


@dataclass(frozen=True)
class Plan:
    """One call's split: `seq` shares the tokens (Ulysses); `branch` 0 / 1 = conditional / unconditional
    (None: no CFG split); `pair` swaps the two branches' predictions."""

    seq: Group
    branch: int | None
    pair: Group | None


@contextmanager
def collective(rank: int, what: str) -> Iterator[None]:
    """Turn a failed collective (a rank died, or none answered within the timeout) into one `LostRank`."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LostRank(
            f"rank {rank}: another rank of the parallel run stopped answering during {what} "
            f"(it died, or took longer than the timeout); the run is stopped ({first[:200]})"
        ) from e


def launched_world_size() -> int | None:
    """WORLD_SIZE when this process was started as one rank of a run (torchrun, flux-gen --gpus), else None."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value is not None and value.isdigit() else None


def join(config: ParallelConfig, device: torch.device) -> tuple[World, torch.device]:
    """Join (or reuse) the process group and return this rank's `World` and device.

    `device` is the device type the user asked for: `cuda` becomes `cuda:LOCAL_RANK` (NCCL), `cpu` stays
    (gloo). A process group made by the caller is used as it is, if its size is `config.world_size`.
    """
    n = config.world_size
    if device.type == "cuda" and device.index is not None and n > 1:
        raise ParallelError(
            f"device {device} in a parallel run: pass device='cuda'; each rank takes cuda:LOCAL_RANK"
        )
    if device.type not in ("cuda", "cpu"):
        raise ParallelError(f"parallel runs use CUDA GPUs (NCCL) or CPU processes (gloo), not {device.type}")
    if not dist.is_initialized():
        missing = [k for k in LAUNCH_ENV if k not in os.environ]
        if missing:
            raise ParallelError(
                f"parallel={n} needs {n} processes started together: run under `torchrun "
                f"--nproc-per-node {n}` or use `flux-gen --gpus {n}` ({', '.join(missing)} not set)"
            )
        if launched_world_size() != n:
            raise ParallelError(
                f"parallel={n}, but this run was started with {os.environ['WORLD_SIZE']} processes "
                f"(WORLD_SIZE); start {n}, or pass parallel={os.environ['WORLD_SIZE']}"
            )
        if device.type == "cuda":
            local = int(os.environ["LOCAL_RANK"])
            if local >= torch.cuda.device_count():
                raise ParallelError(
                    f"rank with LOCAL_RANK {local} has no GPU: {torch.cuda.device_count()} visible; "
                    f"start at most {torch.cuda.device_count()} processes on this host"
                )
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
            for key, value in NO_MULTICAST_ENV.items():
                if os.environ.get(key, value) != value:
                    log.warning(
                        "%s=%s overridden to %s: NVLink multicast stays off", key, os.environ[key], value
                    )
                os.environ[key] = value
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=config.timeout_s)
        with collective(int(os.environ["RANK"]), "process-group setup"):
            if device.type == "cuda":
                dist.init_process_group(backend, timeout=timeout, device_id=device)
            else:
                dist.init_process_group(backend, timeout=timeout)
    elif dist.get_world_size() != n:
        raise ParallelError(
            f"parallel={n}, but the process group already made has {dist.get_world_size()} ranks"
        )
    elif device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    with collective(dist.get_rank(), "process-group setup"):
        return World(config, device), device
