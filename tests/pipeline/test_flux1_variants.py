"""FLUX.1 variants on the pipeline core: true CFG, img2img and inpainting give diffusers' bits on a tiny
FluxPipeline folder diffusers saved (its img2img and inpaint pipelines open the same folder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flux_runtime.pipeline import FluxError, Pipeline
from tests.pipeline.test_flux1_pipeline import PROMPTS, _save_pipeline

KW = dict(height=32, width=48, max_sequence_length=16)


@pytest.fixture(scope="module")
def dev_folder(tmp_path_factory):
    return _save_pipeline(tmp_path_factory.mktemp("variants") / "FLUX.1-tiny", True)


def _image(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "L": 1}[mode]
    array = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    return Image.fromarray(array[..., 0] if channels == 1 else array, mode)


def _same(got, want_latents, want_images) -> None:
    assert torch.equal(got.latents, want_latents)
    for g, w in zip(got.images, want_images, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))


def _both(ref, **kw):
    lat = ref(generator=torch.Generator().manual_seed(5), output_type="latent", **kw).images
    pil = ref(generator=torch.Generator().manual_seed(5), output_type="pil", **kw).images
    return lat, pil


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_true_cfg_equals_diffusers(dev_folder, dtype):
    from diffusers import FluxPipeline

    ref = FluxPipeline.from_pretrained(dev_folder, dtype=dtype)
    ours = Pipeline.from_pretrained(dev_folder, device="cpu", dtype=dtype)
    neg = ["blurry", "low quality"]
    lat, pil = _both(
        ref,
        prompt=PROMPTS,
        negative_prompt=neg,
        true_cfg_scale=4.0,
        num_inference_steps=3,
        guidance_scale=3.5,
        **KW,
    )
    got = ours(PROMPTS, negative_prompt=neg, true_cfg_scale=4.0, seed=5, num_steps=3, **KW)
    _same(got, lat, pil)
    assert got.info["true_cfg_scale"] == 4.0 and got.info["negative_prompt"] == neg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_img2img_equals_diffusers(dev_folder, dtype):
    from diffusers import FluxImg2ImgPipeline

    ref = FluxImg2ImgPipeline.from_pretrained(dev_folder, dtype=dtype)
    ours = Pipeline.from_pretrained(dev_folder, device="cpu", dtype=dtype)
    image = _image(40, 24, seed=1)  # resized to 48x32, as diffusers does
    lat, pil = _both(
        ref, prompt=PROMPTS, image=image, strength=0.7, num_inference_steps=4, guidance_scale=3.5, **KW
    )
    got = ours(PROMPTS, image=image, strength=0.7, seed=5, num_steps=4, **KW)
    _same(got, lat, pil)
    assert got.info["strength"] == 0.7 and len(got.info["input_images"]["image"]["sha256"]) == 64


def test_inpainting_equals_diffusers(dev_folder):
    from diffusers import FluxInpaintPipeline

    dtype = torch.bfloat16
    ref = FluxInpaintPipeline.from_pretrained(dev_folder, dtype=dtype)
    ours = Pipeline.from_pretrained(dev_folder, device="cpu", dtype=dtype)
    image, mask = _image(48, 32, seed=2), _image(48, 32, seed=3, mode="L")
    lat, pil = _both(
        ref, prompt=PROMPTS[0], image=image, mask_image=mask, strength=0.8, num_inference_steps=4,
        guidance_scale=3.5, **KW,
    )  # fmt: skip
    got = ours(PROMPTS[0], image=image, mask_image=mask, strength=0.8, seed=5, num_steps=4, **KW)
    _same(got, lat, pil)
    assert set(got.info["input_images"]) == {"image", "mask_image"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(image=_image(32, 32, 0), strength=0.0), r"strength 0.0 must be in \(0, 1\]"),
        (dict(image=_image(32, 32, 0), strength=1.5), r"strength 1.5 must be in \(0, 1\]"),
        (dict(strength=0.5), "strength needs an image"),
        (dict(mask_image=_image(32, 32, 0, "L")), "mask_image needs an image"),
        (
            dict(image=_image(32, 32, 0), mask_image=_image(16, 32, 0, "L")),
            "mask_image is 16x32 but image is 32x32",
        ),
        (dict(image=_image(32, 32, 0), mask_image=Image.new("CMYK", (32, 32))), "mask_image has mode CMYK"),
        (dict(control_image=_image(32, 32, 0)), "control_image needs a Depth or Canny checkpoint"),
        (dict(image=_image(32, 32, 0), strength=1e-18, num_steps=4), "leaves no step to run"),
        (dict(true_cfg_scale=0.5, negative_prompt="x"), "true_cfg_scale 0.5 must be a finite number >= 1"),
        (dict(negative_prompt=["a", "b"]), "negative_prompt has 2 prompts for 1 prompts"),
    ],
)
def test_variant_inputs_are_checked_before_any_model_work(kwargs, message, monkeypatch):
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)

    def boom(*a, **k):
        raise AssertionError("a model ran before validation")

    for obj, name in ((pipe.text_encoder, "encode"), (pipe.transformer, "forward"), (pipe.vae, "encode")):
        monkeypatch.setattr(obj, name, boom)
    with pytest.raises(FluxError, match=message):
        pipe(**{"prompt": "a cat", "height": 32, "width": 32, **kwargs})
