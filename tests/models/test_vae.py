"""Flux1VAE against diffusers' AutoencoderKL: torch.equal encode, sample, decode and tiled decode."""

from __future__ import annotations

import pytest
import torch

from flux_runtime import load_vae
from flux_runtime.models.vae.flux1 import FLUX1_VAE, TINY_VAE, Flux1VAE, VAEConfig
from flux_runtime.weights import vae_layout
from tests.models.helpers import (
    DTYPES,
    check_encode_decode,
    check_vae_layout_table,
    run_without_diffusers,
    vae_fixtures,
)
from tests.weights.vae_fixtures import make_diffusers_vae, save_bfl_vae

# the same tiny VAE as a diffusers folder and a BFL single file; diffusers' AutoencoderKL loaded from the folder
checkpoints, reference = vae_fixtures("vae", make_diffusers_vae, save_bfl_vae, "AutoencoderKL")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
@torch.no_grad()
def test_encode_decode_equal_diffusers(checkpoints, reference, layout, dtype):
    ours = load_vae(checkpoints[layout], dtype=dtype)
    ref = reference[dtype]
    check_encode_decode(ours, ref, 16, dtype)


@torch.no_grad()
@pytest.mark.parametrize("shape", [(2, 64, 16, 24), (1, 64, 32, 32), (3, 64, 8, 12)], ids=str)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["frozen", "trainable"])
@torch.no_grad()
def test_mid_attention_equals_diffusers_whatever_requires_grad(checkpoints, reference, shape, requires_grad):
    # diffusers' parameters require grad (also under no_grad), which sends F.linear on the transposed
    # tokens through matmul's folded route; on some CPUs (bf16, AVX2) the batched route rounds differently
    ours = load_vae(checkpoints["diffusers"], dtype=torch.bfloat16).requires_grad_(requires_grad)
    ref = reference[torch.bfloat16]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(torch.bfloat16)
    want = ref.decoder.mid_block.attentions[0](x)
    assert torch.equal(ours.decoder.mid.attn_1(x), want)
    assert torch.equal(ours.encoder.mid.attn_1(x), ref.encoder.mid_block.attentions[0](x))


def test_tiled_decode_equals_diffusers_tiling(checkpoints, reference):
    from diffusers import AutoencoderKL

    ours = load_vae(checkpoints["diffusers"], dtype=torch.float32)
    ref = AutoencoderKL.from_pretrained(checkpoints["diffusers"]).eval()
    ref.enable_tiling()
    tile = ref.tile_latent_min_size  # sample_size 32 // factor 2
    assert tile == 16
    z = torch.randn(1, 16, 30, 21, generator=torch.Generator().manual_seed(1))  # 3 x 2 overlapping tiles

    tiled = ours.decode(z, tile=tile)
    assert tiled.shape == (1, 3, 60, 42)
    assert torch.equal(tiled, ref.decode(z).sample)
    # documented: tiles see only themselves, so tiled decoding is not bit-identical to untiled
    assert not torch.equal(tiled, ours.decode(z))
    # a latent that fits in one tile is decoded in one pass
    small = z[:, :, :16, :12]
    assert torch.equal(ours.decode(small, tile=tile), ours.decode(small))


def test_tile_must_be_a_multiple_of_four():
    vae = load_vae("tiny-random", dtype=torch.float32)
    with pytest.raises(ValueError, match="tile 10 must be a positive multiple of 4"):
        vae.decode(torch.zeros(1, 16, 24, 24), tile=10)


def test_latent_scaling_in_diffusers_order(reference):
    """scale/unscale are the FLUX pipelines' expressions, bit for bit, with the config's factors."""
    vae = load_vae("tiny-random", dtype=torch.float32)
    cfg = reference[torch.float32].config
    z = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(vae.scale_latents(z), (z - cfg.shift_factor) * cfg.scaling_factor)
    assert torch.equal(vae.unscale_latents(z), (z / cfg.scaling_factor) + cfg.shift_factor)
    torch.testing.assert_close(vae.unscale_latents(vae.scale_latents(z)), z)


def test_inputs_are_checked_in_our_words():
    vae = load_vae("tiny-random", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"image must be \(B, 3, H, W\), got \(1, 4, 8, 8\)"):
        vae.encode(torch.zeros(1, 4, 8, 8))
    with pytest.raises(ValueError, match="image size 9x8 is not divisible by the VAE's factor 2"):
        vae.encode(torch.zeros(1, 3, 9, 8))
    with pytest.raises(ValueError, match=r"image is torch\.bfloat16 but the VAE weights are torch\.float32"):
        vae.encode(torch.zeros(1, 3, 8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="only matters with sample=True"):
        vae.encode(torch.zeros(1, 3, 8, 8), generator=torch.Generator())
    with pytest.raises(ValueError, match=r"latent must be \(B, 16, h, w\), got \(1, 4, 8, 8\)"):
        vae.decode(torch.zeros(1, 4, 8, 8))


def test_config_validation():
    with pytest.raises(ValueError, match="block width 48 not divisible by norm_num_groups 32"):
        VAEConfig(ch=48, ch_mult=(1, 2))
    with pytest.raises(ValueError, match="num_res_blocks 0 must be positive"):
        VAEConfig(num_res_blocks=0)
    assert FLUX1_VAE.block_channels == (128, 256, 512, 512) and FLUX1_VAE.spatial_factor == 8
    assert TINY_VAE.block_channels == (32, 32) and TINY_VAE.spatial_factor == 2
    assert TINY_VAE.z_channels == 16  # the FLUX.1 DiT packs 16 channels 2x2 into 64


def test_full_preset_matches_diffusers_flux1_vae_on_meta():
    """FLUX.1's VAE built on meta: same parameter count as diffusers' and a one-to-one key map."""
    from diffusers import AutoencoderKL

    n = len(FLUX1_VAE.ch_mult)
    with torch.device("meta"):
        ours = Flux1VAE(FLUX1_VAE)
        ref = AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n,
            block_out_channels=FLUX1_VAE.block_channels,
            layers_per_block=2,
            latent_channels=16,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in ref.parameters()) == 83_819_683
    check_vae_layout_table(vae_layout.rules(FLUX1_VAE.ch_mult, FLUX1_VAE.num_res_blocks), ours, ref)


def test_runtime_never_imports_diffusers(checkpoints, tmp_path):
    """Loading, encoding, decoding and converting the VAE work with diffusers made unimportable."""
    run_without_diffusers(
        f"""
        from flux_runtime.weights.convert import convert
        vae = flux_runtime.load_vae({str(checkpoints["bfl"])!r}, dtype=torch.float32)
        image = vae.decode(vae.encode(torch.zeros(1, 3, 16, 16)), tile=4)  # 8x8 latent: 3x3 tiles
        assert image.shape == (1, 3, 16, 16)
        convert("vae", {str(checkpoints["bfl"])!r}, {str(tmp_path / "out")!r})
        """
    )
