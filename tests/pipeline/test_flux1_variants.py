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


@pytest.fixture(scope="module")
def kontext_folder(dev_folder, tmp_path_factory):
    """The tiny dev components saved by diffusers as a FluxKontextPipeline (its model_index.json names it)."""
    from diffusers import FluxKontextPipeline

    folder = tmp_path_factory.mktemp("kontext") / "FLUX.1-Kontext-tiny"
    FluxKontextPipeline.from_pretrained(dev_folder).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kontext_equals_diffusers(kontext_folder, dtype):
    from diffusers import FluxKontextPipeline

    ref = FluxKontextPipeline.from_pretrained(kontext_folder, dtype=dtype)
    ours = Pipeline.from_pretrained(kontext_folder, device="cpu", dtype=dtype)
    assert ours.variant == "kontext"
    image = _image(41, 30, seed=4)  # rounded down to 40x28 (multiples of 2f), as diffusers does
    kw = dict(image=image, height=32, width=48, max_area=32 * 48, max_sequence_length=16)
    lat, pil = _both(ref, prompt=PROMPTS, _auto_resize=False, num_inference_steps=3, guidance_scale=2.5, **kw)
    got = ours(PROMPTS, auto_resize=False, seed=5, num_steps=3, guidance=2.5, **kw)
    _same(got, lat, pil)
    assert got.info["variant"] == "kontext" and got.info["reference_size"] == [28, 40]
    assert got.info["auto_resize"] is False and "image" in got.info["input_images"]


def test_kontext_true_cfg_and_max_area_equal_diffusers(kontext_folder):
    from diffusers import FluxKontextPipeline

    ref = FluxKontextPipeline.from_pretrained(kontext_folder, dtype=torch.bfloat16)
    ours = Pipeline.from_pretrained(kontext_folder, device="cpu", dtype=torch.bfloat16)
    image = _image(24, 36, seed=6)
    # 40x40 asked at 24² pixels: the output is rescaled to 24x24, as diffusers does
    kw = dict(image=image, height=40, width=40, max_area=24 * 24, max_sequence_length=16)
    cfg = dict(negative_prompt="blurry", true_cfg_scale=3.0)
    lat, pil = _both(ref, prompt=PROMPTS[0], _auto_resize=False, num_inference_steps=2, **cfg, **kw)
    got = ours(PROMPTS[0], auto_resize=False, seed=5, num_steps=2, **cfg, **kw)
    _same(got, lat, pil)
    assert got.images[0].size == (24, 24)


def test_kontext_resolution_is_diffusers_choice():
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    from flux_runtime.pipeline.flux1_variants import KONTEXT_RESOLUTIONS, kontext_resolution

    assert list(KONTEXT_RESOLUTIONS) == PREFERRED_KONTEXT_RESOLUTIONS
    for w, h in [(1024, 1024), (100, 300), (300, 100), (4000, 16), (1000, 999), (1260, 840), (640, 480)]:
        aspect = w / h
        _, want_w, want_h = min((abs(aspect - pw / ph), pw, ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
        assert kontext_resolution(w, h) == (want_w, want_h)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(image=_image(400, 2, 0)), "image is 400x2: too extreme an aspect ratio"),
        (
            dict(image=_image(32, 32, 0), mask_image=_image(32, 32, 0, "L")),
            "Kontext checkpoint: it takes no mask_image",
        ),
        (dict(image=_image(32, 32, 0), strength=0.5), "it takes no strength"),
        (dict(height=4, width=4096, max_area=64 * 64), "too extreme an aspect ratio for Kontext"),
        (dict(max_area=0), "max_area 0 must be"),
    ],
)
def test_kontext_inputs_are_checked_before_any_model_work(kontext_folder, kwargs, message, monkeypatch):
    pipe = Pipeline.from_pretrained(kontext_folder, device="cpu", dtype=torch.float32)
    _no_models(pipe, monkeypatch)
    with pytest.raises(FluxError, match=message):
        pipe(**{"prompt": "a cat", "max_area": 32 * 32, **kwargs})


def test_max_area_needs_kontext(dev_folder):
    pipe = Pipeline.from_pretrained(dev_folder, device="cpu", dtype=torch.float32)
    with pytest.raises(FluxError, match="max_area is a Kontext setting"):
        pipe("a cat", height=32, width=32, max_area=1024)


