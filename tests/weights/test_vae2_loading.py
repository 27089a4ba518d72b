"""load_vae on FLUX.2 autoencoders: family by keys, layouts, prefixes, config.json, the tiny-flux2 preset,
the optional BatchNorm counter, and errors that name the problem."""

from __future__ import annotations

import inspect
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux_runtime import WeightsError, load_vae
from flux_runtime.models.vae import TINY_FLUX2_VAE, TINY_VAE, Flux1VAE, Flux2VAE, Flux2VAEConfig, VAEConfig
from flux_runtime.weights import vae as vae_loader
from tests.weights import loading_fixtures as fx
from tests.weights.vae_fixtures import (
    make_diffusers_flux2_vae,
    make_diffusers_vae,
    make_image,
    save_bfl_flux2_vae,
    save_bfl_vae,
    save_diffusers_vae,
)

TINY_2LEVEL = replace(TINY_FLUX2_VAE, ch_mult=(1, 2))  # the fixture's shape: widths (32, 64)


model, bfl_file, folder = fx.vae_fixtures(make_diffusers_flux2_vae, save_bfl_flux2_vae)


def test_layouts_roots_and_prefixes_load_the_same_weights(tmp_path, model, bfl_file, folder):
    # the repo root's transformer file is FLUX.2's; the all-in-one file's VAE has its BatchNorm under `vae.` too
    dit_key = "single_stream_modulation.lin.weight"
    from_bfl = fx.vaes_every_way(tmp_path, model, bfl_file, folder, save_bfl_flux2_vae, dit_key)
    assert isinstance(from_bfl, Flux2VAE) and from_bfl.config == TINY_2LEVEL
    assert from_bfl.config.family == "flux2"
    # the tensors are diffusers' (1x1 convs kept as convs, statistics as they were)
    ref = model.state_dict()
    assert torch.equal(from_bfl.encoder.quant_conv.weight, ref["quant_conv.weight"])
    assert torch.equal(from_bfl.decoder.post_quant_conv.bias, ref["post_quant_conv.bias"])
    assert torch.equal(from_bfl.bn.running_var, ref["bn.running_var"])


def test_family_is_read_from_keys_not_names(tmp_path, model):
    flux1 = save_bfl_vae(make_diffusers_vae(), tmp_path / "flux2-ae.safetensors")
    flux2 = save_bfl_flux2_vae(model, tmp_path / "flux1-ae.safetensors")
    assert isinstance(load_vae(flux1, dtype=torch.float32), Flux1VAE)
    assert isinstance(load_vae(flux2, dtype=torch.float32), Flux2VAE)


def test_sharded_diffusers_folder(tmp_path, model, bfl_file):
    sharded = fx.sharded(model, tmp_path / "sharded", "100KB")
    assert fx.same_weights(load_vae(sharded, dtype=torch.float32), load_vae(bfl_file, dtype=torch.float32))


def test_streams_to_dtype_and_meta_free(folder):
    # the statistics too, as diffusers' torch_dtype
    fx.assert_ready(load_vae(folder, dtype=torch.bfloat16), torch.bfloat16, buffers=True)


def test_batchnorm_counter_is_optional(tmp_path, model, bfl_file, folder):
    """`bn.num_batches_tracked` may be there or not, in either layout; it is never loaded."""
    assert "bn.num_batches_tracked" in load_file(folder / "diffusion_pytorch_model.safetensors")
    assert "bn.num_batches_tracked" not in load_file(bfl_file)
    with_counter = save_bfl_flux2_vae(model, tmp_path / "counter.safetensors", counter=True)
    loaded = load_vae(with_counter, dtype=torch.float32)
    assert fx.same_weights(loaded, load_vae(folder, dtype=torch.float32))
    assert "bn.num_batches_tracked" not in loaded.state_dict()

    counters = {"bn.num_batches_tracked": torch.zeros(3, dtype=torch.int64)}
    bad = fx.edited(with_counter, lambda sd: sd.update(counters), tmp_path / "bad.safetensors")
    with pytest.raises(
        WeightsError,
        match=r"bn\.num_batches_tracked: expected shape \(\) \(a counter\), checkpoint has \(3,\)",
    ):
        load_vae(bad)


