"""Reference images: preprocessing, encoding and ids against Flux2Pipeline's code and `prepare_image_latents`."""

from __future__ import annotations

import re

import pytest
import torch
from diffusers import Flux2Pipeline
from PIL import Image

from flux_runtime.sampling import (
    check_reference_image,
    encode_reference_images,
    flux2_image_ids,
    latent_bn_stats,
    preprocess_reference_images,
    reference_time,
)
from tests.sampling.diffusers_refs import CPU
from tests.sampling.flux2_helpers import bare_flux2_pipe, random_image, tiny_flux2_vae


def diffusers_preprocess(pipe: Flux2Pipeline, images: list[Image.Image]) -> list[torch.Tensor]:
    """Flux2Pipeline.__call__ step 4 ("process images"), copied line for line."""
    for img in images:
        pipe.image_processor.check_image_input(img)
    condition_images = []
    for img in images:
        image_width, image_height = img.size
        if image_width * image_height > 1024 * 1024:
            img = pipe.image_processor._resize_to_target_area(img, 1024 * 1024)
            image_width, image_height = img.size
        multiple_of = pipe.vae_scale_factor * 2
        image_width = (image_width // multiple_of) * multiple_of
        image_height = (image_height // multiple_of) * multiple_of
        img = pipe.image_processor.preprocess(img, height=image_height, width=image_width, resize_mode="crop")
        condition_images.append(img)
    return condition_images


@pytest.fixture(scope="module")
def pipe() -> Flux2Pipeline:
    return bare_flux2_pipe()


@pytest.mark.parametrize(
    ("width", "height", "expected"),
    [
        (64, 64, (64, 64)),
        (80, 72, (80, 64)),  # crop only: 72 → 64, 4 rows off the top
        (95, 130, (80, 128)),  # odd offsets: left 7, top 1
        (1100, 1000, (1072, 976)),  # > 1024² px: LANCZOS to 1073x976, then crop
        (2900, 400, (2752, 368)),  # aspect 7.25, > 1024² px
    ],
)
def test_preprocess_matches_pipeline(pipe: Flux2Pipeline, width: int, height: int, expected) -> None:
    image = random_image(width, height, seed=width)
    (ours,) = preprocess_reference_images(image)
    (ref,) = diffusers_preprocess(pipe, [image])
    assert ours.shape == (1, 3, expected[1], expected[0]) and ours.dtype == torch.float32
    assert torch.equal(ours, ref)
    assert ours.stride() == ref.stride()  # channels-last memory, as the VAE receives it
    assert ours.min() >= -1 and ours.max() <= 1


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "CMYK"])
def test_preprocess_converts_modes_like_pipeline(pipe: Flux2Pipeline, mode: str) -> None:
    image = random_image(90, 70, seed=1, mode=mode)
    (ours,) = preprocess_reference_images([image])
    (ref,) = diffusers_preprocess(pipe, [image])
    assert ours.shape == (1, 3, 64, 80)
    assert torch.equal(ours, ref)


