"""ControlNets on the FLUX.1 pipeline give diffusers' FluxControlNetPipeline's bits: one ControlNet of each kind
(InstantX, union, XLabs), several at once with their own scales and step fractions, and with true CFG; loaded
through our loader from the folders diffusers wrote, in fp32 and bf16 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flux_runtime.pipeline import Pipeline
from flux_runtime.weights.controlnet import load_controlnet
from tests.controlnet_fixtures import make_diffusers_controlnet
from tests.pipeline.test_flux1_pipeline import PROMPTS, _save_pipeline
from tests.random_models import save_diffusers

KW = dict(height=32, width=48, max_sequence_length=16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("controlnet")
    pipe = _save_pipeline(root / "FLUX.1-tiny", True)
    # XLabs' hint encoder takes the pixels 8x down: the autoencoder must too
    pipe8 = _save_pipeline(root / "FLUX.1-tiny-8x", True, block_out_channels=(32, 32, 32, 32))
    nets = {
        "instantx": save_diffusers(make_diffusers_controlnet("instantx", seed=5), root / "instantx"),
        "instantx2": save_diffusers(make_diffusers_controlnet("instantx", seed=7), root / "i2"),
        "union": save_diffusers(make_diffusers_controlnet("union", seed=9), root / "union"),
        "xlabs": save_diffusers(make_diffusers_controlnet("xlabs", seed=11), root / "xlabs"),
    }
    return {"pipe": pipe, "pipe8": pipe8}, nets


def control_image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(32, 48, 3), dtype=np.uint8), "RGB")


def reference(pipe_folder, net_folders, dtype, **kw):
    """diffusers' latents and PIL images for `kw` (one generator seeded 5 per run)."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxMultiControlNetModel

    nets = [FluxControlNetModel.from_pretrained(f, torch_dtype=dtype) for f in net_folders]
    controlnet = nets[0] if len(nets) == 1 else FluxMultiControlNetModel(nets)
    ref = FluxControlNetPipeline.from_pretrained(pipe_folder, controlnet=controlnet, torch_dtype=dtype)
    runs = [
        ref(generator=torch.Generator().manual_seed(5), output_type=t, guidance_scale=3.5, **KW, **kw).images
        for t in ("latent", "pil")
    ]
    return runs


def check_same(got, latents, images) -> None:
    assert torch.equal(got.latents, latents)
    for g, w in zip(got.images, images, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["instantx", "union", "xlabs"])
def test_one_controlnet_equals_diffusers(folders, kind, dtype):
    pipes, nets = folders
    pipe_folder = pipes["pipe8" if kind == "xlabs" else "pipe"]
    mode = 2 if kind == "union" else None
    image = control_image(1)
    args = dict(control_image=image, controlnet_conditioning_scale=0.7, control_mode=mode,
                control_guidance_start=0.25, control_guidance_end=1.0, num_inference_steps=4)  # fmt: skip
    latents, images = reference(pipe_folder, [nets[kind]], dtype, prompt=PROMPTS, **args)
    ours = Pipeline.from_pretrained(pipe_folder, device="cpu", dtype=dtype, controlnet=nets[kind])
    args["num_steps"] = args.pop("num_inference_steps")
    got = ours(PROMPTS, seed=5, **KW, **args)
    check_same(got, latents, images)
    (record,) = got.info["controlnets"]
    assert record["kind"] == kind and record["scale"] == 0.7 and record["guidance_start"] == 0.25
    assert record.get("mode") == mode and len(record["image"]["sha256"]) == 64


def test_several_controlnets_and_true_cfg_equal_diffusers(folders):
    """Two ControlNets with their own scales and step fractions, and true
    CFG, whose negative branch takes the positive branch's residuals."""
    pipes, nets = folders
    pipe_folder, dtype = pipes["pipe"], torch.bfloat16
    images = [control_image(2), control_image(3)]
    args = dict(control_image=images, controlnet_conditioning_scale=[0.6, 1.3], control_guidance_start=[0.0, 0.5],
                control_guidance_end=[0.75, 1.0], negative_prompt="blurry", true_cfg_scale=3.0)  # fmt: skip
    latents, pil = reference(
        pipe_folder,
        [nets["instantx"], nets["instantx2"]],
        dtype,
        prompt=PROMPTS[0],
        num_inference_steps=4,
        **args,
    )
    models = [load_controlnet(nets[k], dtype=dtype) for k in ("instantx", "instantx2")]
    ours = Pipeline.from_pretrained(pipe_folder, device="cpu", dtype=dtype, controlnet=models)
    got = ours(PROMPTS[0], seed=5, num_steps=4, **KW, **args)
    check_same(got, latents, pil)
    assert [r["scale"] for r in got.info["controlnets"]] == [0.6, 1.3]


