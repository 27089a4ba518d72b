"""The pipeline's side of a parallel run: what rank 0 shares with the others, and which branch each runs.

Rank 0 alone holds the text encoders: it encodes the prompt(s) and broadcasts the `Conditioning`. Every
rank then prepares the start (noise from the seed's CPU generator, image latents through its VAE) and
takes rank 0's latents, so all ranks start from the same tensors; they denoise together
(`flux_runtime.parallel`), hold the same latents after every step, and rank 0 decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from flux_runtime.parallel.cfg import ModelFn, cfg_branches
from flux_runtime.parallel.group import Plan, World, collective
from flux_runtime.parallel.ulysses import SequenceParallel
from flux_runtime.pipeline.state import Conditioning, Start

_FIELDS = ("txt", "vec", "negative_txt", "negative_vec")


def attach(recipe: Any, world: World, transformer: SequenceParallel) -> None:
    """Make `recipe` one rank of `world`, its transformer `transformer` (its own, sequence-parallel)."""
    assert transformer.model is recipe.transformer
    recipe.transformer = transformer
    recipe.parallel = world


def share_conditioning(world: World, cond: Conditioning | None) -> Conditioning:
    """Rank 0's encoded prompts on every rank (`cond` is None on the others)."""
    layout = [None]
    if world.is_main:
        assert cond is not None
        layout = [
            {f: None if (t := getattr(cond, f)) is None else (tuple(t.shape), t.dtype) for f in _FIELDS}
        ]
    (shapes,) = world.broadcast_objects(layout, "sharing the encoded prompt")
    tensors = {}
    for f in _FIELDS:
        if shapes[f] is None:
            tensors[f] = None
            continue
        t = (
            getattr(cond, f)
            if world.is_main
            else torch.empty(*shapes[f][0], dtype=shapes[f][1], device=world.device)
        )
        tensors[f] = world.broadcast(t.contiguous(), "sharing the encoded prompt")
    return Conditioning(**tensors)


def share_start(world: World, start: Start) -> None:
    """Rank 0's starting latents (and conditioning latents) on every rank, in place."""
    for name in ("latents", "reference_tokens", "channel_cond"):
        t: Tensor | None = getattr(start, name)
        if t is not None:
            setattr(start, name, world.broadcast(t.contiguous(), "sharing the starting latents"))


def branches(
    world: World | None, plan: Plan | None, cond: Callable[[], ModelFn], uncond: Callable[[], ModelFn] | None
) -> tuple[ModelFn, ModelFn | None]:
    """`(model_fn, negative_model_fn)` for `denoise`: both built here, or each half of the ranks its own."""
    if world is None or plan is None or plan.branch is None or uncond is None:
        return cond(), None if uncond is None else uncond()
    return cfg_branches(plan, cond, uncond)


def running(world: World | None, plan: Plan | None) -> AbstractContextManager[Any]:
    """The block in which the transformer follows `plan` (nothing outside a parallel run)."""
    if world is None or plan is None:
        return nullcontext()
    return world.running(plan)


def sequence_means(world: World | None) -> Callable[..., list[Tensor]] | None:
    """For a step cache's decision in a parallel run: the means over the whole sequence of tensors of which each
    rank of the running branch holds a slice of the tokens (one all-reduce of their sums and sizes over the
    active plan's sequence group), the same bits on every rank of it, so they skip the same steps and meet in
    the same collectives. None outside a parallel run (the tensors are whole: `Tensor.mean`)."""
    if world is None:
        return None

    def means(*tensors: Tensor) -> list[Tensor]:
        group = world.active.seq
        if group.size == 1:
            return [t.mean() for t in tensors]
        sums = [t.sum(dtype=torch.float64) for t in tensors]
        sizes = [torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device) for t in tensors]
        totals = torch.stack(sums + sizes)
        with collective(world.rank, "the step cache's decision"):
            dist.all_reduce(totals, group=group.pg)
        k = len(tensors)
        return [(totals[i] / totals[k + i]).float() for i in range(k)]

    return means


def share_cache_records(world: World | None, plan: Plan | None, run: Any) -> None:
    """With CFG parallelism each half of the ranks ran one branch: every rank's step-cache record (`run`, a
    `CacheRun`) gets the other half's branch, so rank 0's provenance lists both as one process's does."""
    if world is None or plan is None or plan.branch is None:
        return
    mine = {name: branch.record() for name, branch in run.branches.items()}
    for records in world.gather_objects(mine, "sharing the step caches' records"):
        for name, record in records.items():
            run.adopt(name, record)
