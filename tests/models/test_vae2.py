"""Flux2VAE against diffusers' AutoencoderKLFlux2 and Flux2Pipeline: torch.equal encode, sample, decode,
tiled decode and the BatchNorm latent normalisation, fp32 and bf16."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from flux_runtime import load_vae
from flux_runtime.models.vae import (
    FLUX1_VAE,
    FLUX2_VAE,
    TINY_FLUX2_VAE,
    Flux1VAE,
    Flux2VAE,
    Flux2VAEConfig,
    VAEShape,
)
from flux_runtime.weights import vae2_layout
from tests.models.helpers import (
    DTYPES,
    check_encode_decode,
    check_vae_layout_table,
    run_without_diffusers,
    vae_fixtures,
)
from tests.weights.vae_fixtures import (
    make_diffusers_flux2_vae,
    make_image,
    save_bfl_flux2_vae,
)

# the same tiny VAE as a diffusers folder and a BFL single file; diffusers' AutoencoderKLFlux2 loaded from the folder
checkpoints, reference = vae_fixtures(
    "vae2", make_diffusers_flux2_vae, save_bfl_flux2_vae, "AutoencoderKLFlux2"
)


def _pipeline_encode(vae, image: torch.Tensor) -> torch.Tensor:
    """`Flux2Pipeline._encode_vae_image` itself, run on `vae` (encode, mode, patchify, BatchNorm-normalise)."""
    from diffusers import Flux2Pipeline

    fake = SimpleNamespace(vae=vae, _patchify_latents=Flux2Pipeline._patchify_latents)
    return Flux2Pipeline._encode_vae_image(fake, image, generator=None)


def _pipeline_denormalize(vae, latents: torch.Tensor) -> torch.Tensor:
    """The BatchNorm lines of `Flux2Pipeline.__call__` before `_unpatchify_latents` (diffusers 0.42.1)."""
    latents_bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    latents_bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
        latents.device, latents.dtype
    )
    return latents * latents_bn_std + latents_bn_mean


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
@torch.no_grad()
def test_encode_decode_equal_diffusers(checkpoints, reference, layout, dtype):
    ours = load_vae(checkpoints[layout], dtype=dtype)
    assert isinstance(ours, Flux2VAE)
    ref = reference[dtype]
    check_encode_decode(ours, ref, 32, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@torch.no_grad()
def test_latent_normalization_is_flux2_pipelines(checkpoints, reference, dtype):
    """Reference image: encode → patchify → normalise is `_encode_vae_image`; decode side: `__call__`'s lines."""
    from diffusers import Flux2Pipeline

    ours = load_vae(checkpoints["bfl"], dtype=dtype)
    ref = reference[dtype]
    assert ours.bn.running_var.dtype == ref.bn.running_var.dtype == dtype  # stats live in the VAE's dtype
    x = make_image(1, 32, 48, dtype, seed=3)

    expected = _pipeline_encode(ref, x)
    normalized = ours.normalize_latents(Flux2Pipeline._patchify_latents(ours.encode(x)))
    assert normalized.shape == (1, 128, 8, 12) and normalized.dtype == dtype
    assert torch.equal(normalized, expected)
    assert not torch.equal(normalized, Flux2Pipeline._patchify_latents(ours.encode(x)))

    # packed tokens (B, L, 128) give the same values as the patchified grid
    tokens = Flux2Pipeline._pack_latents(Flux2Pipeline._patchify_latents(ours.encode(x)))
    assert torch.equal(ours.normalize_latents(tokens), Flux2Pipeline._pack_latents(expected))

    # decode side: sampled latents (the DiT's dtype) back to the BatchNorm scale, unpatchify, decode
    sampled = torch.randn(2, 128, 8, 12, generator=torch.Generator().manual_seed(4)).to(dtype)
    denormalized = ours.denormalize_latents(sampled)
    assert torch.equal(denormalized, _pipeline_denormalize(ref, sampled))
    image = ours.decode(Flux2Pipeline._unpatchify_latents(denormalized))
    assert torch.equal(image, ref.decode(Flux2Pipeline._unpatchify_latents(denormalized)).sample)
    torch.testing.assert_close(
        ours.denormalize_latents(ours.normalize_latents(sampled)), sampled, rtol=2e-2, atol=2e-2
    )


@torch.no_grad()
def test_normalization_casts_like_the_pipeline(checkpoints, reference):
    """A bf16 VAE with fp32 latents: `sqrt(var + eps)` is taken in bf16, then cast (diffusers' order)."""
    ours = load_vae(checkpoints["bfl"], dtype=torch.bfloat16)
    ref = reference[torch.bfloat16]
    z = torch.randn(1, 128, 4, 6, generator=torch.Generator().manual_seed(5))  # fp32
    out = ours.denormalize_latents(z)
    assert out.dtype == torch.float32
    assert torch.equal(out, _pipeline_denormalize(ref, z))
    # the order is observable: the square root taken in fp32 gives other bits
    var = ours.bn.running_var.float().view(1, -1, 1, 1)
    fp32_std = torch.sqrt(var + ours.config.batch_norm_eps)
    assert not torch.equal(out, z * fp32_std + ours.bn.running_mean.float().view(1, -1, 1, 1))


