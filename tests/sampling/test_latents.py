"""Noise, packing and image ids against FluxPipeline's own `prepare_latents` and static helpers."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline

from flux_runtime.sampling import (
    check_image_size,
    image_ids,
    latent_size,
    num_image_tokens,
    pack,
    prepare_noise,
    unpack,
)
from tests.sampling.diffusers_refs import (
    CPU,
    SIZES,
    generator_list_matches_prepare_latents,
    noise_matches_prepare_latents,
)


def test_latent_size() -> None:
    assert latent_size(1024, 1024) == (128, 128)
    assert latent_size(1024, 768) == (128, 96)
    assert latent_size(16, 32) == (2, 4)
    assert num_image_tokens(1024, 1024) == 4096
    assert num_image_tokens(512, 512) == 1024
    assert num_image_tokens(768, 1360) == 48 * 85


@pytest.mark.parametrize(
    ("height", "width", "message"),
    [
        (1000, 1024, "height 1000 is not divisible by 16"),
        (1024, 1000, "width 1000 is not divisible by 16"),
        (8, 16, "height 8 is not divisible by 16"),
        (0, 16, "height 0 must be a positive integer"),
        (-16, 16, "height -16 must be a positive integer"),
        (512.0, 512, "height 512.0 must be a positive integer"),
    ],
)
def test_check_image_size(height, width, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_image_size(height, width)
    with pytest.raises(ValueError, match=message):
        latent_size(height, width)
    with pytest.raises(ValueError, match=message):
        prepare_noise(1, height, width, seed=0, dtype=torch.float32)


def test_check_image_size_follows_vae_scale_factor() -> None:
    check_image_size(1000, 1000, vae_scale_factor=4)
    with pytest.raises(ValueError, match="height 1004 is not divisible by 8"):
        check_image_size(1004, 1000, vae_scale_factor=4)
    assert latent_size(1000, 1000, vae_scale_factor=4) == (250, 250)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("height", "width"), SIZES)
def test_noise_matches_prepare_latents(
    bare_pipe: FluxPipeline, dtype, batch: int, height: int, width: int
) -> None:
    noise, _, ref_ids = noise_matches_prepare_latents(
        bare_pipe, 16, prepare_noise, pack, batch, height, width, dtype, seed=1234 + batch
    )
    h, w = latent_size(height, width)
    assert noise.shape == (batch, 16, h, w)
    assert torch.equal(image_ids(h, w, dtype=dtype, device=CPU), ref_ids)


@pytest.mark.parametrize("num_generators", [1, 3])
def test_generator_list_matches_prepare_latents(bare_pipe: FluxPipeline, num_generators: int) -> None:
    # a list gives each image its own seed: image k equals a batch of one drawn from seed k
    generator_list_matches_prepare_latents(bare_pipe, 16, prepare_noise, pack, [7, 8, 9][:num_generators])


def test_noise_is_moved_to_device() -> None:
    noise = prepare_noise(2, 256, 256, seed=0, dtype=torch.bfloat16, device="meta")
    assert noise.device.type == "meta" and noise.shape == (2, 16, 32, 32) and noise.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "pass exactly one of seed or generator"),
        (dict(seed=0, generator=torch.Generator()), "pass exactly one of seed or generator"),
        (dict(generator=[torch.Generator(), torch.Generator()]), "got 2 generators for a batch of 3"),
        (dict(seed=1.5), "seed 1.5 must be an integer"),
    ],
)
def test_noise_argument_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prepare_noise(3, 256, 256, dtype=torch.float32, **kwargs)
    with pytest.raises(ValueError, match="batch 0 must be a positive integer"):
        prepare_noise(0, 256, 256, seed=0, dtype=torch.float32)


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_pack_unpack_match_diffusers(height: int, width: int) -> None:
    h, w = latent_size(height, width)
    x = torch.randn(2, 16, h, w, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tokens = pack(x)
    assert tokens.shape == (2, (h // 2) * (w // 2), 64)
    assert torch.equal(tokens, FluxPipeline._pack_latents(x, 2, 16, h, w))
    back = unpack(tokens, h, w)
    assert torch.equal(back, FluxPipeline._unpack_latents(tokens, height, width, 8))
    assert torch.equal(back, x)


def test_pack_layout() -> None:
    """Token n = i·(w/2) + j, channel c·4 + dy·2 + dx, checked element by element."""
    b, c, h, w = 2, 3, 4, 6
    x = torch.arange(b * c * h * w, dtype=torch.float32).reshape(b, c, h, w)
    tokens = pack(x)
    for i in range(h // 2):
        for j in range(w // 2):
            for ch in range(c):
                for dy in range(2):
                    for dx in range(2):
                        got = tokens[:, i * (w // 2) + j, ch * 4 + dy * 2 + dx]
                        assert torch.equal(got, x[:, ch, 2 * i + dy, 2 * j + dx])


def test_pack_unpack_errors() -> None:
    with pytest.raises(ValueError, match=r"pack: expected latents \(B, C, h, w\), got shape \(16, 8, 8\)"):
        pack(torch.zeros(16, 8, 8))
    with pytest.raises(ValueError, match="pack: latent grid 7x8 must have even sides"):
        pack(torch.zeros(1, 16, 7, 8))
    with pytest.raises(ValueError, match=r"unpack: expected tokens \(B, 16, 4C\) for a 8x8 latent grid"):
        unpack(torch.zeros(1, 12, 64), 8, 8)
    with pytest.raises(ValueError, match="unpack: latent grid 8x9 must have even sides"):
        unpack(torch.zeros(1, 16, 64), 8, 9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("h", "w"), [(2, 2), (64, 32), (1024, 8)])
def test_image_ids_match_diffusers(dtype, h: int, w: int) -> None:
    ids = image_ids(h, w, dtype=dtype)
    ref = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, CPU, dtype)
    assert ids.shape == ((h // 2) * (w // 2), 3) and ids.dtype == dtype
    assert torch.equal(ids, ref)
    n = 5 * (w // 2) + 1 if h > 10 else 0
    assert ids[n].tolist() == ([0.0, 5.0, 1.0] if h > 10 else [0.0, 0.0, 0.0])


def test_image_ids_round_like_diffusers_past_256_patches() -> None:
    """512 patch rows: bf16 cannot hold 257 exactly, and neither does diffusers."""
    ids = image_ids(1024, 2, dtype=torch.bfloat16)
    assert ids[257, 1].item() == 256.0
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(1, 512, 1, CPU, torch.bfloat16))
    with pytest.raises(ValueError, match="image_ids: latent grid 3x4 must have even sides"):
        image_ids(3, 4, dtype=torch.float32)
