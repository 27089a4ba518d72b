"""CFG parallelism: the conditional and unconditional passes of a step on two halves of the ranks.

`denoise` asks for the conditional prediction, then for the unconditional one, and combines them once
per step (`neg + scale * (pos - neg)`). Here the first half of the ranks runs only the conditional pass
and the second half only the unconditional one (each half splitting the sequence among itself, when it
has several ranks); rank i and rank i + n/2 then swap their predictions in one all-gather, so every rank
holds both and computes the same combination. Each pass is the forward one process would run, so CFG
parallelism alone changes no bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from flux_runtime.parallel.group import Plan, collective

ModelFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]


def cfg_branches(
    plan: Plan, cond: Callable[[], ModelFn], uncond: Callable[[], ModelFn]
) -> tuple[ModelFn, ModelFn]:
    """`(model_fn, negative_model_fn)` for `denoise` when `plan` splits CFG over the two halves.

    `cond` / `uncond` build a branch's denoiser; only this rank's branch is built (and run). The first call
    of a step runs it and swaps with the partner rank; the second returns the partner's prediction.
    """
    assert plan.branch is not None and plan.pair is not None
    mine = (cond if plan.branch == 0 else uncond)()
    pair = plan.pair
    swapped: list[Tensor] = []

    def conditional(x: Tensor, t: Tensor, g: Tensor | None) -> Tensor:
        pred = mine(x, t, g).contiguous()
        both = [torch.empty_like(pred) for _ in range(2)]
        with collective(dist.get_rank(), "the CFG exchange"):
            dist.all_gather(both, pred, group=pair.pg)
        swapped.append(both[1])
        return both[0]

    def unconditional(x: Tensor, t: Tensor, g: Tensor | None) -> Tensor:
        assert swapped, "the unconditional prediction is asked for after the conditional one"
        return swapped.pop()

    return conditional, unconditional
