"""IP-Adapter parity: our FLUX.1 pipeline with the XLabs IP-Adapter gives diffusers' FluxPipeline bits after its
`load_ip_adapter`, in fp32 and bf16, with and without true CFG; at scale 0 it gives the plain pipeline's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from flux_runtime.pipeline import Pipeline
from tests.ip_adapter.ip_fixtures import picture

KW = dict(height=32, width=48, max_sequence_length=16)
PROMPT = "a red fox in the snow"
CFG = dict(negative_prompt="blurry, dark", true_cfg_scale=2.5)


def _load_diffusers(files: dict, dtype: torch.dtype, pipeline: str = "FluxPipeline") -> Any:
    """diffusers' `pipeline` from the tiny folder with the adapter loaded by its `load_ip_adapter`."""
    import diffusers

    ref = getattr(diffusers, pipeline).from_pretrained(files["pipe"], dtype=dtype)
    ref.load_ip_adapter(
        str(files["adapter"]), weight_name="ip_adapter.safetensors",
        image_encoder_pretrained_model_name_or_path=str(files["clip"]),
    )  # fmt: skip
    return ref


def _run_diffusers(ref: Any, scale: Any, **call: Any) -> tuple[torch.Tensor, list]:
    """diffusers' final latents (caught after the last step) and PIL images at `scale`."""
    ref.set_ip_adapter_scale(scale)
    caught = {}

    def catch(pipe: Any, i: int, t: Any, kwargs: dict) -> dict:
        caught["latents"] = kwargs["latents"]
        return kwargs

    out = ref(
        PROMPT, generator=torch.Generator().manual_seed(42), num_inference_steps=2, guidance_scale=3.5,
        callback_on_step_end=catch, **KW, **call,
    )  # fmt: skip
    return caught["latents"], out.images


def _diffusers(
    files: dict, dtype: torch.dtype, scale: Any, pipeline: str, **call: Any
) -> tuple[torch.Tensor, list]:
    return _run_diffusers(_load_diffusers(files, dtype, pipeline), scale, **call)