@torch.no_grad()
def test_tiled_decode_equals_diffusers_tiling(checkpoints):
    from diffusers import AutoencoderKLFlux2

    ours = load_vae(checkpoints["diffusers"], dtype=torch.float32)
    ref = AutoencoderKLFlux2.from_pretrained(checkpoints["diffusers"], sample_size=32).eval()
    ref.enable_tiling()
    tile = ref.tile_latent_min_size  # sample_size 32 // factor 2
    assert tile == 16
    z = torch.randn(1, 32, 30, 21, generator=torch.Generator().manual_seed(1))  # 3 x 2 overlapping tiles

    tiled = ours.decode(z, tile=tile)  # post_quant_conv runs per tile, as in diffusers' tiled_decode
    assert tiled.shape == (1, 3, 60, 42)
    assert torch.equal(tiled, ref.decode(z).sample)
    assert not torch.equal(tiled, ours.decode(z))


def test_inputs_are_checked_in_our_words():
    vae = load_vae("tiny-flux2-random", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"latent must be \(B, 32, h, w\), got \(1, 16, 8, 8\)"):
        vae.decode(torch.zeros(1, 16, 8, 8))
    with pytest.raises(ValueError, match=r"image size 9x8 is not divisible by the VAE's factor 2"):
        vae.encode(torch.zeros(1, 3, 9, 8))
    for bad in (torch.zeros(1, 32, 4, 4), torch.zeros(1, 4, 64), torch.zeros(128)):
        with pytest.raises(
            ValueError, match=r"latents must be patchified \(B, 128, h, w\) or packed \(B, L, 128\)"
        ):
            vae.normalize_latents(bad)
    with pytest.raises(ValueError, match="patchified"):
        vae.denormalize_latents(torch.zeros(1, 32, 4, 4))


def test_config_validation():
    assert isinstance(FLUX2_VAE, VAEShape) and FLUX2_VAE.family == "flux2" and FLUX1_VAE.family == "flux1"
    assert FLUX2_VAE.block_channels == (128, 256, 512, 512) and FLUX2_VAE.spatial_factor == 8
    assert (FLUX2_VAE.z_channels, FLUX2_VAE.latent_channels, FLUX2_VAE.batch_norm_eps) == (32, 128, 1e-4)
    assert TINY_FLUX2_VAE.spatial_factor == 2 and TINY_FLUX2_VAE.latent_channels == 128  # the DiT's tokens
    with pytest.raises(ValueError, match=r"batch_norm_eps 0\.0 must be positive"):
        Flux2VAEConfig(batch_norm_eps=0.0)
    with pytest.raises(ValueError, match="block width 48 not divisible by norm_num_groups 32"):
        replace(FLUX2_VAE, ch=48, ch_mult=(1, 2))
    flux1_shaped = Flux2VAEConfig(z_channels=16)  # FLUX.1's shape, FLUX.2's family: never equal
    assert flux1_shaped != FLUX1_VAE and {
        f: getattr(flux1_shaped, f) for f in ("ch", "ch_mult", "z_channels")
    } == {f: getattr(FLUX1_VAE, f) for f in ("ch", "ch_mult", "z_channels")}
    assert replace(FLUX2_VAE, z_channels=16).latent_channels == 64


def test_full_preset_matches_diffusers_flux2_vae_on_meta():
    """FLUX.2's VAE built on meta: diffusers' parameter and buffer counts, a one-to-one key map."""
    from diffusers import AutoencoderKLFlux2

    with torch.device("meta"):
        ours = Flux2VAE(FLUX2_VAE)
        ref = AutoencoderKLFlux2()  # the conversion script's config: class defaults
        flux1 = Flux1VAE(FLUX1_VAE)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in ref.parameters()) == 84_046_115
    # FLUX.1 plus the two 1x1 convs and wider latent convs; 2 x 128 BatchNorm statistics
    assert count > sum(p.numel() for p in flux1.parameters())
    assert sum(b.numel() for b in ours.buffers()) == 256
    rules = vae2_layout.rules(FLUX2_VAE.ch_mult, FLUX2_VAE.num_res_blocks)
    check_vae_layout_table(rules, ours, ref, vae2_layout.OPTIONAL)


def test_runtime_never_imports_diffusers(checkpoints, tmp_path):
    """Loading, encoding, normalising, decoding and converting FLUX.2 work with diffusers unimportable."""
    run_without_diffusers(
        f"""
        from flux_runtime.weights.convert import convert
        vae = flux_runtime.load_vae({str(checkpoints["bfl"])!r}, dtype=torch.float32)
        z = vae.encode(torch.zeros(1, 3, 16, 16))
        tokens = vae.normalize_latents(torch.zeros(1, 16, 128))
        image = vae.decode(z, tile=4)
        assert image.shape == (1, 3, 16, 16) and tokens.shape == (1, 16, 128)
        convert("vae", {str(checkpoints["bfl"])!r}, {str(tmp_path / "out")!r})
        """
    )
