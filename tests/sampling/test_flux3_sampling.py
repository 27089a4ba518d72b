"""FLUX.3's schedule and position ids are diffusers' (FlowMatchEulerDiscreteScheduler with shift 6.93)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flux_runtime.sampling import get_schedule
from flux_runtime.sampling.flux3 import FLUX3_SCHEDULE, flux3_image_ids, flux3_prepare_noise


@pytest.mark.parametrize("steps", [1, 16, 50])
def test_schedule_equals_diffusers(steps):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=6.93)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device="cpu")
    ours = get_schedule(steps, 4096, config=FLUX3_SCHEDULE)
    assert torch.equal(ours.timesteps, scheduler.timesteps) and torch.equal(ours.sigmas, scheduler.sigmas)


def test_ids_and_noise_equal_diffusers():
    from diffusers.modular_pipelines.flux3.before_denoise import _prepare_image_ids
    from diffusers.utils.torch_utils import randn_tensor

    assert torch.equal(flux3_image_ids(3, 5), _prepare_image_ids(3, 5, 0.5))
    assert torch.equal(flux3_image_ids(2, 2, -2), _prepare_image_ids(2, 2, 0.5, l_coord=-2))
    noise = flux3_prepare_noise(2, 64, 32, dtype=torch.bfloat16, seed=3)
    want = randn_tensor((2, 128, 4, 2), generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    assert torch.equal(noise, want.to(torch.bfloat16))
