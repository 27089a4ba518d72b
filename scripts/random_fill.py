"""Random weights for full-size models built on the meta device, filled where they will run.

The benches that need a model too large to draw on the CPU first (FLUX.2-dev, Mistral Small 3.1, T5-XXL) build
it on meta and fill it here: N(0, 1/fan_in) matrices, unit norms and scales, N(0, 0.02) other vectors. Only
timings and memory come out of such a model, never parity, so the init needs only to be cheap and sane.
"""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def fill_module(
    module: nn.Module,
    device: torch.device,
    gen: torch.Generator | None,
    *,
    position_buffers: bool,
    prefix: str = "",
    recurse: bool = True,
) -> None:
    """Materialise `module`'s meta tensors on `device` (in their dtype) with random values from `gen`.

    Floating buffers become 0 (1 for variances). `position_buffers` treats the buffers computed at
    construction as such: CLIP's `position_ids` get their arange back and rotary `inv_freq` buffers are left
    as they are, for the caller to recompute; without it they are filled like any other buffer. `prefix` and
    `recurse` as in `named_parameters` (a caller filling a model part by part).
    """
    module.to_empty(device=device, recurse=recurse)
    for name, p in module.named_parameters(prefix=prefix, recurse=recurse):
        if p.ndim >= 2:
            p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=gen)
        elif "norm" in name or name.endswith(("scale", "running_var")):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for name, b in module.named_buffers(prefix=prefix, recurse=recurse):
        if position_buffers and name.endswith("position_ids"):  # CLIP's (1, 77) arange
            b.copy_(torch.arange(b.shape[-1], device=device).expand_as(b))
        elif b.is_floating_point() and not (position_buffers and "inv_freq" in name):
            b.fill_(1.0 if "var" in name else 0.0)
