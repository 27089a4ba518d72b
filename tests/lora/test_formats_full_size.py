"""Each FLUX.1 layout converted at FLUX.1 [dev]'s real widths and depths equals diffusers' own conversion.

diffusers' converters for kohya's merged single-block layers, BFL control LoRAs and fal LoRAs are written
for FLUX.1 [dev]'s sizes (19 / 38 blocks, width 3072), so these run there; the LoRAs are rank 3, small.
"""

from __future__ import annotations

import pytest
import torch

from flux_runtime.models.dit import FLUX1_DEV, Flux1Transformer
from flux_runtime.weights.lora_layers import LayerTable
from tests.lora import lora_fixtures as lf

CLIP = {f"text_model.encoder.layers.{i}.{m}" for i in range(12) for m in
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")}  # fmt: skip


@pytest.fixture(scope="module")
def table():
    with torch.device("meta"):
        model = Flux1Transformer(FLUX1_DEV)
    return LayerTable.of(model)


@pytest.fixture(scope="module")
def shapes(table):
    return {name: (layer.out_features, layer.in_features) for name, layer in table.layers.items()}


def ours(path, table, clip=None):
    w = lf.converted(path, table, clip)
    out = {}
    for m, f in w.transformer.items():
        out[f"{m}.lora_A.weight"], out[f"{m}.lora_B.weight"] = f.down, f.up
        if f.up_bias is not None:
            out[f"{m}.lora_B.bias"] = f.up_bias
        assert f.scaling == 1.0  # these layouts bake their scale in (or have none)
    out.update(w.norms)
    return w, out


def diffusers_view(path):
    from diffusers import FluxPipeline

    sd = FluxPipeline.lora_state_dict(str(path))
    return {k.removeprefix("transformer."): v for k, v in sd.items() if not k.startswith("text_encoder.")}


def same(got, want):
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))[:6]
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} differ, e.g. {bad[:3]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kohya_every_block(table, shapes, tmp_path, dtype):
    from safetensors.torch import load_file, save_file

    mods = [*lf.blocks("flux1", 19, 38), "final_layer.linear", "final_layer.adaLN_modulation.1"]
    path = lf.kohya_file(tmp_path / "k.safetensors", shapes, mods, rank=3, alpha=1.0, dtype=dtype,
                         te={"text_model.encoder.layers.0.self_attn.q_proj": (768, 768)})  # fmt: skip
    # one merged layer block-diagonal (each of q, k, v its own rank slice): split into blocks, not shared
    sd = load_file(str(path))
    up = sd["lora_unet_double_blocks_3_img_attn_qkv.lora_up.weight"]
    for j in range(3):
        for k in range(3):
            if j != k:
                up[j * 3072 : (j + 1) * 3072, k] = 0
    save_file(sd, str(path))
    w, got = ours(path, table, CLIP)
    assert w.format == "kohya" and list(w.text_encoder) == ["text_model.encoder.layers.0.self_attn.q_proj"]
    assert w.transformer["transformer_blocks.3.attn.to_q"].down.shape[0] == 1  # the sparse split
    same(got, diffusers_view(path))


def test_bfl_control_lora(table, shapes, tmp_path):
    """BFL's FLUX.1 Depth/Canny LoRA: every layer with lora_B.bias, img_in 128 wide, QK-norm scales."""
    mods = [
        *lf.blocks("flux1", 19, 38),
        "img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "vector_in.in_layer", "vector_in.out_layer",
        "guidance_in.in_layer", "guidance_in.out_layer", "final_layer.linear", "final_layer.adaLN_modulation.1",
    ]  # fmt: skip
    norms = {f"{b}.norm.{q}.scale": 128 for b in [f"double_blocks.{i}.img_attn" for i in range(19)]
             + [f"double_blocks.{i}.txt_attn" for i in range(19)] + [f"single_blocks.{i}" for i in range(38)]
             for q in ("query_norm", "key_norm")}  # fmt: skip
    path = lf.bfl_file(tmp_path / "c.safetensors", shapes, mods, rank=3, prefix="", bias=True, norms=norms,
                       widths={"img_in": 128}, dtype=torch.bfloat16)  # fmt: skip
    w, got = ours(path, table)
    assert w.format == "bfl-control" and w.transformer["x_embedder"].down.shape == (3, 128)
    same(got, diffusers_view(path))


def test_fal_lora(table, shapes, tmp_path):
    mods = [*lf.blocks("flux1", 19, 38), "final_layer.linear"]
    path = lf.bfl_file(tmp_path / "f.safetensors", shapes, mods, rank=3, prefix="base_model.model.")
    w, got = ours(path, table)
    assert w.format == "bfl"
    same(got, diffusers_view(path))


def test_xlabs_at_full_size(table, shapes, tmp_path):
    path = lf.xlabs_file(tmp_path / "x.safetensors", shapes, 19, 38, rank=2)
    w, got = ours(path, table)
    assert w.format == "xlabs"
    same(got, diffusers_view(path))
