"""FLUX.2 noise, tokens, ids and BatchNorm normalization against Flux2Pipeline's own methods and lines."""

from __future__ import annotations

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from flux_runtime.sampling import (
    FLUX2_TOKEN_CHANNELS,
    bn_denormalize,
    bn_normalize,
    flux2_image_ids,
    flux2_pack,
    flux2_prepare_noise,
    flux2_text_ids,
    flux2_unpack,
    klein_uses_cfg,
    latent_bn_stats,
    latent_size,
    num_image_tokens,
    patchify,
    unpatchify,
)
from tests.sampling.diffusers_refs import (
    SIZES,
    generator_list_matches_prepare_latents,
    noise_matches_prepare_latents,
)
from tests.sampling.flux2_helpers import bare_flux2_pipe, bare_klein_pipe, tiny_flux2_vae


@pytest.fixture(scope="module")
def pipe() -> Flux2Pipeline:
    return bare_flux2_pipe()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("height", "width"), SIZES)
def test_noise_matches_prepare_latents(
    pipe: Flux2Pipeline, dtype, batch: int, height: int, width: int
) -> None:
    # num_latents_channels = transformer.config.in_channels // 4 = 32
    noise, ref, ref_ids = noise_matches_prepare_latents(
        pipe, 32, flux2_prepare_noise, flux2_pack, batch, height, width, dtype, seed=99 + batch
    )
    h, w = latent_size(height, width)
    assert noise.shape == (batch, FLUX2_TOKEN_CHANNELS, h // 2, w // 2)
    tokens = flux2_pack(noise)
    assert tokens.shape == (batch, num_image_tokens(height, width), 128)
    assert tokens.stride() == ref.stride()  # the same transposed view the transformer first sees
    ids = flux2_image_ids(h, w)
    assert ids.dtype == ref_ids.dtype == torch.int64
    assert ref_ids.shape == (batch, *ids.shape)
    for b in range(batch):
        assert torch.equal(ref_ids[b], ids)


@pytest.mark.parametrize("num_generators", [1, 3])
def test_generator_list_matches_prepare_latents(pipe: Flux2Pipeline, num_generators: int) -> None:
    generator_list_matches_prepare_latents(
        pipe, 32, flux2_prepare_noise, flux2_pack, [5, 6, 7][:num_generators]
    )


@pytest.mark.parametrize(
    ("height", "width", "message"),
    [
        (1000, 1024, "height 1000 is not divisible by 16"),
        (1024, 40, "width 40 is not divisible by 16"),
        (0, 16, "height 0 must be a positive integer"),
    ],
)
def test_noise_size_errors(height: int, width: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        flux2_prepare_noise(1, height, width, seed=0, dtype=torch.bfloat16)


def test_noise_argument_errors() -> None:
    with pytest.raises(ValueError, match="pass exactly one of seed or generator"):
        flux2_prepare_noise(1, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="got 1 generators for a batch of 2"):
        flux2_prepare_noise(2, 64, 64, generator=[torch.Generator()], dtype=torch.float32)
    with pytest.raises(ValueError, match="batch 0 must be a positive integer"):
        flux2_prepare_noise(0, 64, 64, seed=0, dtype=torch.float32)
    noise = flux2_prepare_noise(2, 64, 32, seed=0, dtype=torch.bfloat16, device="meta")
    assert noise.device.type == "meta" and noise.shape == (2, 128, 4, 2)


@pytest.mark.parametrize("klein", [False, True])
@pytest.mark.parametrize(("h", "w"), [(2, 2), (16, 6), (6, 16), (128, 96)])
def test_pack_unpack_match_diffusers(klein: bool, h: int, w: int) -> None:
    """flux2_unpack equals `_unpack_latents_with_ids` (dev: sizes from the ids; klein: sizes given)."""
    x = torch.randn(2, 128, h // 2, w // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tokens = flux2_pack(x)
    assert torch.equal(tokens, Flux2Pipeline._pack_latents(x))
    ids = flux2_image_ids(h, w).unsqueeze(0).expand(2, -1, -1)
    if klein:
        ref = Flux2KleinPipeline._unpack_latents_with_ids(tokens, ids, h // 2, w // 2)
    else:
        ref = Flux2Pipeline._unpack_latents_with_ids(tokens, ids)
    back = flux2_unpack(tokens, h, w)
    assert torch.equal(back, ref) and back.is_contiguous() and ref.is_contiguous()
    assert torch.equal(back, x)
    # after a denoising step the tokens are contiguous: still the same result
    assert torch.equal(flux2_unpack(tokens.contiguous(), h, w), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("h", "w"), [(2, 2), (16, 6), (64, 128)])
def test_patchify_matches_diffusers(dtype, h: int, w: int) -> None:
    z = torch.randn(2, 32, h, w, generator=torch.Generator().manual_seed(1)).to(dtype)
    grid = patchify(z)
    assert grid.shape == (2, 128, h // 2, w // 2)
    assert torch.equal(grid, Flux2Pipeline._patchify_latents(z))
    assert torch.equal(unpatchify(grid), Flux2Pipeline._unpatchify_latents(grid))
    assert torch.equal(unpatchify(grid), z)


def test_patchify_layout() -> None:
    """Channel c·4 + dy·2 + dx of patch (i, j) holds latent pixel (c, 2i + dy, 2j + dx)."""
    b, c, h, w = 2, 3, 4, 6
    z = torch.arange(b * c * h * w, dtype=torch.float32).reshape(b, c, h, w)
    grid = patchify(z)
    tokens = flux2_pack(grid)
    for i in range(h // 2):
        for j in range(w // 2):
            for ch in range(c):
                for dy in range(2):
                    for dx in range(2):
                        got = grid[:, ch * 4 + dy * 2 + dx, i, j]
                        assert torch.equal(got, z[:, ch, 2 * i + dy, 2 * j + dx])
                        assert torch.equal(tokens[:, i * (w // 2) + j, ch * 4 + dy * 2 + dx], got)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("ph", "pw"), [(1, 1), (3, 5), (64, 48)])
def test_image_ids_match_diffusers(batch: int, ph: int, pw: int) -> None:
    ref = Flux2Pipeline._prepare_latent_ids(torch.zeros(batch, 128, ph, pw))
    ids = flux2_image_ids(2 * ph, 2 * pw)
    assert ids.shape == (ph * pw, 4) and ids.dtype == torch.int64 == ref.dtype
    for b in range(batch):
        assert torch.equal(ref[b], ids)
    n = ph * pw - 1
    assert ids[n].tolist() == [0, ph - 1, pw - 1, 0]
    assert flux2_image_ids(2 * ph, 2 * pw, time=30)[n].tolist() == [30, ph - 1, pw - 1, 0]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [1, 7, 512])
def test_text_ids_match_diffusers(batch: int, length: int) -> None:
    ref = Flux2Pipeline._prepare_text_ids(torch.zeros(batch, length, 16))
    ids = flux2_text_ids(length)
    assert ids.shape == (length, 4) and ids.dtype == torch.int64 == ref.dtype
    for b in range(batch):
        assert torch.equal(ref[b], ids)
    assert ids[-1].tolist() == [0, 0, 0, length - 1]


def test_id_and_pack_errors() -> None:
    with pytest.raises(ValueError, match="flux2_image_ids: latent grid 3x4 must have even sides"):
        flux2_image_ids(3, 4)
    with pytest.raises(ValueError, match="time -10 must be a non-negative integer"):
        flux2_image_ids(4, 4, time=-10)
    with pytest.raises(ValueError, match="length 0 must be a positive integer"):
        flux2_text_ids(0)
    with pytest.raises(ValueError, match=r"flux2_unpack: expected tokens \(B, 4, C\) for a 4x4 latent grid"):
        flux2_unpack(torch.zeros(1, 5, 128), 4, 4)
    with pytest.raises(
        ValueError, match=r"flux2_pack: expected latents \(B, C, h/2, w/2\), got shape \(128, 2\)"
    ):
        flux2_pack(torch.zeros(128, 2))
    with pytest.raises(ValueError, match="patchify: latent grid 3x4 must have even sides"):
        patchify(torch.zeros(1, 32, 3, 4))
    with pytest.raises(ValueError, match=r"unpatchify: expected latents \(B, 4C, h/2, w/2\)"):
        unpatchify(torch.zeros(1, 30, 2, 2))


# ---- BatchNorm normalization ------------------------------------------------------------------------------


def diffusers_bn(vae, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two lines of Flux2Pipeline.__call__ / _encode_vae_image that build the statistics."""
    latents_bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    latents_bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
        latents.device, latents.dtype
    )
    return latents_bn_mean, latents_bn_std


@pytest.mark.parametrize("vae_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("latent_dtype", [torch.bfloat16, torch.float32])
def test_bn_matches_diffusers(vae_dtype, latent_dtype) -> None:
    vae = tiny_flux2_vae(vae_dtype)
    mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
    assert mean.shape == std.shape == (1, 128, 1, 1) and std.dtype == vae_dtype
    x = (2 * torch.randn(2, 128, 3, 5, generator=torch.Generator().manual_seed(3))).to(latent_dtype)
    ref_mean, ref_std = diffusers_bn(vae, x)

    denorm = bn_denormalize(x, mean, std)
    assert denorm.dtype == latent_dtype
    assert torch.equal(denorm, x * ref_std + ref_mean)  # __call__'s decode
    norm = bn_normalize(x, mean, std)
    assert torch.equal(norm, (x - ref_mean) / ref_std)  # _encode_vae_image
    assert not torch.equal(norm, x)


def test_bn_sqrt_runs_in_the_vae_dtype() -> None:
    """With a bf16 VAE, `sqrt(var + eps)` rounds in bf16; computing it in fp32 changes the decoder input."""
    vae = tiny_flux2_vae(torch.bfloat16)
    x = torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
    fp32_std = torch.sqrt(vae.bn.running_var.float().view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    assert not torch.equal(bn_denormalize(x, mean, std), bn_denormalize(x, mean, fp32_std))
    _, ref_std = diffusers_bn(vae, x)
    assert torch.equal(std, ref_std)


def test_encode_vae_image_matches_diffusers() -> None:
    """patchify → bn_normalize after the VAE's mode equals `Flux2Pipeline._encode_vae_image`."""
    vae = tiny_flux2_vae(torch.bfloat16)
    pipe = bare_flux2_pipe(vae)
    image = (torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(torch.bfloat16)
    with torch.no_grad():
        ref = pipe._encode_vae_image(image, generator=None)
        mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
        ours = bn_normalize(patchify(vae.encode(image).latent_dist.mode()), mean, std)
    assert ours.shape == (1, 128, 4, 3)
    assert torch.equal(ours, ref)


def test_bn_errors() -> None:
    mean, std = latent_bn_stats(torch.zeros(128), torch.ones(128), 1e-4)
    with pytest.raises(
        ValueError, match=r"bn_denormalize: expected patchified latents \(B, C, h, w\) with C = 128"
    ):
        bn_denormalize(torch.zeros(1, 32, 4, 4), mean, std)
    with pytest.raises(ValueError, match=r"bn_normalize: expected patchified latents"):
        bn_normalize(torch.zeros(4, 128), mean, std)
    with pytest.raises(
        ValueError, match=r"expected running_mean and running_var \(C,\), got \(128,\) and \(64,\)"
    ):
        latent_bn_stats(torch.zeros(128), torch.ones(64), 1e-4)


@pytest.mark.parametrize(
    ("scale", "distilled", "expected"), [(4.0, False, True), (4.0, True, False), (1.0, False, False)]
)
def test_klein_uses_cfg_matches_pipeline(scale: float, distilled: bool, expected: bool) -> None:
    pipe = bare_klein_pipe()
    pipe.register_to_config(is_distilled=distilled)
    pipe._guidance_scale = scale
    assert pipe.do_classifier_free_guidance is expected
    assert klein_uses_cfg(scale, distilled) is expected
