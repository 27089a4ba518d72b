"""FLUX.1 LoRAs of every layout fused into a tiny transformer: the weights diffusers' fuse_lora gives, bit for bit."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.weights import load_transformer
from flux_runtime.weights.lora import unfuse
from tests.flux1_fixtures import make_diffusers_transformer, save_diffusers
from tests.lora import lora_fixtures as lf

DEPTH, SINGLE = 2, 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = save_diffusers(
        make_diffusers_transformer(True), tmp_path_factory.mktemp("flux1") / "transformer"
    )
    from diffusers import FluxTransformer2DModel

    sd = FluxTransformer2DModel.from_pretrained(folder).state_dict()
    return folder, lf.bfl_shapes(sd, "flux1", DEPTH, SINGLE, True), lf.diffusers_shapes(sd)


def reference(folder, dtype, files_scales):
    """diffusers: load_lora_weights + fuse_lora(lora_scale) + unload_lora_weights per file, in order."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    tr = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=dtype)
    lf.diffusers_fused(FluxPipeline(None, None, None, None, None, None, tr), files_scales)
    return lf.fused_bfl(tr, "flux1")


@lf.DTYPES
def test_kohya(base, tmp_path, dtype):
    folder, shapes, _ = base
    # FLUX.1 single-block linear1 is left out: diffusers splits it at FLUX.1-dev's widths (3072 / 12288)
    mods = [m for m in lf.blocks("flux1", DEPTH, SINGLE) if not m.endswith("linear1")]
    a = lf.kohya_file(tmp_path / "a.safetensors", shapes, mods, rank=4, alpha=1.0, dtype=dtype, seed=1)
    b = lf.kohya_file(tmp_path / "b.safetensors", shapes, mods[:5], rank=2, alpha=3.0, seed=2, comfy=True)
    want = reference(folder, dtype, [(a, 0.8), (b, 1.0)])
    model, _ = lf.ours(folder, dtype, [(a, 0.8), (b, 1.0)])
    lf.assert_same(model, want)


@lf.DTYPES
def test_peft_with_alphas_and_without_prefix(base, tmp_path, dtype):
    folder, _, dshapes = base
    mods = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v", "transformer_blocks.1.ff.net.2",
            "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.1.attn.to_k", "norm_out.linear",
            "x_embedder", "time_text_embed.guidance_embedder.linear_1", "context_embedder", "proj_out"]  # fmt: skip
    alphas = {mods[0]: 2.0, mods[3]: 8.0, mods[5]: 1.0}
    a = lf.peft_file(tmp_path / "a.safetensors", dshapes, mods, rank=4, alphas=alphas, seed=3)
    b = lf.peft_file(tmp_path / "b.safetensors", dshapes, mods[2:7], rank=3, dtype=torch.bfloat16, seed=4)
    meta = {
        "r": 2,
        "lora_alpha": 4,
        "rank_pattern": {},
        "alpha_pattern": {"proj_out": 1},
        "target_modules": mods,
    }
    c = lf.peft_file(tmp_path / "c.safetensors", dshapes, mods, rank=2, seed=5, metadata=meta)
    want = reference(folder, dtype, [(a, 0.7), (b, 1.0), (c, 1.3)])
    # the same three, b without the transformer. prefix (diffusers reads only prefixed keys)
    b2 = lf.peft_file(
        tmp_path / "b2.safetensors", dshapes, mods[2:7], rank=3, dtype=torch.bfloat16, seed=4, prefix=""
    )
    model, _ = lf.ours(folder, dtype, [(a, 0.7), (b2, 1.0), (c, 1.3)])
    lf.assert_same(model, want)


@lf.DTYPES
def test_xlabs(base, tmp_path, dtype):
    folder, shapes, _ = base
    a = lf.xlabs_file(tmp_path / "a.safetensors", shapes, DEPTH, SINGLE, seed=6)
    want = reference(folder, dtype, [(a, 0.9)])
    model, _ = lf.ours(folder, dtype, [(a, 0.9)])
    lf.assert_same(model, want)


def test_unfuse_restores_exactly_and_saves_only_touched_layers(base, tmp_path):
    folder, shapes, _ = base
    mods = ["double_blocks.0.img_attn.qkv", "single_blocks.1.linear1", "final_layer.adaLN_modulation.1"]
    a = lf.kohya_file(tmp_path / "a.safetensors", shapes, mods, seed=7)
    b = lf.bfl_file(tmp_path / "b.safetensors", shapes, [*mods[:1], "img_in"], seed=8)
    base_sd = {
        k: v.clone()
        for k, v in load_transformer(folder, device="cpu", dtype=torch.float32).state_dict().items()
    }
    model, state = lf.ours(folder, torch.float32, [(a, 1.0), (b, -0.5)])
    assert {name for _, name in state.saved} == {*mods, "img_in"}
    assert any(not torch.equal(model.state_dict()[k], base_sd[k]) for k in base_sd)
    unfuse(model, None, state)
    assert state.empty
    lf.assert_same(model, base_sd)