@torch.no_grad()
def test_config_json_decides_levels_groups_and_eps(tmp_path):
    """Three levels (a 4x VAE), 8 groups, 16 latent channels and another eps: read from config.json."""
    from diffusers import AutoencoderKLFlux2

    kw = dict(block_out_channels=(16, 32, 32), layers_per_block=2, norm_num_groups=8, latent_channels=16)
    folder = save_diffusers_vae(make_diffusers_flux2_vae(seed=3, batch_norm_eps=1e-2, **kw), tmp_path / "vae")
    ours = load_vae(folder, dtype=torch.float32)
    assert ours.config == Flux2VAEConfig(
        ch=16, ch_mult=(1, 2, 2), num_res_blocks=2, norm_num_groups=8, z_channels=16, batch_norm_eps=1e-2
    )
    assert (
        isinstance(ours, Flux2VAE) and ours.config.spatial_factor == 4 and ours.config.latent_channels == 64
    )
    ref = AutoencoderKLFlux2.from_pretrained(folder).eval()
    assert fx.same_codec(ours, ref, make_image(1, 16, 24, torch.float32)).shape == (1, 16, 4, 6)
    # the eps reaches the normalisation: diffusers' arithmetic with config.batch_norm_eps 1e-2
    p = torch.randn(1, 64, 2, 3, generator=torch.Generator().manual_seed(0))
    std = torch.sqrt(ref.bn.running_var.view(1, -1, 1, 1) + ref.config.batch_norm_eps)
    assert torch.equal(ours.normalize_latents(p), (p - ref.bn.running_mean.view(1, -1, 1, 1)) / std)


@torch.no_grad()
def test_bfl_file_needs_config_for_what_it_cannot_state(tmp_path):
    """A BFL file has no groups or eps: 32 groups do not divide 16 channels, so config= must say."""
    from diffusers import AutoencoderKLFlux2

    model = make_diffusers_flux2_vae(seed=4, block_out_channels=(16, 32), norm_num_groups=8)
    path = fx.bfl_vae_needs_config(tmp_path, model, save_bfl_flux2_vae, AutoencoderKLFlux2, TINY_FLUX2_VAE)
    with pytest.raises(
        WeightsError, match=r"checkpoint is a FLUX\.2 VAE but config is a VAEConfig \(FLUX\.1\)"
    ):
        load_vae(path, config=VAEConfig(ch=16, ch_mult=(1, 2), norm_num_groups=8, z_channels=32))


def test_given_config_must_agree_with_config_json(folder):
    with pytest.raises(WeightsError, match=r"batch_norm_eps: checkpoint 0\.0001, config 0\.001"):
        load_vae(folder, config=replace(TINY_2LEVEL, batch_norm_eps=1e-3))


def test_flux1_checkpoint_refuses_a_flux2_config(tmp_path):
    path = save_bfl_vae(make_diffusers_vae(), tmp_path / "ae.safetensors")
    with pytest.raises(WeightsError, match=r"checkpoint is a FLUX\.1 VAE but config is a Flux2VAEConfig"):
        load_vae(path, config=TINY_2LEVEL)


def test_tiny_flux2_preset_is_deterministic():
    a, b = (
        load_vae("tiny-flux2-random", dtype=torch.float32),
        load_vae("tiny-flux2-random", dtype=torch.float32),
    )
    assert isinstance(a, Flux2VAE) and a.config == TINY_FLUX2_VAE
    assert fx.same_weights(a, b)
    stats = (a.bn.running_mean, a.bn.running_var)
    assert not any(t.is_meta for t in stats) and a.bn.running_mean.abs().sum() > 0
    assert (a.bn.running_var > 0).all()
    with torch.no_grad():
        z = a.encode(make_image(1, 16, 24, torch.float32))
        image = a.decode(a.denormalize_latents(a.normalize_latents(z.view(1, 128, 4, 6))).view(1, 32, 8, 12))
    assert image.shape == (1, 3, 16, 24) and torch.isfinite(image).all()
    bf16 = load_vae("tiny-flux2")
    assert {t.dtype for t in (*bf16.parameters(), *bf16.buffers())} == {torch.bfloat16}
    assert isinstance(load_vae("tiny"), Flux1VAE)
    with pytest.raises(WeightsError, match=r"'tiny-flux2' is a FLUX\.2 preset but config is a VAEConfig"):
        load_vae("tiny-flux2", config=TINY_VAE)


def test_missing_key(tmp_path, bfl_file):
    path = fx.edited(bfl_file, lambda sd: sd.pop("bn.running_var"), tmp_path / "m.safetensors")
    with pytest.raises(WeightsError, match=r"missing 1 key\(s\): bn.running_var"):
        load_vae(path)


def _move(sd, old, new):
    sd[new] = sd.pop(old)


def _copy_post_quant_bias(sd):
    sd["decoder.post_quant_conv.bias"] = sd["post_quant_conv.bias"].clone()


