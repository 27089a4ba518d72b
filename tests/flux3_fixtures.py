"""Tiny random FLUX.3 transformers written by diffusers, their BFL single-file twins, and inputs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import NamedTuple

import torch

from flux_runtime.weights import flux3_layout
from tests.random_models import bfl_transformer_state_dict, randomised, save_tensors
from tests.random_models import save_diffusers as save_diffusers  # the family's name for it

# The shape of `TINY_FLUX3` in diffusers' vocabulary (flow_map picks the distilled model).
TINY_KW = dict(
    in_channels=128,
    cond_in_channels=128,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=256,
    mlp_ratio=3.0,
    axes_dims_rope=(8, 8, 8, 8),
    rope_theta=10000,
)
TXT_DIM = TINY_KW["joint_attention_dim"]


def make_diffusers_flux3(flow_map: bool, seed: int = 0, **overrides):
    """A tiny fp32 `Flux3Transformer2DModel` with every parameter (QK-norm weights too) randomised."""
    from diffusers import Flux3Transformer2DModel

    return randomised(Flux3Transformer2DModel, seed, **{**TINY_KW, "flow_map": flow_map, **overrides})


def as_loaded(model, dtype: torch.dtype):
    """A copy of `model` cast the way `from_pretrained(torch_dtype=dtype)` loads it: the QK-norm weights stay fp32."""
    model = copy.deepcopy(model)
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if ".norm_q." in name or ".norm_k." in name else dtype)
    return model


def bfl_state_dict(model, prefix: str = "") -> dict[str, torch.Tensor]:
    """`model`'s weights under BFL FLUX.3 keys, converted by our layout table."""
    return bfl_transformer_state_dict(model, flux3_layout, "flow_map", prefix)


def save_bfl(model, path: Path, prefix: str = "", extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model`'s weights in the BFL single-file layout (optionally prefixed, with extra tensors)."""
    return save_tensors({**bfl_state_dict(model, prefix), **(extra or {})}, path)


def image_ids(h: int, w: int, l_coord: int = 0) -> torch.Tensor:
    """(h*w, 4) float32 ids `(0, i/2, j/2, l)` in row-major token order, as the FLUX.3 pipeline builds them."""
    ids = torch.cartesian_prod(
        torch.arange(1), torch.arange(h), torch.arange(w), torch.tensor([l_coord])
    ).float()
    ids[:, 1:3] *= 0.5
    return ids


def text_ids(n: int) -> torch.Tensor:
    """(n, 4) float32 ids `(0, 0, 0, l)`."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(n)).float()


class Inputs(NamedTuple):
    img: torch.Tensor
    img_ids: torch.Tensor
    txt: torch.Tensor
    txt_ids: torch.Tensor
    timesteps: torch.Tensor
    ref: torch.Tensor | None
    ref_ids: torch.Tensor | None
    target: torch.Tensor | None


def make_inputs(
    batch: int,
    h: int,
    w: int,
    txt_len: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    refs: tuple[tuple[int, int], ...] = (),
    flow_map: bool = False,
) -> Inputs:
    """Packed latents on an h×w token grid, text states, float ids, timestep/1000 in the model dtype, optional
    reference grids (l = -1, -2, ...) and, for a flow map, the target timesteps."""
    gen = torch.Generator().manual_seed(seed)
    img = torch.randn(batch, h * w, 128, generator=gen).to(dtype)
    txt = torch.randn(batch, txt_len, TXT_DIM, generator=gen).to(dtype)
    timesteps = (torch.tensor([0.98, 0.5][:batch] * batch)[:batch]).to(dtype)
    ref = ref_ids = None
    if refs:
        ref = torch.randn(batch, sum(a * b for a, b in refs), 128, generator=gen).to(dtype)
        ref_ids = torch.cat([image_ids(a, b, -1 - k) for k, (a, b) in enumerate(refs)])
    target = (timesteps.float() * 0.5).to(dtype) if flow_map else None
    return Inputs(img, image_ids(h, w), txt, text_ids(txt_len), timesteps, ref, ref_ids, target)


def reference_forward(model, x: Inputs) -> torch.Tensor:
    """diffusers' forward on `x`."""
    with torch.no_grad():
        return model(
            hidden_states=x.img,
            encoder_hidden_states=x.txt,
            timestep=x.timesteps,
            img_ids=x.img_ids,
            txt_ids=x.txt_ids,
            image_cond_hidden_states=x.ref,
            image_cond_ids=x.ref_ids,
            target_timestep=x.target,
            return_dict=False,
        )[0]


def our_forward(model, x: Inputs) -> torch.Tensor:
    """Our forward on `x`."""
    with torch.no_grad():
        return model(
            x.img,
            x.img_ids,
            x.txt,
            x.txt_ids,
            x.timesteps,
            ref=x.ref,
            ref_ids=x.ref_ids,
            target_timesteps=x.target,
        )