@pytest.fixture(scope="module")
def pipes(ip_files: dict) -> dict[torch.dtype, tuple[Any, Pipeline]]:
    """Per dtype: diffusers' FluxPipeline and ours, each with the adapter loaded (the tests set the scale)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ours = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=dtype)
        ours.load_ip_adapter(ip_files["adapter"], image_encoder=ip_files["clip"])
        out[dtype] = (_load_diffusers(ip_files, dtype), ours)
    return out


@pytest.mark.parametrize(
    ("dtype", "scale", "call"),
    [
        (torch.float32, 0.7, {}),
        (torch.float32, [0.3, 1.2], CFG),  # one scale per double block
        (torch.bfloat16, 1.0, {}),
        (torch.bfloat16, 0.7, {**CFG, "negative_ip_adapter_image": picture(9, (30, 30))}),
        (torch.bfloat16, 0.5, {**CFG, "num_images_per_prompt": 2}),
    ],
    ids=["fp32", "fp32-cfg-per-block", "bf16", "bf16-cfg-negative-image", "bf16-cfg-batch2"],
)
def test_equals_diffusers(pipes: dict, dtype: torch.dtype, scale: Any, call: dict) -> None:
    ref, ours = pipes[dtype]
    call = {"ip_adapter_image": picture(1), **call}
    want_latents, want_images = _run_diffusers(ref, scale, **call)

    ours.set_ip_adapter_scale(scale)
    got = ours(PROMPT, seed=42, num_steps=2, guidance=3.5, **KW, **call)
    assert got.latents.dtype == dtype
    assert torch.equal(got.latents, want_latents)
    for g, w in zip(got.images, want_images, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))

    # the image prompt matters: another image gives other latents
    other = ours(
        PROMPT,
        seed=42,
        num_steps=2,
        guidance=3.5,
        output_type="latent",
        **KW,
        **{**call, "ip_adapter_image": picture(7)},
    )
    assert not torch.equal(other.latents, got.latents)


@pytest.mark.parametrize("cfg", [False, True], ids=["plain", "cfg"])
def test_scale_zero_is_the_plain_pipeline(ip_files: dict, cfg: bool) -> None:
    """One image at a time. (In a batch, diffusers' IP-Adapter processor rounds its output projections
    differently from its plain processor on the CPU, at any scale; the batch case above follows it.)"""
    pipe = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=torch.bfloat16)
    call = dict(seed=3, num_steps=2, guidance=3.5, output_type="latent", **KW, **(CFG if cfg else {}))
    plain = pipe(PROMPT, **call).latents
    pipe.load_ip_adapter(ip_files["adapter"], 0.0, image_encoder=ip_files["clip"])
    assert torch.equal(pipe(PROMPT, ip_adapter_image=picture(2), **call).latents, plain)
    pipe.set_ip_adapter_scale(0.8)
    scaled = pipe(PROMPT, ip_adapter_image=picture(2), **call).latents
    assert not torch.equal(scaled, plain)
    pipe.unload_ip_adapter()  # back to the plain pipeline, bit for bit
    assert torch.equal(pipe(PROMPT, **call).latents, plain)


@pytest.mark.parametrize(
    ("pipeline", "dtype", "call"),
    [
        ("FluxImg2ImgPipeline", torch.float32, dict(image=picture(3, (48, 32)), strength=0.7)),
        (
            "FluxInpaintPipeline",
            torch.bfloat16,
            dict(
                image=picture(3, (48, 32)), mask_image=picture(4, (48, 32)).convert("L"), strength=0.8, **CFG
            ),
        ),
    ],
    ids=["img2img", "inpaint-cfg"],
)
def test_img2img_and_inpainting_equal_diffusers(
    ip_files: dict, pipeline: str, dtype: torch.dtype, call: dict
):
    call = {"ip_adapter_image": picture(1), **call}
    want_latents, want_images = _diffusers(ip_files, dtype, 0.8, pipeline, **call)
    ours = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=dtype)
    ours.load_ip_adapter(ip_files["adapter"], 0.8, image_encoder=ip_files["clip"])
    got = ours(PROMPT, seed=42, num_steps=2, guidance=3.5, **KW, **call)
    assert torch.equal(got.latents, want_latents)
    for g, w in zip(got.images, want_images, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))


@pytest.fixture(scope="module")
def kontext(ip_files: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny dev components saved by diffusers as a FluxKontextPipeline, with the same adapter and encoder."""
    from diffusers import FluxKontextPipeline

    folder = tmp_path_factory.mktemp("kontext") / "FLUX.1-Kontext-tiny"
    FluxKontextPipeline.from_pretrained(ip_files["pipe"]).save_pretrained(folder)
    return {**ip_files, "pipe": folder}


@pytest.mark.slow  # diffusers' Kontext pipeline: its import and a second folder
@pytest.mark.parametrize(
    ("dtype", "cfg"), [(torch.float32, {}), (torch.bfloat16, CFG)], ids=["fp32", "bf16-cfg"]
)
def test_kontext_equals_diffusers(kontext: dict, dtype: torch.dtype, cfg: dict) -> None:
    """The image prompt beside Kontext's reference image (whose tokens the image query covers too)."""
    from diffusers import FluxKontextPipeline

    ref = FluxKontextPipeline.from_pretrained(kontext["pipe"], dtype=dtype)
    ref.load_ip_adapter(
        str(kontext["adapter"]), weight_name="ip_adapter.safetensors",
        image_encoder_pretrained_model_name_or_path=str(kontext["clip"]),
    )  # fmt: skip
    ref.set_ip_adapter_scale(0.8)
    kw = dict(
        image=picture(3, (41, 30)), ip_adapter_image=picture(1), height=32, width=48, max_area=32 * 48,
        max_sequence_length=16, **cfg,
    )  # fmt: skip
    want = ref(
        prompt=PROMPT, _auto_resize=False, generator=torch.Generator().manual_seed(5), num_inference_steps=2,
        guidance_scale=2.5, output_type="latent", **kw,
    ).images  # fmt: skip
    ours = Pipeline.from_pretrained(kontext["pipe"], device="cpu", dtype=dtype)
    assert ours.variant == "kontext"
    ours.load_ip_adapter(kontext["adapter"], 0.8, image_encoder=kontext["clip"])
    got = ours(PROMPT, auto_resize=False, seed=5, num_steps=2, guidance=2.5, output_type="latent", **kw)
    assert torch.equal(got.latents, want)
