"""FLUX.1 Redux on CUDA: FluxPriorReduxPipeline + FluxPipeline's bits with the fused kernels and CUDA graphs
(GPU only; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.pipeline import Pipeline
from tests.pipeline.test_redux import KW, NO_TEXT, PROMPTS, _image, dev  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gpu_redux_with_prompts_equals_diffusers(dev):  # noqa: F811
    from diffusers import FluxPipeline, FluxPriorReduxPipeline

    folder, redux = dev
    base = FluxPipeline.from_pretrained(folder, dtype=torch.bfloat16).to("cuda")
    text = {k: getattr(base, k) for k in NO_TEXT}
    images = [_image(40, 30, seed=1), _image(20, 50, seed=2)]
    prior = FluxPriorReduxPipeline.from_pretrained(redux, dtype=torch.bfloat16, **text).to("cuda")(
        images, prompt=PROMPTS, prompt_embeds_scale=[1.0, 0.7]
    )
    want = base(
        prompt_embeds=prior.prompt_embeds, pooled_prompt_embeds=prior.pooled_prompt_embeds,
        generator=torch.Generator().manual_seed(3), num_inference_steps=3, output_type="latent", **KW,
    ).images  # fmt: skip
    ours = Pipeline.from_pretrained(folder, device="cuda", redux=redux)
    for _ in range(2):  # the second call replays the graphs the first captured
        got = ours(PROMPTS, image=images, seed=3, num_steps=3, prompt_embeds_scale=[1.0, 0.7], output_type="latent",
                   **KW)  # fmt: skip
        assert got.info["cuda_graphs"] is True
        assert torch.equal(got.latents, want.to(got.latents.device))
