"""The flow-matching Euler loop, with `FluxPipeline`'s and `Flux2Pipeline`'s roundings (diffusers 0.42.1).

Per step i: `timestep = t.expand(B).to(latents.dtype)`; the denoiser sees
`timestep / 1000` computed in that dtype (bf16: 988.40863 → 988.0 → 0.98828125); the update is
`(latents.to(fp32) + dt * pred).to(pred.dtype)` where `dt = σ[i+1] − σ[i]` is a 0-dim fp32 tensor, so by
type promotion `dt * pred` is a bf16 product added to the fp32 sample (FlowMatchEulerDiscreteScheduler.step).
FLUX.2 runs the same steps, plus reference-image tokens appended to the model input and cut
from its prediction, and klein's CFG, which is FLUX.1's true-CFG formula with `guidance_scale`.
The denoiser is a callable, so this module knows nothing of models (import direction: sampling → nothing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ModelFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]
"""`model_fn(latents (B, L, C), timestep / 1000 (B,), guidance (B,) fp32 or None) -> velocity (B, L, C)`.

The pipeline builds it as a closure over the text embeddings, ids and RoPE tables of one prompt. FLUX.2
closures cast the input to the transformer's dtype (`latent_model_input.to(transformer.dtype)`); with
reference tokens, `L` counts them too and the ids are `cat([image ids, reference ids])`."""

StepCallback = Callable[[int, Tensor, Tensor], None]
"""`callback(i, t, latents)` after step i (0-based) with that step's fp32 timestep and the new latents."""


@torch.no_grad()
def denoise(
    model_fn: ModelFn,
    latents: Tensor,
    sigmas: Tensor,
    timesteps: Tensor,
    *,
    guidance: Tensor | None = None,
    negative_model_fn: ModelFn | None = None,
    true_cfg_scale: float = 1.0,
    reference_tokens: Tensor | None = None,
    callback: StepCallback | None = None,
    after_step: Callable[[int, Tensor], Tensor] | None = None,
) -> Tensor:
    """Integrate packed `latents` (B, L, C) from `sigmas[0]` to `sigmas[-1]` with Euler steps; returns (B, L, C).

    `sigmas` (N + 1,) and `timesteps` (N,) are fp32, as `get_schedule` returns them; they are moved to the
    latents' device, where diffusers keeps them, so `dt` is the same tensor diffusers multiplies with.
    `guidance` is passed through to `model_fn` untouched (dev: `torch.full([1], g, fp32).expand(B)`;
    schnell: None). With `negative_model_fn` (true CFG, `true_cfg_scale > 1`), each step also calls it and
    uses `neg + true_cfg_scale * (pos − neg)` in the prediction dtype, as `FluxPipeline` does with a
    negative prompt (klein base models: `true_cfg_scale = guidance_scale`, see `klein_uses_cfg`).
    `reference_tokens` (B, L_ref, C) (FLUX.2 editing, `encode_reference_images`) are appended to the latents
    for every model call, `torch.cat([latents, reference_tokens], dim=1)`, and the prediction is cut back to
    the first L tokens before guidance and the step, so they condition without being updated (FLUX.2
    `__call__`). `after_step(i, latents) -> latents` runs after each update, before `callback` (inpainting
    puts the re-noised original back outside the mask there). The result has the prediction's dtype (the
    model's, normally the latents' dtype).
    """
    _check_loop_inputs("denoise", latents, sigmas, timesteps)
    if sigmas.dtype != torch.float32 or timesteps.dtype != torch.float32:
        raise ValueError(
            f"denoise: sigmas and timesteps must be fp32, got {sigmas.dtype} and {timesteps.dtype}"
        )
    if negative_model_fn is None and true_cfg_scale != 1.0:
        raise ValueError(f"true_cfg_scale {true_cfg_scale} needs a negative_model_fn")
    if negative_model_fn is not None and not true_cfg_scale > 1.0:
        raise ValueError(f"true_cfg_scale {true_cfg_scale} must be > 1 with a negative_model_fn")
    if reference_tokens is not None and (
        reference_tokens.ndim != 3
        or reference_tokens.shape[0] != latents.shape[0]
        or reference_tokens.shape[2] != latents.shape[2]
    ):
        raise ValueError(
            f"denoise: expected reference_tokens (B, L_ref, C) = ({latents.shape[0]}, L_ref, {latents.shape[2]}), "
            f"got shape {tuple(reference_tokens.shape)}"
        )

    sigmas = sigmas.to(latents.device)
    timesteps = timesteps.to(latents.device)
    batch = latents.shape[0]
    for i, t in enumerate(timesteps):
        timestep = t.expand(batch).to(latents.dtype)  # (B,)
        # FLUX.2 editing: (B, L + L_ref, C); the prediction for the reference tokens is dropped
        x = latents if reference_tokens is None else torch.cat([latents, reference_tokens], dim=1)
        pred = _checked(model_fn(x, timestep / 1000, guidance), x, "model_fn")[:, : latents.shape[1]]
        if negative_model_fn is not None:
            neg = _checked(negative_model_fn(x, timestep / 1000, guidance), x, "negative_model_fn")
            neg = neg[:, : latents.shape[1]]
            pred = neg + true_cfg_scale * (pred - neg)
        latents = _step_done(i, t, _euler_step(latents, pred, sigmas, i), after_step, callback)
    return latents


# ---- shared with flux3_denoise ----------------------------------------------------------------------------


def _check_loop_inputs(who: str, latents: Tensor, sigmas: Tensor, timesteps: Tensor) -> None:
    """A ValueError, naming the loop `who`, unless `latents` are (B, L, C), `timesteps` (N,), `sigmas` (N + 1,)."""
    if latents.ndim != 3:
        raise ValueError(f"{who}: expected packed latents (B, L, C), got shape {tuple(latents.shape)}")
    if timesteps.ndim != 1 or sigmas.shape != (timesteps.shape[0] + 1,):
        raise ValueError(
            f"{who}: expected sigmas (N + 1,) and timesteps (N,), got {tuple(sigmas.shape)} and "
            f"{tuple(timesteps.shape)}"
        )


def _checked(pred: Tensor, latents: Tensor, name: str, who: str = "denoise") -> Tensor:
    """`pred`, the output of the callable `name`, if it has the shape of `latents`; else a ValueError naming `who`."""
    if pred.shape != latents.shape:
        raise ValueError(f"{who}: {name} returned shape {tuple(pred.shape)}, expected {tuple(latents.shape)}")
    return pred


def _euler_step(latents: Tensor, pred: Tensor, sigmas: Tensor, i: int) -> Tensor:
    """Step i's update as `FlowMatchEulerDiscreteScheduler.step` computes it: the sample in fp32 plus the 0-dim
    fp32 `dt = σ[i+1] − σ[i]` times `pred` (a product in pred's dtype by type promotion), cast back to pred's dtype."""
    sample = latents.to(torch.float32)
    dt = sigmas[i + 1] - sigmas[i]
    return (sample + dt * pred).to(pred.dtype)


def _step_done(
    i: int,
    t: Tensor,
    latents: Tensor,
    after_step: Callable[[int, Tensor], Tensor] | None,
    callback: StepCallback | None,
) -> Tensor:
    """The latents after step i: `after_step(i, latents)` if given, then `callback(i, t, latents)` if given."""
    if after_step is not None:
        latents = after_step(i, latents)
    if callback is not None:
        callback(i, t, latents)
    return latents
