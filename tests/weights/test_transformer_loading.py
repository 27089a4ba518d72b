"""load_transformer: layouts, prefixes, cached ids, and errors that name the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux_runtime import WeightsError, load_transformer
from flux_runtime.models.dit import TINY
from tests.flux1_fixtures import make_diffusers_transformer, save_bfl, save_diffusers


@pytest.fixture(scope="module")
def dev_model():
    return make_diffusers_transformer(True)


@pytest.fixture
def bfl_file(tmp_path, dev_model):
    return save_bfl(dev_model, tmp_path / "flux1-dev.safetensors")


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_layouts_and_prefix_load_the_same_weights(tmp_path, dev_model, bfl_file):
    from_bfl = load_transformer(bfl_file, dtype=torch.float32)
    prefixed = load_transformer(
        save_bfl(dev_model, tmp_path / "comfy.safetensors", "model.diffusion_model."), dtype=torch.float32
    )
    folder = save_diffusers(dev_model, tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    from_root = load_transformer(tmp_path / "pipe", dtype=torch.float32)
    from_folder = load_transformer(folder, dtype=torch.float32)
    assert _same_weights(from_bfl, prefixed)
    assert _same_weights(from_bfl, from_root)
    assert _same_weights(from_bfl, from_folder)
    cfg = from_bfl.config
    assert (cfg.depth, cfg.depth_single_blocks, cfg.hidden_size, cfg.num_heads, cfg.guidance_embed) == (
        2,
        2,
        64,
        2,
        True,
    )


def test_sharded_diffusers_folder(tmp_path, dev_model):
    dev_model.save_pretrained(tmp_path / "t", max_shard_size="200KB")
    assert (tmp_path / "t" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert _same_weights(
        load_transformer(tmp_path / "t", dtype=torch.float32),
        load_transformer(save_diffusers(dev_model, tmp_path / "u"), dtype=torch.float32),
    )


def test_schnell_is_detected(tmp_path):
    model = load_transformer(save_bfl(make_diffusers_transformer(False), tmp_path / "s.safetensors"))
    assert not model.config.guidance_embed
    assert model.guidance_in.__class__.__name__ == "Identity"


def test_streams_to_dtype_and_meta_free(bfl_file):
    model = load_transformer(bfl_file, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())


def test_missing_key(tmp_path, bfl_file):
    sd = load_file(bfl_file)
    del sd["double_blocks.1.img_attn.proj.bias"]
    save_file(sd, tmp_path / "m.safetensors")
    with pytest.raises(WeightsError, match=r"missing 1 key\(s\): double_blocks.1.img_attn.proj.bias"):
        load_transformer(tmp_path / "m.safetensors")


def test_unexpected_key(tmp_path, bfl_file):
    sd = load_file(bfl_file)
    sd["double_blocks.0.extra.weight"] = torch.zeros(2)
    save_file(sd, tmp_path / "u.safetensors")
    with pytest.raises(WeightsError, match=r"unexpected key\(s\): double_blocks.0.extra.weight"):
        load_transformer(tmp_path / "u.safetensors")


def test_wrong_shape_names_key_and_both_shapes(tmp_path, bfl_file):
    sd = load_file(bfl_file)
    sd["single_blocks.0.linear2.weight"] = torch.zeros(64, 300)
    save_file(sd, tmp_path / "w.safetensors")
    with pytest.raises(
        WeightsError,
        match=r"single_blocks.0.linear2.weight: expected shape \(64, 320\), checkpoint has \(64, 300\)",
    ):
        load_transformer(tmp_path / "w.safetensors")


def test_wrong_shape_in_diffusers_layout(tmp_path, dev_model):
    folder = save_diffusers(dev_model, tmp_path / "t")
    sd = load_file(folder / "diffusion_pytorch_model.safetensors")
    sd["transformer_blocks.0.attn.to_k.weight"] = torch.zeros(64, 63)
    save_file(sd, folder / "diffusion_pytorch_model.safetensors")
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
    # Lay out a Hugging Face cache entry by hand, as `hf download` would leave it.
    cache = tmp_path / "hub"
    repo = cache / "models--black-forest-labs--FLUX.1-dev"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    save_diffusers(dev_model, snap / "transformer")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    model = load_transformer("black-forest-labs/FLUX.1-dev", dtype=torch.float32)
    assert model.config.guidance_embed


def test_builtin_tiny_is_deterministic():
    a, b = load_transformer("tiny-random"), load_transformer("tiny-random")
    assert _same_weights(a, b)
    assert a.config == TINY