def test_an_idle_controlnet_is_skipped_losslessly(folders):
    """Outside its step fraction a ControlNet is not run at all; diffusers runs it at scale 0 and adds zeros:
    the same bits."""
    pipes, nets = folders
    ours = Pipeline.from_pretrained(
        pipes["pipe"], device="cpu", dtype=torch.bfloat16, controlnet=nets["instantx"]
    )
    image = control_image(4)
    idle = ours(PROMPTS[0], seed=3, num_steps=4, control_image=image, control_guidance_start=0.99, **KW)
    zero = ours(PROMPTS[0], seed=3, num_steps=4, control_image=image, controlnet_conditioning_scale=0.0, **KW)
    acting = ours(PROMPTS[0], seed=3, num_steps=4, control_image=image, **KW)
    assert torch.equal(idle.latents, zero.latents)
    assert not torch.equal(idle.latents, acting.latents)


@pytest.mark.parametrize("mode", ["img2img", "inpaint"])
def test_img2img_and_inpainting_with_a_controlnet_equal_diffusers(folders, mode):
    from diffusers import (
        FluxControlNetImg2ImgPipeline,
        FluxControlNetInpaintPipeline,
        FluxControlNetModel,
        FluxMultiControlNetModel,
    )

    pipes, nets = folders
    dtype = torch.bfloat16
    controls = [control_image(5), control_image(6)]
    image, mask = (
        control_image(7),
        Image.fromarray((np.arange(48)[None, :].repeat(32, 0) * 5).astype(np.uint8)),
    )
    extra = dict(image=image, strength=0.8) | (dict(mask_image=mask) if mode == "inpaint" else {})
    args = dict(control_image=controls, controlnet_conditioning_scale=[0.9, 0.5], control_mode=[None, 2])
    cls = FluxControlNetInpaintPipeline if mode == "inpaint" else FluxControlNetImg2ImgPipeline
    multi = FluxMultiControlNetModel(
        [FluxControlNetModel.from_pretrained(nets[k], torch_dtype=dtype) for k in ("instantx", "union")]
    )
    ref = cls.from_pretrained(pipes["pipe"], controlnet=multi, torch_dtype=dtype)
    want = [
        ref(prompt=PROMPTS[1], generator=torch.Generator().manual_seed(5), output_type=t, guidance_scale=3.5,
            num_inference_steps=5, **KW, **args, **extra).images
        for t in ("latent", "pil")
    ]  # fmt: skip
    ours = Pipeline.from_pretrained(
        pipes["pipe"], device="cpu", dtype=dtype, controlnet=[nets["instantx"], nets["union"]]
    )
    got = ours(PROMPTS[1], seed=5, num_steps=5, **KW, **args, **extra)
    check_same(got, *want)


def test_cuda_graph_path_keys_graphs_by_the_acting_controlnets(folders, monkeypatch):
    """The graph path (a CPU stand-in whose replays share one output buffer, as CUDA graphs do): one graph per
    branch and set of acting ControlNets with their scales, the control tensors passed as inputs; the same bits
    as the eager path, and a new scale makes new graphs rather than replaying the old ones."""
    from tests.pipeline.test_flux2_pipeline import _AliasingGraphs

    pipes, nets = folders
    ours = Pipeline.from_pretrained(
        pipes["pipe"], device="cpu", dtype=torch.float32, controlnet=nets["instantx"]
    )
    args = dict(
        control_image=control_image(8), control_guidance_start=0.5, negative_prompt="dull", true_cfg_scale=2.0
    )
    eager = [
        ours(PROMPTS[0], seed=2, num_steps=4, controlnet_conditioning_scale=s, **KW, **args)
        for s in (0.5, 0.9)
    ]
    monkeypatch.setattr(ours, "_new_graph", _AliasingGraphs)
    monkeypatch.setattr(ours, "_graphs_enabled", lambda: True)
    monkeypatch.setattr(_AliasingGraphs, "made", 0)  # its count is the class's: put back after this test
    first = ours(PROMPTS[0], seed=2, num_steps=4, controlnet_conditioning_scale=0.5, **KW, **args)
    assert first.info["cuda_graphs"] is True and torch.equal(first.latents, eager[0].latents)
    assert _AliasingGraphs.made == 4  # (cond, uncond) x (idle, acting at 0.5)
    second = ours(PROMPTS[0], seed=2, num_steps=4, controlnet_conditioning_scale=0.9, **KW, **args)
    assert torch.equal(second.latents, eager[1].latents)
    assert _AliasingGraphs.made == 6  # the idle graphs are kept, the acting ones are new


