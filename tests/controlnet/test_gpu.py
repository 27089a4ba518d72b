"""ControlNets on CUDA: diffusers' FluxControlNetPipeline's bits with the fused kernels and CUDA graphs, and the
same pipeline in the high tier, in FP8 and with a step cache running (GPU only; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.pipeline import Pipeline
from tests.controlnet.test_pipeline import KW, check_same, control_image, folders, reference  # noqa: F401
from tests.pipeline.test_flux1_pipeline import PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["instantx", "union"])
def test_gpu_controlnet_graphs_equal_diffusers(folders, kind):  # noqa: F811
    """Lossless on CUDA: the fused kernels apply to the ControlNet's blocks too, and the graphed steps (one
    graph per set of acting ControlNets) give diffusers' latents and pixels."""
    pipes, nets = folders
    mode = 1 if kind == "union" else None
    args = dict(control_image=control_image(1), controlnet_conditioning_scale=0.8, control_mode=mode,
                control_guidance_end=0.5, num_inference_steps=6)  # fmt: skip
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    net = FluxControlNetModel.from_pretrained(nets[kind], torch_dtype=torch.bfloat16)
    ref = FluxControlNetPipeline.from_pretrained(
        pipes["pipe"], controlnet=net, torch_dtype=torch.bfloat16
    ).to("cuda")
    want = [
        ref(prompt=PROMPTS, generator=torch.Generator().manual_seed(5), output_type=t, guidance_scale=3.5, **KW,
            **args).images
        for t in ("latent", "pil")
    ]  # fmt: skip
    ours = Pipeline.from_pretrained(pipes["pipe"], device="cuda", controlnet=nets[kind])
    args["num_steps"] = args.pop("num_inference_steps")
    for _ in range(2):  # the second call replays the graphs the first captured
        got = ours(PROMPTS, seed=5, **KW, **args)
        assert got.info["cuda_graphs"] is True and got.info["kernels"] != "off"
        check_same(got, want[0].to(got.latents.device), want[1])


@pytest.mark.parametrize(("quality", "fp8", "cache"), [("high", False, None), ("lossless", True, None),
                                                       ("lossless", False, "first-block:threshold=0")])  # fmt: skip
def test_gpu_controlnet_with_high_fp8_and_step_cache(folders, quality, fp8, cache):  # noqa: F811
    """The high tier and an FP8 transformer run with a ControlNet (graphed equal to eager); a step cache that
    never skips changes no bit."""
    pipes, nets = folders
    args = dict(control_image=control_image(2), num_steps=5, seed=3, **KW)
    ours = Pipeline.from_pretrained(
        pipes["pipe"], device="cuda", quality=quality, fp8=fp8, controlnet=nets["instantx"]
    )
    graphed = ours(PROMPTS[0], **args, cache=cache)
    ours.cuda_graphs = False
    eager = ours(PROMPTS[0], **args)
    assert torch.isfinite(graphed.latents.float()).all()
    assert torch.equal(graphed.latents, eager.latents)
