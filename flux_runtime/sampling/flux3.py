"""FLUX.3 sampling, with the roundings of diffusers 0.42.1's FLUX.3 modular pipeline.

- Noise: `randn` of the patchified shape `(B, 128, H/16, W/16)` drawn in float32 (whatever the model dtype),
  then cast, then packed row-major to tokens as FLUX.2 packs them.
- Position ids are float32 `(t, h, w, l)`: image rows and columns scaled by 0.5 (the scale FLUX.3 was
  trained with), the generated image at `l = 0`, reference k at `l = -1 - k`; text `(0, 0, 0, l)`.
- Schedule: `linspace(1, 1/N, N)` with the static shift 6.93 (`FLUX3_SCHEDULE`), terminal 0.
- Per step: the model sees `(t / 1000).to(dtype)` (the division in fp32, then one rounding; the model
  multiplies by 1000 in its dtype, the second rounding); a flow map also sees the step's target
  `(t_next / 1000).to(dtype)` (0 after the last step). The base model's CFG is two separate forwards,
  `uncond + scale * (cond - uncond)` (diffusers' guider), and the Euler update is
  `(latents.to(fp32) + dt * pred).to(pred.dtype)` as for FLUX.1 and FLUX.2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flux_runtime.sampling.euler import (
    ModelFn,
    StepCallback,
    _check_loop_inputs,
    _checked,
    _euler_step,
    _step_done,
)
from flux_runtime.sampling.flux2 import flux2_prepare_noise
from flux_runtime.sampling.schedule import ScheduleConfig

# The constant timestep shift of the FLUX.3 sampling recipe; the H/W position scale of its image tokens.
FLUX3_SHIFT = 6.93
FLUX3_SCHEDULE = ScheduleConfig(shift=FLUX3_SHIFT)
IMAGE_ROPE_SCALE = 0.5


def flux3_image_ids(h: int, w: int, l_coord: int = 0, device: torch.device | str = "cpu") -> Tensor:
    """(h·w, 4) float32 ids `(0, i/2, j/2, l)` of an h x w token grid, row-major."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.tensor([l_coord]))
    ids = ids.to(torch.float32)
    ids[:, 1:3] = ids[:, 1:3] * IMAGE_ROPE_SCALE
    return ids.to(device)


def flux3_prepare_noise(batch: int, height: int, width: int, *, dtype: torch.dtype, **draw: Any) -> Tensor:
    """Initial noise `(batch, 128, H/16, W/16)`: FLUX.2's draw (`flux2_prepare_noise`, the same keywords: `device`,
    `seed` / `generator`, `vae_scale_factor`) made in float32, then cast to `dtype`."""
    return flux2_prepare_noise(batch, height, width, dtype=torch.float32, **draw).to(dtype)


@torch.no_grad()
def flux3_denoise(
    model_fn: ModelFn,
    latents: Tensor,
    sigmas: Tensor,
    timesteps: Tensor,
    *,
    flow_map: bool,
    negative_model_fn: ModelFn | None = None,
    guidance_scale: float = 1.0,
    reference_tokens: Tensor | None = None,
    callback: StepCallback | None = None,
    after_step: Callable[[int, Tensor], Tensor] | None = None,
) -> Tensor:
    """Integrate packed `latents` (B, L, C) over the schedule; returns (B, L, C) in the prediction dtype.

    `model_fn(x, t, target)` gets `x` = the latents with any `reference_tokens` (B, L_ref, C) appended (the
    velocity closure splits them off again: references condition every step without being updated), the
    flow time `t` (B,) and, for a flow map, the target time (B,) (else None); it returns (B, L, C).
    With `negative_model_fn` (the base model's CFG) each step also runs it and guides with `guidance_scale`.
    """
    _check_loop_inputs("flux3_denoise", latents, sigmas, timesteps)
    if flow_map and negative_model_fn is not None:
        raise ValueError("flux3_denoise: a flow map samples without CFG; pass no negative_model_fn")
    sigmas, timesteps = sigmas.to(latents.device), timesteps.to(latents.device)
    batch, n = latents.shape[:2]
    for i, t in enumerate(timesteps):
        dtype = latents.dtype
        t_model = (t / 1000).expand(batch).to(dtype)
        target = None
        if flow_map:
            t_next = timesteps[i + 1] if i + 1 < len(timesteps) else torch.zeros_like(t)
            target = (t_next / 1000).expand(batch).to(dtype)
        x = latents if reference_tokens is None else torch.cat([latents, reference_tokens], dim=1)
        pred = _checked(model_fn(x, t_model, target), latents, "model_fn", "flux3_denoise")
        if negative_model_fn is not None:
            neg = _checked(
                negative_model_fn(x, t_model, target), latents, "negative_model_fn", "flux3_denoise"
            )
            pred = neg + guidance_scale * (pred - neg)
        latents = _step_done(i, t, _euler_step(latents, pred, sigmas, i), after_step, callback)
    assert latents.shape[1] == n
    return latents