def test_preprocess_several_images(pipe: Flux2Pipeline) -> None:
    images = [random_image(64, 96, seed=2), random_image(1300, 900, seed=3)]
    ours = preprocess_reference_images(images)
    refs = diffusers_preprocess(pipe, images)
    assert [tuple(t.shape) for t in ours] == [(1, 3, 96, 64), (1, 3, 848, 1216)]
    for a, b in zip(ours, refs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (random_image(63, 100), "reference image 63x100 is too small: both sides must be at least 64 px"),
        (random_image(600, 64), "reference image 600x64 has aspect ratio 9.4; the limit is 8"),
        (torch.zeros(3, 64, 64), "reference image must be a PIL image, got Tensor"),
    ],
)
def test_check_reference_image(pipe: Flux2Pipeline, image, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_reference_image(image)
    with pytest.raises(ValueError, match=message):  # every image is checked before any is processed
        preprocess_reference_images([random_image(64, 64), image])
    with pytest.raises(ValueError):  # diffusers refuses the same image
        pipe.image_processor.check_image_input(image)


def test_aspect_ratio_limit_is_inclusive(pipe: Flux2Pipeline) -> None:
    image = random_image(512, 64)  # exactly 8
    check_reference_image(image)
    pipe.image_processor.check_image_input(image)
    with pytest.raises(ValueError, match="no reference images given"):
        preprocess_reference_images([])


# ---- encoding, tokens and ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("vae_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("sizes", "batch"), [([(64, 80)], 1), ([(64, 80)], 2), ([(96, 64), (64, 64)], 2)])
def test_encode_matches_prepare_image_latents(vae_dtype, sizes, batch: int) -> None:
    vae = tiny_flux2_vae(vae_dtype)
    pipe = bare_flux2_pipe(vae)
    images = preprocess_reference_images([random_image(w, h, seed=w + h) for w, h in sizes])
    with torch.no_grad():
        ref_tokens, ref_ids = pipe.prepare_image_latents(images, batch, None, CPU, vae.dtype)
        mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
        tokens, ids = encode_reference_images(
            images, lambda x: vae.encode(x).latent_dist.mode(), mean, std, batch=batch, dtype=vae.dtype
        )
    n_tokens = sum((w // 16) * (h // 16) for w, h in sizes)
    assert tokens.shape == (batch, n_tokens, 128) and tokens.dtype == vae_dtype
    assert torch.equal(tokens, ref_tokens)
    assert ids.shape == (n_tokens, 4) and ids.dtype == torch.int64 == ref_ids.dtype
    assert ref_ids.shape == (batch, n_tokens, 4)
    for b in range(batch):
        assert torch.equal(ref_ids[b], ids)
    assert tokens[:, 0].abs().sum() > 0


def test_reference_ids_match_prepare_image_ids() -> None:
    """Reference k at time 10 + 10k, its own (i, j) grid from 0, concatenated in order."""
    grids = [(4, 5), (2, 2), (3, 1)]  # patchified (h/2, w/2)
    ref = Flux2Pipeline._prepare_image_ids([torch.zeros(1, 128, a, b) for a, b in grids])
    ours = torch.cat(
        [flux2_image_ids(2 * a, 2 * b, time=reference_time(k)) for k, (a, b) in enumerate(grids)]
    )
    assert ref.shape == (1, *ours.shape)
    assert torch.equal(ref[0], ours)
    assert [reference_time(k) for k in range(3)] == [10, 20, 30]
    assert ours[20].tolist() == [20, 0, 0, 0] and ours[-1].tolist() == [30, 2, 0, 0]


def test_encode_fn_gets_the_vae_dtype_and_layout() -> None:
    seen: list[torch.Tensor] = []

    def encode_fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return torch.ones(1, 32, x.shape[2] // 8, x.shape[3] // 8, dtype=x.dtype)

    images = preprocess_reference_images(random_image(64, 96))
    mean, std = latent_bn_stats(torch.full((128,), 0.5), torch.full((128,), 4.0), 1e-4)
    tokens, ids = encode_reference_images(images, encode_fn, mean, std, batch=3, dtype=torch.bfloat16)
    assert seen[0].dtype == torch.bfloat16 and seen[0].stride() == images[0].stride()
    assert torch.equal(seen[0], images[0].to(torch.bfloat16))
    assert tokens.shape == (3, 24, 128) and ids.shape == (24, 4)
    assert torch.equal(tokens, torch.full_like(tokens, (1 - 0.5) / 2.0))  # normalized


def test_encode_errors() -> None:
    mean, std = latent_bn_stats(torch.zeros(128), torch.ones(128), 1e-4)
    good = torch.zeros(1, 3, 64, 64)
    ok = lambda x: torch.zeros(1, 32, 8, 8)  # noqa: E731
    with pytest.raises(ValueError, match="no reference images given"):
        encode_reference_images([], ok, mean, std, batch=1, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"reference 0 must be \(1, 3, H, W\), got \(3, 64, 64\)"):
        encode_reference_images([good[0]], ok, mean, std, batch=1, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"encode_fn returned shape \(32, 8, 8\) for reference 0"):
        encode_reference_images(
            [good], lambda x: torch.zeros(32, 8, 8), mean, std, batch=1, dtype=torch.float32
        )
    with pytest.raises(ValueError, match="batch 0 must be a positive integer"):
        encode_reference_images([good], ok, mean, std, batch=0, dtype=torch.float32)


def test_a_non_pil_image_is_told_how_to_make_one_and_the_recipe_works() -> None:
    """The message for an array, a tensor or a path names the call that makes a PIL image of it, and that
    call, run as written, gives an image the checks take."""
    import numpy as np
    from PIL import Image

    from flux_runtime.sampling.reference_images import not_pil

    array = np.full((64, 80, 3), 200, dtype=np.uint8)
    t = torch.rand(3, 64, 80)
    for value, name in ((array, "array"), (t, "t")):
        message = not_pil("image", value)
        call = message.split(": pass ")[1].split(" (uint8")[0].split(" for a (3")[0]
        made = eval(
            call, {"PIL": __import__("PIL.Image"), name: value}
        )  # the message's own call, run as written
        assert isinstance(made, Image.Image) and made.size == (80, 64)
        check_reference_image(made)
    assert not_pil("mask_image", "m.png").endswith("got str: pass PIL.Image.open('m.png')")
    assert not_pil("image", 3) == "image must be a PIL image, got int"


@pytest.mark.parametrize("mode", ["I;16", "I", "F"])
def test_pixels_wider_than_8_bits_are_refused_not_clipped(mode: str) -> None:
    """PIL's RGB conversion clips 16- and 32-bit pixels at 255 and truncates floats in [0, 1] to 0: such a
    picture would go in white or black without a word, so it is refused, naming its mode."""
    import numpy as np

    from flux_runtime.sampling.reference_images import wide_pixels

    values = np.linspace(0, 1, 64 * 64, dtype=np.float32).reshape(64, 64)
    image = Image.fromarray(
        values if mode == "F" else (values * 65535).astype(np.uint16 if mode == "I;16" else np.int32)
    )
    if mode != "F":
        image = image if image.mode == mode else image.convert(mode)
    assert image.mode == mode
    flat = np.asarray(image.convert("RGB"))
    assert int(flat.max()) - int(flat.min()) <= 1 or (flat == 255).mean() > 0.9  # what the model would get
    with pytest.raises(
        ValueError, match=rf"reference image has {re.escape(mode)} pixels \(more than 8 bits\)"
    ):
        check_reference_image(image)
    assert wide_pixels("image", Image.new("RGB", (8, 8))) is None
    assert wide_pixels("image", Image.new("L", (8, 8))) is None
