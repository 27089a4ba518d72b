"""A FluxPipeline with no models: its latent helpers, scheduler and image processor are the references."""

from __future__ import annotations

import pytest
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline


@pytest.fixture(scope="module")
def bare_pipe() -> FluxPipeline:
    """`FluxPipeline` with every model None: vae_scale_factor falls back to 8, as for the real VAE."""
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=None,
    )
    assert pipe.vae_scale_factor == 8
    return pipe
