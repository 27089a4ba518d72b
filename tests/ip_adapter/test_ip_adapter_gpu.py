"""The IP-Adapter on CUDA: diffusers' bits with the fused kernels and CUDA graphs (each branch's image tokens a
fixed input of its graph), with true CFG (GPU only; skipped elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flux_runtime.pipeline import Pipeline
from tests.ip_adapter.ip_fixtures import picture
from tests.ip_adapter.test_ip_adapter_parity import CFG, KW, PROMPT, _load_diffusers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("call", [{}, CFG], ids=["plain", "cfg"])
def test_gpu_ip_adapter_graphs_equal_diffusers(ip_files, call):
    ref = _load_diffusers(ip_files, torch.bfloat16).to("cuda")
    ref.set_ip_adapter_scale(0.7)
    args = {"ip_adapter_image": picture(1), **call}
    want = ref(
        PROMPT, generator=torch.Generator().manual_seed(42), num_inference_steps=4, guidance_scale=3.5,
        output_type="latent", **KW, **args,
    ).images  # fmt: skip
    ours = Pipeline.from_pretrained(ip_files["pipe"], device="cuda")
    ours.load_ip_adapter(ip_files["adapter"], 0.7, image_encoder=ip_files["clip"])
    for _ in range(2):  # the second call replays the graphs the first captured
        got = ours(PROMPT, seed=42, num_steps=4, guidance=3.5, output_type="latent", **KW, **args)
        assert got.info["cuda_graphs"] is True
        assert torch.equal(got.latents, want.to(got.latents.device))
    other = ours(PROMPT, seed=42, num_steps=4, guidance=3.5, output_type="latent", **KW,
                 **{**args, "ip_adapter_image": picture(7)})  # fmt: skip
    assert not np.array_equal(other.latents.float().cpu().numpy(), got.latents.float().cpu().numpy())
