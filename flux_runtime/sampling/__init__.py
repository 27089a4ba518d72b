"""Sampling: schedules, latents, the Euler loop and postprocessing; tensors in, tensors out.

The denoiser comes in as a callable (`denoise(model_fn, ...)`), so nothing here imports `models`.
"""

from flux_runtime.sampling.euler import ModelFn, StepCallback, denoise
from flux_runtime.sampling.latents import (
    LATENT_CHANNELS,
    VAE_SCALE_FACTOR,
    check_image_size,
    image_ids,
    latent_size,
    num_image_tokens,
    pack,
    prepare_noise,
    unpack,
)
from flux_runtime.sampling.postprocess import denormalize_latents, to_pil_images, to_uint8_images
from flux_runtime.sampling.schedule import (
    FLUX1_DEV_SCHEDULE,
    FLUX1_SCHNELL_SCHEDULE,
    FLUX2_SCHEDULE,
    Schedule,
    ScheduleConfig,
    get_schedule,
)

__all__ = [
    "FLUX1_DEV_SCHEDULE",
    "FLUX1_SCHNELL_SCHEDULE",
    "FLUX2_SCHEDULE",
    "LATENT_CHANNELS",
    "VAE_SCALE_FACTOR",
    "ModelFn",
    "Schedule",
    "ScheduleConfig",
    "StepCallback",
    "check_image_size",
    "denoise",
    "denormalize_latents",
    "get_schedule",
    "image_ids",
    "latent_size",
    "num_image_tokens",
    "pack",
    "prepare_noise",
    "to_pil_images",
    "to_uint8_images",
    "unpack",
]