def _no_models(pipe, monkeypatch) -> None:
    def boom(*a, **k):
        raise AssertionError("a model ran before validation")

    for obj, name in ((pipe.text_encoder, "encode"), (pipe.transformer, "forward"), (pipe.vae, "encode")):
        monkeypatch.setattr(obj, name, boom)


def _save_variant(dev_folder, folder, pipeline_class: str, in_channels: int):
    """The tiny dev components with a transformer `in_channels` wide, saved by diffusers as `pipeline_class`."""
    import inspect

    import diffusers
    from diffusers import FluxPipeline

    from tests.flux1_fixtures import make_diffusers_transformer

    cls = getattr(diffusers, pipeline_class)
    wanted = inspect.signature(cls.__init__).parameters
    components = {k: v for k, v in FluxPipeline.from_pretrained(dev_folder).components.items() if k in wanted}
    components["transformer"] = make_diffusers_transformer(
        True, seed=7, in_channels=in_channels, out_channels=64
    )
    cls(**components).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def fill_folder(dev_folder, tmp_path_factory):
    """FluxFillPipeline on tiny components: img_in 8z + 4f² = 144 wide (z 16 latents, f 2), out 64."""
    return _save_variant(
        dev_folder, tmp_path_factory.mktemp("fill") / "FLUX.1-Fill-tiny", "FluxFillPipeline", 144
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fill_equals_diffusers(fill_folder, dtype):
    from diffusers import FluxFillPipeline

    ref = FluxFillPipeline.from_pretrained(fill_folder, dtype=dtype)
    ours = Pipeline.from_pretrained(fill_folder, device="cpu", dtype=dtype)
    assert ours.variant == "fill"
    image, mask = _image(40, 24, seed=2), _image(40, 24, seed=3, mode="L")  # resized to 48x32
    kw = dict(image=image, mask_image=mask, height=32, width=48, max_sequence_length=16)
    lat, pil = _both(ref, prompt=PROMPTS, num_inference_steps=3, guidance_scale=30.0, **kw)
    got = ours(PROMPTS, seed=5, num_steps=3, guidance=30.0, **kw)
    _same(got, lat, pil)
    assert got.info["variant"] == "fill" and set(got.info["input_images"]) == {"image", "mask_image"}


def test_fill_strength_equals_diffusers(fill_folder):
    from diffusers import FluxFillPipeline

    ref = FluxFillPipeline.from_pretrained(fill_folder, dtype=torch.bfloat16)
    ours = Pipeline.from_pretrained(fill_folder, device="cpu", dtype=torch.bfloat16)
    kw = dict(image=_image(32, 32, seed=8), mask_image=_image(32, 32, seed=9, mode="L"), strength=0.6)
    kw.update(height=32, width=32, max_sequence_length=16)
    lat, pil = _both(ref, prompt=PROMPTS[0], num_inference_steps=4, **kw)
    got = ours(PROMPTS[0], seed=5, num_steps=4, **kw)
    _same(got, lat, pil)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(image=_image(32, 32, 0)), "Fill checkpoint: give an image and a mask_image"),
        (dict(mask_image=_image(32, 32, 0, "L")), "Fill checkpoint: give an image and a mask_image"),
        (dict(image=_image(32, 32, 0), mask_image=_image(16, 32, 0, "L")), "mask_image is 16x32"),
        (
            dict(image=_image(32, 32, 0), mask_image=_image(32, 32, 0, "L"), control_image=_image(32, 32, 0)),
            "Fill checkpoint: it takes no control_image",
        ),
    ],
)
def test_fill_inputs_are_checked_before_any_model_work(fill_folder, kwargs, message, monkeypatch):
    pipe = Pipeline.from_pretrained(fill_folder, device="cpu", dtype=torch.float32)
    _no_models(pipe, monkeypatch)
    with pytest.raises(FluxError, match=message):
        pipe(**{"prompt": "a cat", "height": 32, "width": 32, **kwargs})


