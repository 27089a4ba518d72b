"""FLUX.2 LoRAs (diffusers, kohya, BFL-named) fused into a tiny transformer: diffusers' fused bits."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.weights import load_transformer
from flux_runtime.weights.lora import unfuse
from flux_runtime.weights.lora_formats import LoraError
from tests.flux2_fixtures import make_diffusers_flux2, save_diffusers
from tests.lora import lora_fixtures as lf

DEPTH, SINGLE = 2, 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = save_diffusers(make_diffusers_flux2(True), tmp_path_factory.mktemp("flux2") / "transformer")
    from diffusers import Flux2Transformer2DModel

    sd = Flux2Transformer2DModel.from_pretrained(folder).state_dict()
    return folder, lf.bfl_shapes(sd, "flux2", DEPTH, SINGLE, True), lf.diffusers_shapes(sd)


def reference(folder, dtype, files_scales):
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel

    tr = Flux2Transformer2DModel.from_pretrained(folder, torch_dtype=dtype)
    lf.diffusers_fused(Flux2Pipeline(None, None, None, None, tr), files_scales)
    return lf.fused_bfl(tr, "flux2")


@lf.DTYPES
def test_flux2_layouts(base, tmp_path, dtype):
    folder, shapes, dshapes = base
    mods = lf.blocks("flux2", DEPTH, SINGLE)
    kohya = lf.kohya_file(tmp_path / "k.safetensors", shapes, [*mods, "img_in", "final_layer.linear"], rank=3,
                          alpha=1.0, dtype=dtype, seed=1)  # fmt: skip
    bfl = lf.bfl_file(tmp_path / "b.safetensors", shapes, [*mods, "final_layer.adaLN_modulation.1", "txt_in", "double_stream_modulation_img.lin"], rank=2, seed=2)  # fmt: skip
    peft = lf.peft_file(tmp_path / "p.safetensors", dshapes, ["transformer_blocks.1.attn.add_k_proj",
                        "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "norm_out.linear"], rank=4, seed=3)  # fmt: skip
    runs = [(kohya, 0.6), (bfl, 1.0), (peft, 1.5)]
    model, state = lf.ours(folder, dtype, runs)
    lf.assert_same(model, reference(folder, dtype, runs))
    base_sd = load_transformer(folder, device="cpu", dtype=dtype).state_dict()
    unfuse(model, None, state)
    lf.assert_same(model, base_sd)


def test_flux1_lora_on_flux2_is_refused(base, tmp_path):
    folder, _, _ = base
    from tests.flux1_fixtures import make_diffusers_transformer

    sd1 = make_diffusers_transformer(True).state_dict()
    shapes1 = lf.bfl_shapes(sd1, "flux1", 2, 2, True)
    path = lf.kohya_file(tmp_path / "f1.safetensors", shapes1, ["double_blocks.0.img_mod.lin"])
    with pytest.raises(
        LoraError, match=r"f1.safetensors is a FLUX.1 LoRA \(keys like lora_unet_double_blocks_0_img_mod_lin"
    ):
        lf.ours(folder, torch.float32, [(path, 1.0)])
