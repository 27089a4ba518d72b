"""Shared pieces of the tiny random-model fixtures: a seeded diffusers model with every parameter moved off
its initial value, and its files in the diffusers and BFL layouts.

The family fixture modules (`flux{1,2,3}_fixtures`, `weights/vae_fixtures`) give the shapes and rule tables;
the seeds and the order of the random draws live here once, so every family's tiny model is drawn alike.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save_file


def jiggle(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Move every parameter by 0.05 * N(0, 1) from `gen`, so no weight keeps its constant init (norms)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def randomised(cls: Any, seed: int, **kw: Any) -> Any:
    """`cls(**kw)` built under `torch.manual_seed(seed)`, then jiggled from a generator seeded `seed + 1`; eval mode."""
    torch.manual_seed(seed)
    model = cls(**kw)
    jiggle(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def save_diffusers(model: Any, folder: Path) -> Path:
    """Write `model` as diffusers does (`config.json` and safetensors) into `folder`."""
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def bfl_transformer_state_dict(
    model: Any, layout: ModuleType, flag: str, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """A diffusers transformer's weights under BFL keys, converted by `layout`'s rule table.

    `flag` names the config field that is the table's third argument (`guidance_embeds`, `flow_map`).
    """
    sd = model.state_dict()
    cfg = model.config
    table = layout.rules(cfg.num_layers, cfg.num_single_layers, getattr(cfg, flag))
    return {prefix + r.bfl: layout.diffusers_to_bfl(r, sd.__getitem__).contiguous() for r in table}


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    """Write `tensors` as one safetensors file at `path`."""
    save_file(tensors, str(path))
    return path