@pytest.fixture(scope="module")
def control_folder(dev_folder, tmp_path_factory):
    """FluxControlPipeline on tiny components: img_in 8z = 128 wide (the noisy and the control latents)."""
    return _save_variant(
        dev_folder, tmp_path_factory.mktemp("control") / "FLUX.1-Depth-tiny", "FluxControlPipeline", 128
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_control_equals_diffusers(control_folder, dtype):
    from diffusers import FluxControlPipeline

    ref = FluxControlPipeline.from_pretrained(control_folder, dtype=dtype)
    ours = Pipeline.from_pretrained(control_folder, device="cpu", dtype=dtype)
    assert ours.variant == "control"
    control = _image(40, 24, seed=10)  # a depth map / edge image, resized to 48x32
    kw = dict(control_image=control, height=32, width=48, max_sequence_length=16)
    lat, pil = _both(ref, prompt=PROMPTS, num_inference_steps=3, guidance_scale=10.0, **kw)
    got = ours(PROMPTS, seed=5, num_steps=3, guidance=10.0, **kw)
    _same(got, lat, pil)
    assert got.info["variant"] == "control" and set(got.info["input_images"]) == {"control_image"}


def test_control_generators_and_true_cfg_equal_diffusers(control_folder):
    from diffusers import FluxControlPipeline

    ref = FluxControlPipeline.from_pretrained(control_folder, dtype=torch.bfloat16)
    ours = Pipeline.from_pretrained(control_folder, device="cpu", dtype=torch.bfloat16)
    kw = dict(control_image=_image(32, 32, seed=11), height=32, width=32, max_sequence_length=16)
    want = ref(
        prompt=PROMPTS[0], generator=[torch.Generator().manual_seed(s) for s in (1, 2)],
        num_images_per_prompt=2, num_inference_steps=2, output_type="latent", **kw,
    ).images  # fmt: skip
    got = ours(
        PROMPTS[0], generator=[torch.Generator().manual_seed(s) for s in (1, 2)], num_images_per_prompt=2,
        num_steps=2, output_type="latent", **kw,
    )  # fmt: skip
    assert torch.equal(got.images, want)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "Depth / Canny checkpoint: give a control_image"),
        (dict(control_image=_image(32, 32, 0), image=_image(32, 32, 0)), "it takes no image"),
        (dict(control_image=_image(32, 32, 0), strength=0.5), "it takes no strength"),
        (dict(control_image=np.zeros((32, 32, 3))), "control_image must be a PIL image"),
    ],
)
def test_control_inputs_are_checked_before_any_model_work(control_folder, kwargs, message, monkeypatch):
    pipe = Pipeline.from_pretrained(control_folder, device="cpu", dtype=torch.float32)
    _no_models(pipe, monkeypatch)
    with pytest.raises(FluxError, match=message):
        pipe(**{"prompt": "a cat", "height": 32, "width": 32, **kwargs})


@pytest.mark.slow
def test_kontext_auto_resize_equals_diffusers(tmp_path):
    """`auto_resize`: a 60x40 image goes to the preferred 1248x832 (4056 reference tokens with an 8x VAE)."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    from tests.weights.vae_fixtures import make_diffusers_vae

    base = _save_pipeline(tmp_path / "dev", True)
    parts = FluxPipeline.from_pretrained(base).components
    parts["vae"] = make_diffusers_vae(block_out_channels=(32, 32, 32, 32))
    FluxKontextPipeline(**{k: v for k, v in parts.items() if "image_encoder" not in k}).save_pretrained(
        tmp_path / "kontext"
    )
    ref = FluxKontextPipeline.from_pretrained(tmp_path / "kontext", dtype=torch.bfloat16)
    ours = Pipeline.from_pretrained(tmp_path / "kontext", device="cpu", dtype=torch.bfloat16)
    kw = dict(image=_image(60, 40, seed=12), height=32, width=48, max_area=32 * 48, max_sequence_length=16)
    want = ref(
        prompt=PROMPTS[0], generator=torch.Generator().manual_seed(5), num_inference_steps=2,
        output_type="latent", **kw,
    ).images  # fmt: skip
    got = ours(PROMPTS[0], seed=5, num_steps=2, output_type="latent", **kw)
    assert torch.equal(got.images, want)
    assert got.info["reference_size"] == [832, 1248] and got.info["auto_resize"] is True
