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

import torch
from torch import Tensor

from flux_runtime.sampling.euler import ModelFn, StepCallback
from flux_runtime.sampling.flux2 import FLUX2_TOKEN_CHANNELS
from flux_runtime.sampling.latents import draw_noise, latent_size
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


def flux3_prepare_noise(
    batch: int,
    height: int,
    width: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    vae_scale_factor: int = 8,
) -> Tensor:
    """Initial noise `(batch, 128, H/16, W/16)`: drawn in float32 with `draw_noise`'s seed rules, cast to `dtype`."""
    h, w = latent_size(height, width, vae_scale_factor)
    shape = (batch, FLUX2_TOKEN_CHANNELS, h // 2, w // 2)
    return draw_noise(shape, dtype=torch.float32, device=device, seed=seed, generator=generator).to(dtype)


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
    if latents.ndim != 3:
        raise ValueError(
            f"flux3_denoise: expected packed latents (B, L, C), got shape {tuple(latents.shape)}"
        )
    if timesteps.ndim != 1 or sigmas.shape != (timesteps.shape[0] + 1,):
        raise ValueError(
            f"flux3_denoise: expected sigmas (N + 1,) and timesteps (N,), got {tuple(sigmas.shape)} and "
            f"{tuple(timesteps.shape)}"
        )
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
        pred = _checked(model_fn(x, t_model, target), latents, "model_fn")
        if negative_model_fn is not None:
            neg = _checked(negative_model_fn(x, t_model, target), latents, "negative_model_fn")
            pred = neg + guidance_scale * (pred - neg)
        # FlowMatchEulerDiscreteScheduler.step: fp32 sample, 0-dim fp32 dt, cast back to pred's dtype
        latents = (latents.to(torch.float32) + (sigmas[i + 1] - sigmas[i]) * pred).to(pred.dtype)
        if after_step is not None:
            latents = after_step(i, latents)
        if callback is not None:
            callback(i, t, latents)
    assert latents.shape[1] == n
    return latents


def _checked(pred: Tensor, latents: Tensor, name: str) -> Tensor:
    if pred.shape != latents.shape:
        raise ValueError(
            f"flux3_denoise: {name} returned shape {tuple(pred.shape)}, expected {tuple(latents.shape)}"
        )
    return pred
