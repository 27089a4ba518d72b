"""FLUX.3 pipeline parity: a tiny random FLUX.3 folder (transformer, FLUX.2 VAE, Qwen3-VL, scheduler and guider
configs), opened with our `Pipeline.from_pretrained`, gives the latents (`torch.equal`) and pixels of diffusers'
FLUX.3 modular pipeline (`Flux3AutoBlocks` / `Flux3DistilledAutoBlocks` without the prompt upsampler) loaded from
the same folder, for base (CFG) and flow-map (distilled) transformers, fp32 and bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.pipeline.flux3 import Flux3Pipe
from flux_runtime.registry import MODEL_IDS
from flux_runtime.sampling import flux2_unpack
from flux_runtime.text.flux3 import Flux3TextEncoder
from tests.flux3_fixtures import make_diffusers_flux3, save_diffusers
from tests.text.test_flux3_text import text_only_processor
from tests.weights.vae_fixtures import make_diffusers_flux2_vae

PROMPT = "a red fox in the snow"
KW = dict(height=32, width=48)  # the tiny VAE is 2x: a 16x24 latent, 8x12 = 96 tokens
STEPS = 2


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny FLUX.3 folders in diffusers' component layout, base and flow map."""
    return build_folders(tmp_path_factory.mktemp("flux3-pipelines"))


def build_folders(root: Path) -> dict[str, Path]:
    """Tiny FLUX.3 folders under `root` in diffusers' component layout, base and flow map (also the GGUF tests')."""
    text = Flux3TextEncoder.tiny(seed=5)
    out = {}
    for name, flow_map in (("base", False), ("flow-map", True)):
        folder = root / name
        save_diffusers(make_diffusers_flux3(flow_map, seed=4), folder / "transformer")
        make_diffusers_flux2_vae(seed=2).save_pretrained(folder / "vae")
        text.model.save_pretrained(folder / "text_encoder")
        text.tokenizer.save_pretrained(folder / "tokenizer")
        (folder / "tokenizer" / "chat_template.jinja").write_text(text.chat_template)
        (folder / "scheduler").mkdir()
        scheduler = {
            "_class_name": "FlowMatchEulerDiscreteScheduler",
            "shift": 6.93,
            "num_train_timesteps": 1000,
        }
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
        (folder / "guider").mkdir()
        guider = {"_class_name": "ClassifierFreeGuidance", "guidance_scale": 3.5}
        (folder / "guider" / "guider_config.json").write_text(json.dumps(guider))
        out[name] = folder
    return out


