"""A FluxPipeline with no models: its latent helpers, scheduler and image processor are the references."""

from __future__ import annotations

import pytest
from diffusers import FluxPipeline

from tests.sampling.diffusers_refs import diffusers_pipeline


@pytest.fixture(scope="module")
def bare_pipe() -> FluxPipeline:
    """`FluxPipeline` with every model None: vae_scale_factor falls back to 8, as for the real VAE."""
    pipe = diffusers_pipeline(FluxPipeline)
    assert pipe.vae_scale_factor == 8
    return pipe
