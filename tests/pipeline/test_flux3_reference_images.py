"""FLUX.3 with reference images: latents (`torch.equal`) and pixels of diffusers' FLUX.3 modular pipeline on the
tiny random folders, for one reference (kept whole on a reflect-padded canvas, cropped back) and two (each
centre-cropped), base (CFG) and flow map, fp32 and bf16; a given size turns the crop-back off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.sampling import flux2_unpack
from tests.pipeline.test_flux3_pipeline import PROMPT, STEPS, _diffusers, _same_images, folders  # noqa: F401


def _image(w: int, h: int, seed: int) -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(-30, 30, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


ONE = [_image(40, 28, seed=1)]  # canvas 64x64 (the minimum side), the image at (12, 18, 52, 46)
TWO = [_image(36, 30, seed=2), _image(20, 44, seed=3)]  # cropped to 36x28 and 20x44


@pytest.mark.parametrize(
    ("name", "refs", "dtype", "n", "size"),
    [
        ("base", ONE, torch.float32, 1, None),
        pytest.param("flow-map", ONE, torch.bfloat16, 1, (32, 48), marks=pytest.mark.slow),
        ("flow-map", TWO, torch.float32, 2, None),
        pytest.param("base", TWO, torch.bfloat16, 1, None, marks=pytest.mark.slow),
    ],
    ids=["base-one-fp32-cropped", "flow-map-one-bf16-sized", "flow-map-two-fp32-n2", "base-two-bf16"],
)
def test_references_equal_diffusers_modular_pipeline(folders, name, refs, dtype, n, size):  # noqa: F811
    flow_map = name == "flow-map"
    kw = {} if size is None else dict(height=size[0], width=size[1])
    ref = _diffusers(folders[name], flow_map, dtype)
    state = ref(
        prompt=PROMPT, image=list(refs) if len(refs) > 1 else refs[0], num_inference_steps=STEPS,
        num_images_per_prompt=n, generator=torch.Generator().manual_seed(7), **kw,
    )  # fmt: skip
    ours = Pipeline.from_pretrained(folders[name], device="cpu", dtype=dtype)
    out = ours(
        PROMPT,
        image=refs if len(refs) > 1 else refs[0],
        num_steps=STEPS,
        num_images_per_prompt=n,
        seed=7,
        **kw,
    )
    want = state.get("latents")  # (B, 128, h/2, w/2)
    got = flux2_unpack(out.latents, 2 * want.shape[-2], 2 * want.shape[-1])
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    _same_images(out.images, state.get("images"))
    info = out.info
    assert [r["sha256"] for r in info["reference_images"]] and len(info["reference_images"]) == len(refs)
    if len(refs) == 1 and size is None:
        assert out.images[0].size == (40, 28) and info["reference_crop"] == [12, 18, 52, 46]
        assert (info["height"], info["width"]) == (64, 64)
    else:
        assert "reference_crop" not in info
        h, w = size or (28, 36)
        assert out.images[0].size == (w, h) and (info["height"], info["width"]) == (h, w)


def test_bad_references_fail_before_any_model_work(folders):  # noqa: F811
    pipe = Pipeline.from_pretrained(folders["base"], device="cpu", dtype=torch.float32)
    with pytest.raises(FluxError, match="at most 10"):
        pipe(PROMPT, image=ONE * 11)
    with pytest.raises(FluxError, match="reference image 0 must be a PIL image, got str"):
        pipe(PROMPT, image=["cat.png"])
    with pytest.raises(FluxError, match="empty list"):
        pipe(PROMPT, image=[])
    with pytest.raises(FluxError, match="with several references each side must be at least 4 px"):
        pipe(PROMPT, image=[ONE[0], _image(3, 40, seed=0)])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["base", "flow-map"])
def test_references_on_cuda_equal_diffusers_and_graph_replays_take_new_references(folders, name):  # noqa: F811
    """bf16 on the GPU, lossless with CUDA graphs: each call equals diffusers' on CUDA, the second (a replay of
    the captured graph) with other references of the same sizes, so the graph must read the new ones."""
    flow_map = name == "flow-map"
    ref = _diffusers(folders[name], flow_map, torch.bfloat16).to("cuda")
    ours = Pipeline.from_pretrained(folders[name], device="cuda", dtype=torch.bfloat16)
    for refs in (TWO, [_image(36, 30, seed=8), _image(20, 44, seed=9)], ONE):
        state = ref(
            prompt=PROMPT, image=refs if len(refs) > 1 else refs[0], num_inference_steps=STEPS,
            generator=torch.Generator("cuda").manual_seed(7),
        )  # fmt: skip
        out = ours(
            PROMPT,
            image=refs,
            num_steps=STEPS,
            generator=torch.Generator("cuda").manual_seed(7),
            output_type="np",
        )
        want = state.get("latents")
        assert out.info["cuda_graphs"] and out.info["quality"] == "lossless"
        assert torch.equal(flux2_unpack(out.latents, 2 * want.shape[-2], 2 * want.shape[-1]), want)
        want_images = np.stack([np.asarray(im) for im in state.get("images")])
        assert np.array_equal(out.images, want_images)