def _diffusers(folder: Path, flow_map: bool, dtype: torch.dtype, guidance: float = 3.5):
    """diffusers' modular FLUX.3 pipeline on the folder's parts, each loaded by its own from_pretrained."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux3Transformer2DModel
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.modular_pipelines.flux3 import Flux3AutoBlocks, Flux3DistilledAutoBlocks
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
    from transformers import Qwen3VLForConditionalGeneration

    blocks = Flux3DistilledAutoBlocks() if flow_map else Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline()
    text = Flux3TextEncoder.from_pretrained(
        folder, dtype=dtype
    )  # the tokenizer and template, for the processor
    parts = dict(
        transformer=Flux3Transformer2DModel.from_pretrained(folder / "transformer", torch_dtype=dtype),
        vae=AutoencoderKLFlux2.from_pretrained(folder / "vae", torch_dtype=dtype),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(folder / "text_encoder", dtype=dtype),
        tokenizer=text_only_processor(text),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler"),
        image_processor=Flux3ImageProcessor(vae_scale_factor=4),
    )
    if not flow_map:
        parts["guider"] = ClassifierFreeGuidance(guidance_scale=guidance)
    pipe.update_components(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _same_images(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        a = np.asarray(g)
        assert g.size == w.size and np.array_equal(a, np.asarray(w))
        assert len(np.unique(a)) > 10  # a real picture, not a constant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("name", "guidance", "n"),
    [("base", None, 1), ("base", 1.0, 1), ("flow-map", None, 2)],
    ids=["base-cfg", "base-guidance-1", "flow-map-two-images"],
)
def test_images_equal_diffusers_modular_pipeline(folders, dtype, name, guidance, n):
    if name == "base" and guidance == 1.0 and dtype == torch.bfloat16:
        pytest.skip("covered in fp32; keeps the suite fast")
    flow_map = name == "flow-map"
    ref = _diffusers(folders[name], flow_map, dtype, 3.5 if guidance is None else guidance)
    state = ref(
        prompt=PROMPT, num_inference_steps=STEPS, num_images_per_prompt=n,
        generator=torch.Generator().manual_seed(7), **KW,
    )  # fmt: skip
    ours = Pipeline.from_pretrained(folders[name], device="cpu", dtype=dtype)
    assert isinstance(ours, Flux3Pipe) and ours.is_flow_map is flow_map and ours.default_guidance == 3.5
    out = ours(PROMPT, num_steps=STEPS, guidance=guidance, num_images_per_prompt=n, seed=7, **KW)
    want = state.get("latents")  # (B, 128, h/2, w/2)
    got = flux2_unpack(out.latents, 16, 24)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    _same_images(out.images, state.get("images"))
    assert out.info["guidance"] == (None if flow_map else 3.5 if guidance is None else guidance)
    assert out.info["num_steps"] == STEPS and out.info["model"] == str(folders[name])


def test_builtin_model_and_defaults():
    pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    assert isinstance(pipe, Flux3Pipe) and not pipe.is_flow_map
    assert pipe.default_steps == 50 and pipe.default_size == 128 and pipe.schedule.shift == 6.93
    out = pipe(PROMPT, num_steps=1, height=32, width=32, output_type="np")
    assert out.images.shape == (1, 32, 32, 3) and out.info["guidance"] == 3.5
    assert out.info["weights"] == "tiny-flux3-seed0"
    assert MODEL_IDS["flux3-klein"] == "black-forest-labs/flux-3-image-klein"
    assert MODEL_IDS["flux3-klein-base"] == "black-forest-labs/flux-3-image-klein-base"


def test_bad_calls_fail_before_any_model_work():
    pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    with pytest.raises(FluxError, match="one prompt"):
        pipe(["a", "b"])
    with pytest.raises(FluxError, match="height 42 is not divisible by 4"):  # the tiny VAE is 2x
        pipe(PROMPT, height=42, width=32)
    with pytest.raises(FluxError, match=r"max_sequence_length 9000 must be in 1\.\.8192"):
        pipe(PROMPT, max_sequence_length=9000)
    with pytest.raises(FluxError, match=r"not FLUX\.3 settings"):
        Pipeline.from_pretrained("tiny-flux3-random", device="cpu", is_distilled=True)


@pytest.mark.parametrize("name", ["base", "flow-map"])
def test_base_model_runs_its_text_and_reference_streams_once_per_generation(folders, name):
    """The base model's text and reference tokens see t = 0 at every step: their per-mode blocks run once per
    CFG branch and generation (the images above equal diffusers', which recomputes them every step). A flow
    map embeds each step's target time into them, so it runs them every step."""
    from PIL import Image

    ours = Pipeline.from_pretrained(folders[name], device="cpu", dtype=torch.float32)
    t = ours.transformer
    calls = {"txt": 0, "ref": 0, "image": 0}
    hooks = [
        t.txt_mode_blocks[0].register_forward_hook(lambda *_: calls.__setitem__("txt", calls["txt"] + 1)),
        t.content_mode_blocks["image_cond"][0].register_forward_hook(
            lambda *_: calls.__setitem__("ref", calls["ref"] + 1)
        ),
        t.content_mode_blocks["image"][0].register_forward_hook(
            lambda *_: calls.__setitem__("image", calls["image"] + 1)
        ),
    ]
    steps = 3
    ref = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 48, 3), dtype=np.uint8))
    ours(PROMPT, image=[ref], num_steps=steps, seed=1, output_type="latent", **KW)
    for h in hooks:
        h.remove()
    branches = 1 if name == "flow-map" else 2  # the base model's CFG: conditional and unconditional
    assert calls["image"] == steps * branches
    per_step = steps * branches if name == "flow-map" else branches
    assert calls["txt"] == per_step and calls["ref"] == per_step


def test_tiny_flux3_is_built_in() -> None:
    """`tiny-flux3`, the name the built-in tiny FLUX.3 goes by, runs offline: for now the seeded random
    weights of `tiny-flux3-random` (no trained tiny FLUX.3 ships), and its record says so."""
    kw = dict(num_steps=2, height=32, width=32, output_type="latent", seed=1)
    named = Pipeline.from_pretrained("tiny-flux3", device="cpu", dtype=torch.float32)("a cat", **kw)
    random = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)("a cat", **kw)
    assert torch.equal(named.latents, random.latents)
    assert named.info["model"] == "tiny-flux3" and named.info["weights"] == "tiny-flux3-seed0"
