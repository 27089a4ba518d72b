"""FLUX.2 through `load_transformer`: both layouts, prefixes, folders, dispatch, and errors that name the problem."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from flux_runtime import WeightsError, load_transformer
from flux_runtime.models.dit import FLUX2_KLEIN_4B, TINY, TINY_FLUX2, Flux1Transformer, Flux2Transformer
from flux_runtime.weights import flux2_layout
from flux_runtime.weights.flux2_transformer import is_flux2, load_flux2_transformer
from tests import flux2_fixtures
from tests.flux1_fixtures import make_diffusers_transformer as make_flux1
from tests.flux1_fixtures import save_bfl as save_flux1_bfl
from tests.flux2_fixtures import bfl_state_dict, make_diffusers_flux2, save_bfl, save_diffusers
from tests.weights import loading_fixtures as fx

TINY_DEV = replace(TINY_FLUX2, guidance_embed=True)


dev_model, bfl_file = fx.dit_fixtures(lambda: make_diffusers_flux2(True), save_bfl, "flux2-dev.safetensors")


def test_layouts_and_prefix_load_the_same_weights(tmp_path, dev_model, bfl_file):
    # every config field read from the checkpoint (axes/theta from config.json or the FLUX.2 preset)
    for model in fx.dits_every_way(tmp_path, dev_model, bfl_file, flux2_fixtures):
        assert isinstance(model, Flux2Transformer)
        assert model.config == TINY_DEV


def test_bfl_repo_root_finds_the_transformer_file(tmp_path, dev_model):
    # a BFL repo holds the DiT beside the autoencoder; only the DiT's keys mark the file
    save_file({"encoder.conv_in.weight": torch.zeros(2, 2)}, tmp_path / "ae.safetensors")
    save_bfl(dev_model, tmp_path / "flux2-dev.safetensors")
    assert load_transformer(tmp_path, dtype=torch.float32).config == TINY_DEV


def test_weights_equal_the_diffusers_tensors(dev_model, bfl_file):
    model = load_transformer(bfl_file, dtype=torch.float32)
    ref = dev_model.state_dict()
    d = TINY_DEV.hidden_size
    qkv = model.double_blocks[1].txt_attn.qkv.weight
    assert torch.equal(qkv[:d], ref["transformer_blocks.1.attn.add_q_proj.weight"])
    assert torch.equal(qkv[2 * d :], ref["transformer_blocks.1.attn.add_v_proj.weight"])
    ada = model.final_layer.adaLN_modulation[1].weight  # BFL (shift, scale); diffusers (scale, shift)
    assert torch.equal(ada[:d], ref["norm_out.linear.weight"][d:])
    assert torch.equal(
        model.single_blocks[0].linear1.weight, ref["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"]
    )


def test_table_agrees_with_diffusers_own_converter(dev_model):
    # diffusers' BFL -> diffusers converter (single-file loading) turns our BFL dict back into the model's
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    converted = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl_state_dict(dev_model)))
    ref = dev_model.state_dict()
    assert converted.keys() == ref.keys()
    assert all(torch.equal(converted[k], ref[k]) for k in ref)


def test_layout_round_trip_is_lossless(dev_model):
    ref = dev_model.state_dict()
    back: dict[str, torch.Tensor] = {}
    for rule in flux2_layout.rules(2, 2, True):
        back.update(flux2_layout.bfl_to_diffusers(rule, flux2_layout.diffusers_to_bfl(rule, ref.__getitem__)))
    assert back.keys() == ref.keys()
    assert all(torch.equal(back[k], ref[k]) for k in ref)


def test_sharded_diffusers_folder(tmp_path, dev_model):
    sharded = load_transformer(fx.sharded(dev_model, tmp_path / "t", "200KB"), dtype=torch.float32)
    assert fx.same_weights(
        sharded, load_transformer(save_diffusers(dev_model, tmp_path / "u"), dtype=torch.float32)
    )


def test_klein_is_detected(tmp_path):
    model = load_transformer(save_bfl(make_diffusers_flux2(False), tmp_path / "k.safetensors"))
    assert model.config == TINY_FLUX2
    assert model.guidance_in.__class__.__name__ == "Identity"


def test_dispatch_by_keys_not_names(tmp_path, dev_model):
    # a FLUX.1 file named like FLUX.2 stays FLUX.1, and the reverse
    flux1 = save_flux1_bfl(make_flux1(True), tmp_path / "flux2-dev.safetensors")
    flux2 = save_bfl(dev_model, tmp_path / "flux1-dev.safetensors")
    assert not is_flux2(flux1) and is_flux2(flux2) and is_flux2("tiny-flux2") and not is_flux2("tiny")
    assert isinstance(load_transformer(flux1), Flux1Transformer)
    assert load_transformer(flux2).config.family == "flux2"
    with pytest.raises(WeightsError, match=r"not a FLUX\.2 transformer"):
        load_flux2_transformer(flux1)


def test_config_json_sets_rope(tmp_path):
    # axes and theta are not in the tensors: a diffusers folder's config.json supplies them
    model = make_diffusers_flux2(False, axes_dims_rope=(4, 12, 8, 8), rope_theta=1000)
    loaded = load_transformer(save_diffusers(model, tmp_path / "t"))
    assert (loaded.config.axes_dim, loaded.config.theta) == ((4, 12, 8, 8), 1000)


def test_streams_to_dtype_and_meta_free(bfl_file):
    fx.assert_ready(load_transformer(bfl_file, dtype=torch.bfloat16), torch.bfloat16)


def _rename(sd, old, new):
    sd[new] = sd.pop(old)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda sd: sd.pop("double_blocks.1.img_mlp.2.weight"), r"missing 1 key\(s\): double_blocks.1.img_mlp.2.weight"),
        (  # a FLUX.1-style per-block modulation
            lambda sd: sd.update({"single_blocks.0.modulation.lin.weight": torch.zeros(2, 2)}),
            r"unexpected key\(s\): single_blocks.0.modulation.lin.weight",
        ),
        (
            lambda sd: sd.update({"single_blocks.1.linear2.weight": torch.zeros(64, 200)}),
            r"single_blocks.1.linear2.weight: expected shape \(64, 256\), checkpoint has \(64, 200\)",
        ),
        (
            lambda sd: _rename(sd, "final_layer.linear.weight", "proj_out.weight"),
            r"mixes BFL keys .* and diffusers keys \(proj_out\.weight",
        ),
    ],
    ids=["missing-key", "unexpected-key", "wrong-shape", "mixed-layouts"],
)  # fmt: skip
def test_broken_bfl_file_names_the_key(tmp_path, bfl_file, edit, message):
    with pytest.raises(WeightsError, match=message):
        load_transformer(fx.edited(bfl_file, edit, tmp_path / "broken.safetensors"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda sd: sd.pop("transformer_blocks.0.attn.add_k_proj.weight"),
            r"missing 1 key\(s\): transformer_blocks.0.attn.add_k_proj.weight",
        ),
        (
            lambda sd: sd.update({"transformer_blocks.1.attn.to_v.weight": torch.zeros(64, 63)}),
            r"transformer_blocks.1.attn.to_v.weight: expected shape \(64, 64\), checkpoint has \(64, 63\) "
            r"\(part of double_blocks.1.img_attn.qkv.weight\)",
        ),
    ],
    ids=["missing-key", "wrong-shape"],
)  # fmt: skip
def test_broken_diffusers_folder_names_the_key(tmp_path, dev_model, edit, message):
    folder = save_diffusers(dev_model, tmp_path / "t")
    fx.edited(folder / "diffusion_pytorch_model.safetensors", edit)
    with pytest.raises(WeightsError, match=message):
        load_transformer(folder)


def test_config_mismatch_is_named(bfl_file):
    with pytest.raises(WeightsError, match="depth: checkpoint 2, config 3"):
        load_transformer(bfl_file, config=replace(TINY_DEV, depth=3))
    with pytest.raises(WeightsError, match="family: checkpoint flux2, config flux1"):
        load_transformer(bfl_file, config=TINY)
    with pytest.raises(WeightsError, match="hidden_size: checkpoint 64, config 3072"):
        load_transformer(bfl_file, config=FLUX2_KLEIN_4B)


def test_config_gives_rope_for_a_bfl_file(bfl_file):
    model = load_transformer(bfl_file, config=replace(TINY_DEV, axes_dim=(4, 4, 12, 12), theta=500))
    assert (model.config.axes_dim, model.config.theta) == ((4, 4, 12, 12), 500)


def test_builtin_tiny_flux2_is_deterministic():
    a, b = load_transformer("tiny-flux2-random"), load_transformer("tiny-flux2-random")
    assert fx.same_weights(a, b)
    assert a.config == TINY_FLUX2 and isinstance(a, Flux2Transformer)
    img = torch.randn(1, 6, 128).to(torch.bfloat16)
    txt = torch.randn(1, 4, 96).to(torch.bfloat16)
    img_ids = torch.cartesian_prod(torch.tensor([0]), torch.arange(2), torch.arange(3), torch.tensor([0]))
    txt_ids = torch.cartesian_prod(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.arange(4))
    with torch.no_grad():
        out = a(img, img_ids, txt, txt_ids, torch.tensor([0.5], dtype=torch.bfloat16))
    assert out.shape == (1, 6, 128) and out.isfinite().all()
