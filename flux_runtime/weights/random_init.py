"""Deterministic random weights: the built-in `tiny` model and benchmarks with no checkpoint."""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def init_random(
    model: nn.Module, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Give every parameter of `model` (possibly on meta) seeded values, the same on every machine.

    Matrices get `U(-1/sqrt(fan_in), 1/sqrt(fan_in))` like `nn.Linear`; vectors (biases, norm
    scales) get values near their usual init so activations stay in a sane range. Values are drawn
    on the CPU in fp32, then moved, so a seed gives the same weights on any device and dtype.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in list(model.named_parameters()):
        shape = param.shape
        if len(shape) >= 2:
            bound = 1.0 / math.sqrt(shape[1])
            value = (torch.rand(shape, generator=gen) * 2 - 1) * bound
        elif name.endswith(("scale", "norm.weight")) or (".norm" in name and name.endswith("weight")):
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            value = 0.02 * torch.randn(shape, generator=gen)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False))
    return model
