"""load_transformer: layouts, prefixes, cached ids, and errors that name the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from flux_runtime import WeightsError, load_transformer
from flux_runtime.models.dit import TINY
from tests import flux1_fixtures
from tests.flux1_fixtures import make_diffusers_transformer, save_bfl, save_diffusers
from tests.weights import loading_fixtures as fx

dev_model, bfl_file = fx.dit_fixtures(
    lambda: make_diffusers_transformer(True), save_bfl, "flux1-dev.safetensors"
)


def test_layouts_and_prefix_load_the_same_weights(tmp_path, dev_model, bfl_file):
    from_bfl, *_ = fx.dits_every_way(tmp_path, dev_model, bfl_file, flux1_fixtures)
    cfg = from_bfl.config
    assert (cfg.depth, cfg.depth_single_blocks, cfg.hidden_size, cfg.num_heads, cfg.guidance_embed) == (
        2,
        2,
        64,
        2,
        True,
    )


def test_sharded_diffusers_folder(tmp_path, dev_model):
    assert fx.same_weights(
        load_transformer(fx.sharded(dev_model, tmp_path / "t", "200KB"), dtype=torch.float32),
        load_transformer(save_diffusers(dev_model, tmp_path / "u"), dtype=torch.float32),
    )


def test_schnell_is_detected(tmp_path):
    model = load_transformer(save_bfl(make_diffusers_transformer(False), tmp_path / "s.safetensors"))
    assert not model.config.guidance_embed
    assert model.guidance_in.__class__.__name__ == "Identity"


def test_streams_to_dtype_and_meta_free(bfl_file):
    fx.assert_ready(load_transformer(bfl_file, dtype=torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda sd: sd.pop("double_blocks.1.img_attn.proj.bias"), r"missing 1 key\(s\): double_blocks.1.img_attn.proj.bias"),
        (lambda sd: sd.update({"double_blocks.0.extra.weight": torch.zeros(2)}), r"unexpected key\(s\): double_blocks.0.extra.weight"),
        (
            lambda sd: sd.update({"single_blocks.0.linear2.weight": torch.zeros(64, 300)}),
            r"single_blocks.0.linear2.weight: expected shape \(64, 320\), checkpoint has \(64, 300\)",
        ),
    ],
    ids=["missing-key", "unexpected-key", "wrong-shape"],
)  # fmt: skip
def test_broken_file_names_the_key(tmp_path, bfl_file, edit, message):
    with pytest.raises(WeightsError, match=message):
        load_transformer(fx.edited(bfl_file, edit, tmp_path / "broken.safetensors"))


def test_wrong_shape_in_diffusers_layout(tmp_path, dev_model):
    folder = save_diffusers(dev_model, tmp_path / "t")
    fx.edited(
        folder / "diffusion_pytorch_model.safetensors",
        lambda sd: sd.update({"transformer_blocks.0.attn.to_k.weight": torch.zeros(64, 63)}),
    )
    with pytest.raises(
        WeightsError,
        match=r"transformer_blocks.0.attn.to_k.weight: expected shape \(64, 64\), checkpoint has \(64, 63\)",
    ):
        load_transformer(folder)


def test_config_mismatch_is_named(bfl_file):
    from dataclasses import replace

    with pytest.raises(WeightsError, match="depth: checkpoint 2, config 3"):
        load_transformer(bfl_file, config=replace(TINY, depth=3))


def test_unknown_layout(tmp_path):
    save_file({"encoder.conv_in.weight": torch.zeros(2, 2)}, tmp_path / "x.safetensors")
    with pytest.raises(WeightsError, match="unknown checkpoint layout"):
        load_transformer(tmp_path / "x.safetensors")


def test_empty_file(tmp_path):
    (tmp_path / "e.safetensors").write_bytes(b"")
    with pytest.raises(WeightsError, match="is empty"):
        load_transformer(tmp_path / "e.safetensors")


def test_truncated_file(tmp_path, bfl_file):
    data = bfl_file.read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated"):
        load_transformer(tmp_path / "t.safetensors")


def test_not_safetensors(tmp_path):
    (tmp_path / "n.safetensors").write_text(json.dumps({"hello": "world"}) * 10)
    with pytest.raises(WeightsError, match="not a safetensors file"):
        load_transformer(tmp_path / "n.safetensors")


def test_bad_index_names_missing_shard(tmp_path, dev_model):
    dev_model.save_pretrained(tmp_path / "t", max_shard_size="200KB")
    shards = sorted((tmp_path / "t").glob("*.safetensors"))
    shards[0].unlink()
    with pytest.raises(WeightsError, match="names shards that are not there"):
        load_transformer(tmp_path / "t")


def test_unknown_model_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        WeightsError, match=r"'black-forest-labs/FLUX.1-nope' is not in the local Hugging Face cache"
    ):
        load_transformer("black-forest-labs/FLUX.1-nope")


def test_not_a_path_nor_an_id():
    with pytest.raises(WeightsError, match="neither an existing file or folder nor a Hugging Face model id"):
        load_transformer("./no/such/file.safetensors")


def test_cached_model_id_loads(tmp_path, monkeypatch, dev_model):
    snap = fx.cached_snapshot(tmp_path, monkeypatch, "black-forest-labs/FLUX.1-dev")
    save_diffusers(dev_model, snap / "transformer")
    model = load_transformer("black-forest-labs/FLUX.1-dev", dtype=torch.float32)
    assert model.config.guidance_embed


def test_builtin_tiny_is_deterministic():
    a, b = load_transformer("tiny-random"), load_transformer("tiny-random")
    assert fx.same_weights(a, b)
    assert a.config == TINY