def test_quant_convs_are_named_per_layout(tmp_path, bfl_file, folder):
    # diffusers' top-level name in a BFL file: BFL's is missing, diffusers' unexpected
    path = fx.edited(
        bfl_file,
        lambda sd: _move(sd, "encoder.quant_conv.weight", "quant_conv.weight"),
        tmp_path / "q.safetensors",
    )
    with pytest.raises(WeightsError, match=r"missing 1 key\(s\): encoder.quant_conv.weight"):
        load_vae(path)

    fx.edited(folder / "diffusion_pytorch_model.safetensors", _copy_post_quant_bias)
    with pytest.raises(WeightsError, match=r"1 unexpected key\(s\): decoder.post_quant_conv.bias"):
        load_vae(folder)


def test_wrong_shape_names_key_and_both_shapes(tmp_path, bfl_file, folder):
    narrow = {"bn.running_mean": torch.zeros(32)}  # unpatchified width, not 4 x 32
    path = fx.edited(bfl_file, lambda sd: sd.update(narrow), tmp_path / "s.safetensors")
    with pytest.raises(
        WeightsError, match=r"bn.running_mean: expected shape \(128,\), checkpoint has \(32,\)"
    ):
        load_vae(path)

    linear = {"quant_conv.weight": torch.zeros(64, 64)}  # a linear weight where both layouts have a 1x1 conv
    fx.edited(folder / "diffusion_pytorch_model.safetensors", lambda sd: sd.update(linear))
    with pytest.raises(
        WeightsError, match=r"quant_conv.weight: expected shape \(64, 64, 1, 1\), checkpoint has \(64, 64\)"
    ):
        load_vae(folder)


def test_foreign_files(tmp_path):
    save_file(
        {"bn.running_mean": torch.zeros(128), "encoder.conv_in.weight": torch.zeros(2, 3, 3, 3)},
        tmp_path / "f2.safetensors",
    )
    with pytest.raises(WeightsError, match=r"not a FLUX\.2 VAE in BFL or diffusers form"):
        load_vae(tmp_path / "f2.safetensors")
    # an SD-style VAE: quant convs without the latent BatchNorm
    sd_style = make_diffusers_vae(use_quant_conv=True, use_post_quant_conv=True)
    folder = save_diffusers_vae(sd_style, tmp_path / "sd")
    with pytest.raises(WeightsError, match=r"it has quant_conv\.weight, .*SD-style autoencoder"):
        load_vae(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"block_out_channels": [32, 32]},
            r"does not match the weights: ch_mult: config.json \(1, 1\), weights \(1, 2\)",
        ),
        ({"use_quant_conv": False}, r"use_quant_conv is False \(the FLUX\.2 VAE has True\)"),
        (
            {"_class_name": "AutoencoderKL"},
            r"not a FLUX\.2-style AutoencoderKLFlux2: _class_name is 'AutoencoderKL'",
        ),
        ({"patch_size": [1, 1]}, r"patch_size is \[1, 1\]"),
        ({"decoder_block_out_channels": [64, 64]}, r"decoder_block_out_channels is \[64, 64\]"),
        ({"batch_norm_eps": 0}, r"batch_norm_eps 0\.0 must be positive"),
    ],
)
def test_config_json_is_checked(folder, edit, message):
    fx.edit_config(folder, edit)
    with pytest.raises(WeightsError, match=message):
        load_vae(folder)


def test_config_json_defaults_are_diffusers_class_defaults(folder):
    """Fields a config.json leaves out take AutoencoderKLFlux2's signature defaults (written out by hand)."""
    from diffusers import AutoencoderKLFlux2

    params = inspect.signature(AutoencoderKLFlux2.__init__).parameters
    defaults = {k: p.default for k, p in params.items() if k != "self"}
    ours = vae_loader._FLUX2_DIFFUSERS_DEFAULTS
    assert ours.keys() == defaults.keys()
    for k, v in defaults.items():
        assert ours[k] == (list(v) if isinstance(v, tuple) else v), k
    # a config.json holding only the levels loads as the fixture's model (everything else defaulted)
    widths_only = {
        "block_out_channels": [32, 64],
        "layers_per_block": 1,
        "down_block_types": ["DownEncoderBlock2D"] * 2,
        "up_block_types": ["UpDecoderBlock2D"] * 2,
    }
    (folder / "config.json").write_text(json.dumps(widths_only))
    assert load_vae(folder, dtype=torch.float32).config == TINY_2LEVEL
