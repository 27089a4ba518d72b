"""Tiny random FLUX.1 ControlNets written by diffusers (InstantX, union, XLabs shapes), and the XLabs single-file
twin of a diffusers one."""

from __future__ import annotations

from pathlib import Path

from flux_runtime.weights import controlnet as controlnet_layout
from flux_runtime.weights import flux1_layout
from flux_runtime.weights.controlnet import ControlNetConfig
from tests.flux1_fixtures import TINY_KW
from tests.random_models import randomised, save_tensors

KINDS = {
    # InstantX / Shakker shape: double and single blocks, latents in
    "instantx": dict(num_layers=2, num_single_layers=2),
    # union: a mode embedding (Shakker Union Pro has no single blocks)
    "union": dict(num_layers=2, num_single_layers=0, num_mode=3),
    # XLabs: one double block repeated over the base model's, pixels in through the hint encoder
    "xlabs": dict(num_layers=1, num_single_layers=0, conditioning_embedding_channels=16, patch_size=2),
}


def make_diffusers_controlnet(kind: str, guidance: bool = True, seed: int = 5, **overrides):
    """A tiny `FluxControlNetModel` of `kind` with every parameter (the zero-initialised ones too) randomised."""
    from diffusers import FluxControlNetModel

    kw = {**TINY_KW, **KINDS[kind], "guidance_embeds": guidance, **overrides}
    return randomised(FluxControlNetModel, seed, **kw)


def save_xlabs(model, path: Path, cfg: ControlNetConfig) -> Path:
    """Write a diffusers ControlNet's weights under XLabs' key names (BFL's, plus the ControlNet's own)."""
    state = model.state_dict()
    table = controlnet_layout.rules(cfg)
    assert {d for r in table for d in r.diffusers} == set(state)  # every tensor has its place
    out = {r.bfl: flux1_layout.diffusers_to_bfl(r, state.__getitem__).contiguous() for r in table}
    return save_tensors(out, path)