def test_a_controlnet_beside_an_ip_adapter_equals_diffusers(folders, tmp_path):
    """Both adapters on one call: the image prompt reaches the transformer, the ControlNet reads none, as in
    diffusers' FluxControlNetPipeline with `load_ip_adapter`."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    from tests.ip_adapter.ip_fixtures import picture, save_adapter, save_clip_vision

    pipes, nets = folders
    dtype = torch.bfloat16
    clip, adapter = save_clip_vision(tmp_path / "clip"), save_adapter(tmp_path / "adapter")
    net = FluxControlNetModel.from_pretrained(nets["instantx"], torch_dtype=dtype)
    ref = FluxControlNetPipeline.from_pretrained(pipes["pipe"], controlnet=net, torch_dtype=dtype)
    ref.load_ip_adapter(
        str(adapter),
        weight_name="ip_adapter.safetensors",
        image_encoder_pretrained_model_name_or_path=str(clip),
    )
    ref.set_ip_adapter_scale(0.8)
    args = dict(
        control_image=control_image(9), controlnet_conditioning_scale=0.6, ip_adapter_image=picture(3)
    )
    want = [
        ref(prompt=PROMPTS[0], generator=torch.Generator().manual_seed(5), output_type=t, guidance_scale=3.5,
            num_inference_steps=3, **KW, **args).images
        for t in ("latent", "pil")
    ]  # fmt: skip
    ours = Pipeline.from_pretrained(pipes["pipe"], device="cpu", dtype=dtype, controlnet=nets["instantx"])
    ours.load_ip_adapter(adapter, 0.8, image_encoder=clip)
    got = ours(PROMPTS[0], seed=5, num_steps=3, **KW, **args)
    check_same(got, *want)
    assert got.info["controlnets"] and got.info["ip_adapter"]["scale"] == 0.8


def test_a_step_cached_controlnet_call_under_split_graphs_equals_the_eager_one(folders, monkeypatch):
    """Step caching with a ControlNet that starts acting halfway, on the CPU stand-in for graph recording: each
    (branch, acting set) records its own probe / reuse / rest, the branch's cache carries across them, and the
    latents equal the eager cached call's."""
    from flux_runtime.pipeline.cached_graphs import SplitGraphs
    from scripts.bench_cache import Skips
    from tests.graph_emulator import EmulatedCapture

    pipes, nets = folders
    ours = Pipeline.from_pretrained(
        pipes["pipe"], device="cpu", dtype=torch.float32, controlnet=nets["instantx"]
    )
    args = dict(control_image=control_image(8), control_guidance_start=0.5, cache=Skips(skip=(2, 4)))
    eager = ours(PROMPTS[0], seed=2, num_steps=6, **KW, **args)
    made: list[SplitGraphs] = []
    monkeypatch.setattr(ours, "_graphs_enabled", lambda: True)

    def new_split_graph(fn):
        made.append(SplitGraphs(fn, ours.transformer, EmulatedCapture()))
        return made[-1]

    monkeypatch.setattr(ours, "_new_split_graph", new_split_graph)
    got = ours(PROMPTS[0], seed=2, num_steps=6, **KW, **args)
    assert got.info["cuda_graphs"] is True and torch.equal(got.latents, eager.latents)
    assert got.info["cache"]["computed_steps"] == [0, 1, 3, 5]
    assert len(made) == 2  # idle for steps 0-2, acting for 3-5
    assert [m.replays for m in made] == [{"rest": 1, "reuse": 1}, {"rest": 1, "reuse": 1}]
