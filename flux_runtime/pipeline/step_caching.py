"""Step caching in a pipeline call: the policy checked once, one cache per sampling branch, the record.

The policies are `flux_runtime.sampling.step_cache`'s; here a call's policy (the call's `cache=`, else the
pipeline's) is checked against the model before any work, each branch's transformer calls run with that
branch's cache hooked into the transformer, and the provenance gets the policy and the steps that ran in full.
A skipped step is a host decision between two different amounts of work, which one recorded CUDA graph cannot
replay: with CUDA graphs, a cached branch runs as `pipeline.cached_graphs.SplitGraphs` (the probe, then the
rest or the reuse, each a graph), eagerly otherwise.

In a parallel run each rank's transformer sees a slice of the tokens: the branch's decision then reads the
whole image's means through `means` (an all-reduce over the branch's ranks), so its ranks skip together; with
CFG parallelism each half runs one branch, and `adopt` brings the other half's record into this rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from flux_runtime.pipeline.errors import FluxError
from flux_runtime.sampling.step_cache import (
    BranchCache,
    CachePolicy,
    CacheSpecError,
    Means,
    cache_record,
    parse_cache,
)

Velocity = Callable[[Tensor, Tensor, Tensor | None], Tensor]


def as_policy(spec: str | CachePolicy | None) -> CachePolicy | None:
    """The policy a `cache=` argument names (None: no cache), a bad spec as one FluxError."""
    try:
        return parse_cache(spec)
    except CacheSpecError as e:
        raise FluxError(str(e)) from None


def check_policy(policy: CachePolicy, transformer: Any, model_name: str) -> None:
    """A FluxError unless `policy` can run on this model: its probe must leave blocks for the rest."""
    most = getattr(transformer, "max_probe_blocks", None)
    if most is None:
        raise FluxError(f"{model_name}'s transformer has no step-cache probe: drop cache= (--cache)")
    if policy.probe > most:
        raise FluxError(
            f"cache probe={policy.probe} is deeper than {model_name}'s {most} probe-able blocks: give probe=1..{most}"
        )


class CacheRun:
    """One call's step caches, one per sampling branch ("cond", "uncond"), each over `steps` transformer calls."""

    def __init__(self, policy: CachePolicy, transformer: Any, steps: int, means: Means | None = None) -> None:
        self.policy, self.transformer, self.steps, self.means = policy, transformer, steps, means
        self.branches: dict[str, BranchCache | SharedBranch] = {}

    def cache(self, name: str) -> BranchCache:
        """Branch `name`'s cache (made on first use)."""
        if name not in self.branches:
            self.branches[name] = self.policy.start(self.steps, self.means)
        cache = self.branches[name]
        assert isinstance(cache, BranchCache), f"branch {name} ran on another rank"
        return cache

    def wrap(self, name: str, velocity: Velocity) -> Velocity:
        """`velocity` with branch `name`'s cache hooked into the transformer for each of its calls."""
        cache = self.cache(name)
        transformer = self.transformer

        def cached(x: Tensor, t: Tensor, gd: Tensor | None) -> Tensor:
            transformer.step_hook = cache
            try:
                return velocity(x, t, gd)
            finally:
                transformer.step_hook = None

        return cached

    def adopt(self, name: str, record: dict[str, Any]) -> None:
        """The record of branch `name` where another rank ran it (CFG parallelism), for this rank's provenance."""
        if name not in self.branches:
            self.branches[name] = SharedBranch(record)

    def record(self) -> dict[str, Any]:
        ordered = dict(sorted(self.branches.items(), key=lambda item: BRANCHES.index(item[0])))
        return cache_record(self.policy, ordered)


BRANCHES = ("cond", "uncond")  # the sampling branches, in the order a record lists them


@dataclass
class SharedBranch:
    """A branch another rank of a parallel run ran: its `BranchCache.record` as that rank made it."""

    recorded: dict[str, Any]

    def record(self) -> dict[str, Any]:
        return self.recorded
