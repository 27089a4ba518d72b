"""References for the FLUX.2 sampling tests: bare diffusers pipelines, a tiny VAE, a token-mixing fake
denoiser, and Flux2Pipeline's denoising loop driven by diffusers' own scheduler."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps
from PIL import Image

from tests.sampling.diffusers_refs import DEV_SCHEDULER_CONFIG, diffusers_pipeline

# FLUX.2's scheduler config: FLUX.1-dev's, dynamic shifting on, mu passed by the pipeline
FLUX2_SCHEDULER_CONFIG = DEV_SCHEDULER_CONFIG


def bare_flux2_pipe(vae: AutoencoderKLFlux2 | None = None, transformer=None) -> Flux2Pipeline:
    """`Flux2Pipeline` without text encoder (and, unless given, transformer); vae_scale_factor 8 with or
    without the VAE."""
    pipe = diffusers_pipeline(Flux2Pipeline, FLUX2_SCHEDULER_CONFIG, vae=vae, transformer=transformer)
    assert pipe.vae_scale_factor == 8
    return pipe


def bare_klein_pipe(**given: object) -> Flux2KleinPipeline:
    """`Flux2KleinPipeline` without text encoder, with the VAE, transformer and `is_distilled` given, if any."""
    return diffusers_pipeline(Flux2KleinPipeline, FLUX2_SCHEDULER_CONFIG, **given)


def tiny_flux2_vae(dtype: torch.dtype, seed: int = 0) -> AutoencoderKLFlux2:
    """A 4-level (8x) FLUX.2 VAE, 32 latent channels, random weights and BatchNorm running statistics.

    The statistics are spread over [1e-3, 4] (variance) so the bf16 rounding of `sqrt(var + eps)` shows.
    """
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), norm_num_groups=4, layers_per_block=1)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
        vae.bn.running_mean.copy_(0.5 * torch.randn(128, generator=gen))
        vae.bn.running_var.copy_(torch.exp(torch.empty(128).uniform_(-7.0, 1.4, generator=gen)))
    return vae.eval().to(dtype)


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A smooth-plus-noise test picture (so resampling and cropping positions matter), in `mode`."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / width, yy * 255 / height, (xx + yy) * 127 / (width + height)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    return image if mode == "RGB" else image.convert(mode)


class MixingDenoiser:
    """A fixed random map of the tokens, timestep and guidance in its own dtype, *mixing across tokens*.

    Each token's output depends on the mean of all input tokens, so reference tokens appended to the
    sequence change the prediction of the image tokens (a per-token map would hide them). Records inputs.
    """

    def __init__(self, channels: int, dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.weight = (torch.randn(channels, channels, generator=gen) / channels**0.5).to(dtype)
        self.mix = (torch.randn(channels, channels, generator=gen) / channels**0.5).to(dtype)
        self.t_dir = torch.randn(channels, generator=gen).to(dtype)
        self.g_dir = (0.1 * torch.randn(channels, generator=gen)).to(dtype)
        self.inputs: list[torch.Tensor] = []
        self.timesteps: list[torch.Tensor] = []

    def __call__(
        self, x: torch.Tensor, timestep: torch.Tensor, guidance: torch.Tensor | None
    ) -> torch.Tensor:
        assert x.dtype == self.dtype, "the caller casts the input to the model dtype"
        self.inputs.append(x)
        self.timesteps.append(timestep)
        out = x @ self.weight + x.mean(dim=1, keepdim=True) @ self.mix
        out = out + timestep.to(self.dtype)[:, None, None] * self.t_dir
        if guidance is not None:
            out = out + guidance.to(self.dtype)[:, None, None] * self.g_dir
        return out


def diffusers_flux2_loop(
    num_steps: int,
    latents: torch.Tensor,
    model: MixingDenoiser,
    *,
    model_dtype: torch.dtype,
    guidance: torch.Tensor | None = None,
    image_latents: torch.Tensor | None = None,
    negative: MixingDenoiser | None = None,
    guidance_scale: float = 1.0,
) -> torch.Tensor:
    """Flux2Pipeline / Flux2KleinPipeline.__call__ steps 6 and 7, line for line, with `model` for the
    transformer (`negative` set: klein's CFG branch) and diffusers' scheduler."""
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=num_steps)
    timesteps, _ = retrieve_timesteps(scheduler, num_steps, latents.device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    for t in timesteps:
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        latent_model_input = latents.to(model_dtype)
        if image_latents is not None:
            latent_model_input = torch.cat([latents, image_latents], dim=1).to(model_dtype)
        noise_pred = model(latent_model_input, timestep / 1000, guidance)
        noise_pred = noise_pred[:, : latents.size(1) :]
        if negative is not None:
            neg_noise_pred = negative(latent_model_input, timestep / 1000, None)
            neg_noise_pred = neg_noise_pred[:, : latents.size(1) :]
            noise_pred = neg_noise_pred + guidance_scale * (noise_pred - neg_noise_pred)
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
    return latents
