"""FLUX.3 transformers load strictly from BFL single files and diffusers folders, through `load_transformer`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from flux_runtime import load_transformer
from flux_runtime.models.dit import TINY_FLUX3
from flux_runtime.models.dit.flux3 import Flux3Transformer
from flux_runtime.weights import WeightsError
from flux_runtime.weights.checkpoint import open_transformer
from flux_runtime.weights.flux2_transformer import load_flux2_transformer
from tests import flux3_fixtures as f3


@pytest.fixture(scope="module")
def models():
    return {False: f3.make_diffusers_flux3(False), True: f3.make_diffusers_flux3(True, seed=5)}


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    """Each model as a diffusers folder and as a prefixed BFL file holding the training-only REPA heads too."""
    root = tmp_path_factory.mktemp("flux3")
    out = {}
    for flow_map, model in models.items():
        name = "flow" if flow_map else "base"
        repa = {"model.diffusion_model.repa_projectors.0.weight": torch.randn(8, 64)}
        out[flow_map] = {
            "diffusers": f3.save_diffusers(model, root / name / "transformer"),
            "bfl": f3.save_bfl(model, root / f"{name}.safetensors", "model.diffusion_model.", repa),
        }
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
@pytest.mark.parametrize("flow_map", [False, True], ids=["base", "flow-map"])
def test_loaded_model_equals_diffusers_from_pretrained(saved, flow_map, layout, dtype):
    from diffusers import Flux3Transformer2DModel

    assert open_transformer(saved[flow_map][layout]).family == "flux3"
    ours = load_transformer(saved[flow_map][layout], dtype=dtype)
    assert isinstance(ours, Flux3Transformer) and ours.config.flow_map is flow_map
    assert ours.config == replace(TINY_FLUX3, flow_map=flow_map)
    norms = {p.dtype for n, p in ours.named_parameters() if n.endswith("_norm.scale")}
    assert norms == {torch.float32} and ours.txt_in.weight.dtype == dtype
    # the reference loaded the way diffusers users load it (QK norms kept fp32)
    ref = Flux3Transformer2DModel.from_pretrained(saved[flow_map]["diffusers"], torch_dtype=dtype).eval()
    x = f3.make_inputs(1, 3, 3, 6, dtype, seed=2, refs=((2, 2),), flow_map=flow_map)
    assert torch.equal(f3.our_forward(ours, x), f3.reference_forward(ref, x))


def test_builtin_random_model_loads():
    model = load_transformer("tiny-flux3-random", dtype=torch.bfloat16)
    assert isinstance(model, Flux3Transformer) and model.config == TINY_FLUX3
    assert model.time_in.in_layer.weight.dtype == torch.bfloat16
    assert model.txt_mode_blocks[0].norm.query_norm.scale.dtype == torch.float32
    again = load_transformer("tiny-flux3-random", dtype=torch.float32)
    assert torch.equal(again.txt_in.weight.bfloat16(), model.txt_in.weight)  # one seed, any dtype


def test_broken_checkpoints_are_refused_by_name(models, tmp_path):
    sd = f3.bfl_state_dict(models[False])
    cases = {
        "missing": ({k: v for k, v in sd.items() if k != "single_blocks.1.mlp_out.weight"}, "missing 1 key"),
        "unexpected": ({**sd, "single_blocks.0.extra.weight": torch.zeros(2)}, "unexpected key"),
        "misshapen": (
            {**sd, "txt_mode_blocks.1.q_proj.weight": torch.zeros(64, 32)},
            r"txt_mode_blocks.1.q_proj.weight: expected shape \(64, 64\)",
        ),
        "mixed": ({**sd, "proj_out.weight": torch.zeros(128, 64)}, "mixes BFL keys"),
    }
    for name, (tensors, message) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(WeightsError, match=message):
            load_transformer(path, dtype=torch.float32)
    good = tmp_path / "good.safetensors"
    save_file(sd, str(good))
    with pytest.raises(WeightsError, match=r"not a FLUX\.2 transformer"):
        load_flux2_transformer(good)
    with pytest.raises(WeightsError, match=r"fp8=True computes in bf16"):  # FP8: tests/fp8/test_flux3_fp8.py
        load_transformer(good, fp8=True, dtype=torch.float32)
