"""load_vae: layouts, prefixes, config.json, the tiny preset, and errors that name the problem."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from flux_runtime import WeightsError, load_vae
from flux_runtime.models.vae.flux1 import TINY_VAE, VAEConfig
from tests.weights import loading_fixtures as fx
from tests.weights.vae_fixtures import make_diffusers_vae, make_image, save_bfl_vae, save_diffusers_vae

model, bfl_file, folder = fx.vae_fixtures(make_diffusers_vae, save_bfl_vae)


def test_layouts_roots_and_prefixes_load_the_same_weights(tmp_path, model, bfl_file, folder):
    cfg = fx.vaes_every_way(tmp_path, model, bfl_file, folder, save_bfl_vae, "img_in.weight").config
    assert (cfg.ch, cfg.ch_mult, cfg.num_res_blocks, cfg.z_channels) == (32, (1, 2), 1, 16)


def test_sharded_diffusers_folder(tmp_path, model, bfl_file):
    sharded = fx.sharded(model, tmp_path / "sharded", "100KB")
    assert fx.same_weights(load_vae(sharded, dtype=torch.float32), load_vae(bfl_file, dtype=torch.float32))


def test_streams_to_dtype_and_meta_free(folder):
    fx.assert_ready(load_vae(folder, dtype=torch.bfloat16), torch.bfloat16)


@torch.no_grad()
def test_config_json_decides_levels_groups_and_factors(tmp_path):
    """Three levels (a 4x VAE), 8 groups, other factors: read from config.json, never assumed."""
    from diffusers import AutoencoderKL

    kw = dict(
        block_out_channels=(16, 32, 32),
        layers_per_block=2,
        norm_num_groups=8,
        scaling_factor=0.5,
        shift_factor=-0.25,
    )
    folder = save_diffusers_vae(make_diffusers_vae(seed=3, **kw), tmp_path / "vae")
    ours = load_vae(folder, dtype=torch.float32)
    assert ours.config == VAEConfig(
        ch=16, ch_mult=(1, 2, 2), num_res_blocks=2, norm_num_groups=8, scale_factor=0.5, shift_factor=-0.25
    )
    assert ours.config.spatial_factor == 4
    z = fx.same_codec(
        ours, AutoencoderKL.from_pretrained(folder).eval(), make_image(1, 16, 24, torch.float32)
    )
    assert z.shape == (1, 16, 4, 6)


@torch.no_grad()
def test_bfl_file_needs_config_for_what_it_cannot_state(tmp_path):
    """A BFL file has no groups or factors: 32 groups do not divide 16 channels, so config= must say."""
    from diffusers import AutoencoderKL

    model = make_diffusers_vae(seed=4, block_out_channels=(16, 32), norm_num_groups=8)
    fx.bfl_vae_needs_config(tmp_path, model, save_bfl_vae, AutoencoderKL, TINY_VAE)


def test_given_config_must_agree_with_config_json(folder):
    with pytest.raises(WeightsError, match=r"scale_factor: checkpoint 0\.3611, config 0\.5"):
        load_vae(folder, config=VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1, scale_factor=0.5))


def test_tiny_preset_is_deterministic():
    a, b = load_vae("tiny-random", dtype=torch.float32), load_vae("tiny-random", dtype=torch.float32)
    assert a.config == TINY_VAE
    assert fx.same_weights(a, b)
    with torch.no_grad():
        image = a.decode(a.encode(make_image(1, 16, 24, torch.float32)))
    assert image.shape == (1, 3, 16, 24) and torch.isfinite(image).all()


def test_missing_key(tmp_path, bfl_file):
    path = fx.edited(
        bfl_file, lambda sd: sd.pop("decoder.up.1.upsample.conv.bias"), tmp_path / "m.safetensors"
    )
    with pytest.raises(WeightsError, match=r"missing 1 key\(s\): decoder.up.1.upsample.conv.bias"):
        load_vae(path)


def test_unexpected_key(tmp_path, folder):
    extra = {"decoder.up_blocks.0.attentions.0.to_q.weight": torch.zeros(2, 2)}
    fx.edited(folder / "diffusion_pytorch_model.safetensors", lambda sd: sd.update(extra))
    with pytest.raises(
        WeightsError, match=r"1 unexpected key\(s\): decoder.up_blocks.0.attentions.0.to_q.weight"
    ):
        load_vae(folder)


def test_wrong_shape_names_key_and_both_shapes(tmp_path, folder, bfl_file):
    linear = {"encoder.mid.attn_1.k.weight": torch.zeros(64, 64)}  # a linear weight where BFL has a 1x1 conv
    path = fx.edited(bfl_file, lambda sd: sd.update(linear), tmp_path / "s.safetensors")
    with pytest.raises(
        WeightsError,
        match=r"encoder.mid.attn_1.k.weight: expected shape \(64, 64, 1, 1\), checkpoint has \(64, 64\)",
    ):
        load_vae(path)

    conv = {"decoder.mid_block.attentions.0.to_out.0.weight": torch.zeros(64, 64, 1, 1)}
    fx.edited(folder / "diffusion_pytorch_model.safetensors", lambda sd: sd.update(conv))
    with pytest.raises(
        WeightsError,
        match=r"decoder.mid_block.attentions.0.to_out.0.weight: expected shape \(64, 64\), checkpoint has \(64, 64, 1, 1\)",
    ):
        load_vae(folder)


def test_empty_and_foreign_files(tmp_path):
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(WeightsError, match="the file is empty"):
        load_vae(tmp_path / "empty.safetensors")
    save_file({"img_in.weight": torch.zeros(2, 2)}, tmp_path / "dit.safetensors")
    with pytest.raises(WeightsError, match=r"not a FLUX\.1 VAE in BFL or diffusers form"):
        load_vae(tmp_path / "dit.safetensors")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(WeightsError, match="no VAE found"):
        load_vae(tmp_path / "nothing")
    with pytest.raises(WeightsError, match="'nobody/no-such-flux' is not in the local Hugging Face cache"):
        load_vae("nobody/no-such-flux")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"block_out_channels": [32, 32]},
            r"does not match the weights: ch_mult: config.json \(1, 1\), weights \(1, 2\)",
        ),
        ({"use_quant_conv": True}, "use_quant_conv is True"),
        ({"_class_name": "AutoencoderKLFlux2"}, "_class_name is 'AutoencoderKLFlux2'"),
        ({"up_block_types": ["AttnUpDecoderBlock2D", "UpDecoderBlock2D"]}, "up_block_types is"),
    ],
)
def test_config_json_is_checked(folder, edit, message):
    fx.edit_config(folder, edit)
    with pytest.raises(WeightsError, match=message):
        load_vae(folder)


def test_invalid_config_json(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match=r"config\.json: not valid JSON"):
        load_vae(folder)


def test_cached_model_id_loads(tmp_path, monkeypatch, model):
    """A Hugging Face cache entry laid out by hand, as `hf download` leaves a FLUX.1 repo: vae/ wins over ae.safetensors."""
    snap = fx.cached_snapshot(tmp_path, monkeypatch, "black-forest-labs/FLUX.1-dev")
    save_diffusers_vae(model, snap / "vae")
    (snap / "ae.safetensors").write_bytes(b"")  # would fail to load: proves vae/ is the one read
    vae = load_vae("black-forest-labs/FLUX.1-dev", dtype=torch.float32)
    assert vae.config.scale_factor == 0.3611 and vae.config.ch_mult == (1, 2)
    with pytest.raises(
        WeightsError, match=r"'black-forest-labs/FLUX\.1-nope' is not in the local Hugging Face cache"
    ):
        load_vae("black-forest-labs/FLUX.1-nope")
