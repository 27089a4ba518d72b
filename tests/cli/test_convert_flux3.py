"""flux-convert on FLUX.3: BFL file <-> diffusers folder, bit-identical round trips, our loaders read what
we write (equal weights, equal forward), diffusers loads the folder we write (equal outputs), and the
config.json we write is diffusers' own."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux_runtime import load_transformer
from flux_runtime.models.dit import FLUX3_KLEIN, FLUX3_KLEIN_BASE, TINY_FLUX3
from flux_runtime.weights.diffusers_config import transformer_diffusers_config
from tests.cli.convert_helpers import assert_identical as _assert_identical
from tests.cli.convert_helpers import config as _config
from tests.cli.convert_helpers import fail as _fail
from tests.cli.convert_helpers import run as _run
from tests.cli.convert_helpers import tensors as _tensors
from tests.flux3_fixtures import (
    as_loaded,
    make_diffusers_flux3,
    make_inputs,
    our_forward,
    reference_forward,
    save_bfl,
    save_diffusers,
)

PREFIX = "model.diffusion_model."


def _assert_same_model(a, b) -> None:
    """Two of our models hold equal tensors of equal dtypes under equal names."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_full_presets_write_diffusers_own_configs():
    """The config.json written for full FLUX.3 Klein (base, flow map) is what diffusers saves (built on meta)."""
    from diffusers import Flux3Transformer2DModel

    with torch.device("meta"):
        for preset in (FLUX3_KLEIN_BASE, FLUX3_KLEIN):
            theirs = Flux3Transformer2DModel(flow_map=preset.flow_map)
            ours = json.loads(json.dumps(transformer_diffusers_config(preset)))
            assert json.loads(theirs.to_json_string()) == ours, preset.flow_map


@pytest.mark.parametrize("flow_map", [False, True], ids=["base", "flow-map"])
def test_bfl_to_diffusers_to_bfl(tmp_path, flow_map):
    """A prefixed bf16 BFL file with REPA heads → a diffusers folder diffusers loads (equal outputs, its own
    config.json) and our loader reads (equal weights and forward) → back to BFL, bit for bit without the REPA heads."""
    from diffusers import Flux3Transformer2DModel

    model = as_loaded(make_diffusers_flux3(flow_map, seed=3), torch.bfloat16)
    repa = {f"{PREFIX}repa_projectors.0.weight": torch.randn(8, 64).bfloat16()}
    src = save_bfl(model, tmp_path / "klein.safetensors", PREFIX, repa)
    out = _run("transformer", src, tmp_path / "diffusers")
    assert "transformer: bfl -> diffusers" in out
    folder = tmp_path / "diffusers"
    assert _config(folder) == _config(save_diffusers(model, tmp_path / "theirs"))
    _assert_identical(_tensors(folder), _tensors(tmp_path / "theirs"))  # diffusers' own file, bit for bit

    x = make_inputs(1, 3, 2, 5, torch.bfloat16, seed=1, refs=((2, 2),), flow_map=flow_map)
    reloaded = Flux3Transformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    assert torch.equal(reference_forward(reloaded, x), reference_forward(model, x))
    from_bfl = load_transformer(src, dtype=torch.bfloat16)
    from_diffusers = load_transformer(folder, dtype=torch.bfloat16)
    _assert_same_model(from_bfl, from_diffusers)
    assert torch.equal(our_forward(from_diffusers, x), our_forward(from_bfl, x))

    out = _run("transformer", folder, tmp_path / "back.safetensors")
    assert "transformer: diffusers -> bfl" in out
    original = {k.removeprefix(PREFIX): v for k, v in _tensors(src).items() if "repa_projectors" not in k}
    back = _tensors(tmp_path / "back.safetensors")
    _assert_identical(back, original)
    assert {t.dtype for t in back.values()} == {torch.bfloat16, torch.float32}  # QK norms stay fp32
    _assert_same_model(load_transformer(tmp_path / "back.safetensors", dtype=torch.bfloat16), from_bfl)


def test_diffusers_to_bfl_to_sharded_diffusers(tmp_path):
    """fp32 diffusers folder → BFL (our table's file) → sharded diffusers: the source bit for bit, same forward."""
    from diffusers import Flux3Transformer2DModel

    model = make_diffusers_flux3(True)
    src = save_diffusers(model, tmp_path / "transformer")
    _run("transformer", src, tmp_path / "klein.safetensors")
    _assert_identical(
        _tensors(tmp_path / "klein.safetensors"), _tensors(save_bfl(model, tmp_path / "ref.safetensors"))
    )
    back = tmp_path / "back"
    _run("transformer", tmp_path / "klein.safetensors", back, "--max-shard-size", "300KB")
    assert len(list(back.glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    _assert_identical(_tensors(back), _tensors(src))
    assert _config(back) == _config(src)
    ours = load_transformer(back, dtype=torch.float32)
    assert ours.config == replace(TINY_FLUX3, flow_map=True)
    x = make_inputs(1, 2, 3, 4, torch.float32, seed=4, refs=((1, 2),), flow_map=True)
    reloaded = Flux3Transformer2DModel.from_pretrained(back).eval()
    assert torch.equal(reference_forward(reloaded, x), reference_forward(model, x))
    assert torch.equal(our_forward(ours, x), reference_forward(model, x))


def test_bad_sources_are_one_line(tmp_path):
    model = make_diffusers_flux3(False)
    src = save_diffusers(model, tmp_path / "transformer")
    (src / "config.json").write_text(json.dumps({**_config(src), "eps": 1e-5}))
    assert "BFL's FLUX.3 cannot express eps 1e-05 (BFL fixes 1e-06)" in _fail(
        "transformer", src, tmp_path / "o.safetensors"
    )
    assert not (tmp_path / "o.safetensors").exists()

    bfl = save_bfl(model, tmp_path / "k.safetensors")
    sd = load_file(bfl)
    del sd["single_blocks.1.v_proj.weight"]
    save_file(sd, tmp_path / "m.safetensors")
    assert "missing 1 key(s): single_blocks.1.v_proj.weight" in _fail(
        "transformer", tmp_path / "m.safetensors", tmp_path / "o"
    )
    sd = load_file(bfl)
    sd["txt_mode_blocks.0.k_proj.weight"] = torch.zeros(64, 63)
    save_file(sd, tmp_path / "s.safetensors")
    assert "txt_mode_blocks.0.k_proj.weight: expected shape (64, 64), checkpoint has (64, 63)" in _fail(
        "transformer", tmp_path / "s.safetensors", tmp_path / "o"
    )
    sd = load_file(bfl)
    sd["single_blocks.0.q_proj.weight"] = sd["single_blocks.0.q_proj.weight"].to(torch.float8_e4m3fn)
    save_file(sd, tmp_path / "fp8.safetensors")
    assert "an FP8 FLUX.3 checkpoint" in _fail("transformer", tmp_path / "fp8.safetensors", tmp_path / "o")
