"""LoRAs on FP8 layers: dequantized to bf16, every LoRA added in order, requantized; unload gives back the
very e4m3 bytes and scales. The state is checked on the CPU; the GPU test runs an FP8 pipeline end to end."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.models.dit.layers import Fp8Linear
from flux_runtime.weights import load_transformer
from flux_runtime.weights.fp8 import Fp8Tensors, _install, dequantize, quantize_weight
from flux_runtime.weights.lora import FusedState, lora_delta, unfuse
from tests.flux1_fixtures import make_diffusers_transformer, save_diffusers
from tests.lora import lora_fixtures as lf

FP8 = ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear1")


def _fp8_model(folder):
    model = load_transformer(folder, device="cpu", dtype=torch.bfloat16)
    sd = {}
    for name in FP8:
        old = model.get_submodule(name)
        _install(model, {name: quantize_weight(old.weight.data)}, sd, torch.bfloat16)
        sd[f"{name}.bias"] = old.bias.data
    model.load_state_dict(sd, strict=False, assign=True)
    return model


def test_fp8_layers_are_requantized_and_restored(tmp_path):
    folder = save_diffusers(make_diffusers_transformer(True), tmp_path / "t")
    model = _fp8_model(folder)
    shapes = {
        n: (m.out_features, m.in_features) for n, m in model.named_modules() if hasattr(m, "in_features")
    }
    orig = {n: (model.get_submodule(n).weight, model.get_submodule(n).weight_scale) for n in FP8}
    a = lf.kohya_file(tmp_path / "a.safetensors", shapes, [*FP8, "double_blocks.1.img_mlp.0"], seed=1)
    b = lf.bfl_file(tmp_path / "b.safetensors", shapes, [FP8[0]], seed=2)
    state = FusedState()
    report, wa, table = lf.fuse_file(model, a, 0.5, state)
    assert (report.layers, report.fp8_layers) == (3, 2)
    _, wb, _ = lf.fuse_file(model, b, 1.0, state)

    # qkv: its original in bf16, a's three q/k/v updates then b's, added in that order, quantized again
    layer = table.layers[FP8[0]]
    w = dequantize(Fp8Tensors(*orig[FP8[0]], None), torch.bfloat16)
    for weights, scale in ((wa, 0.5), (wb, 1.0)):
        for i, part in enumerate(layer.parts):
            rows = slice(layer.offset(i), layer.offset(i) + layer.sizes[i])
            w[rows] += lora_delta(weights.transformer[part], scale, w[rows])[0]
    want = quantize_weight(w)
    got = model.get_submodule(FP8[0])
    assert isinstance(got, Fp8Linear) and got.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert torch.equal(got.weight_scale, want.weight_scale)

    unfuse(model, None, state)
    for n in FP8:
        assert (
            model.get_submodule(n).weight is orig[n][0] and model.get_submodule(n).weight_scale is orig[n][1]
        )


@pytest.mark.gpu
def test_fp8_pipeline_lora_recaptures_graphs_and_unloads(tmp_path):
    """On CUDA: an FP8 tiny pipeline with CUDA graphs; a LoRA changes the image (graphs re-captured, so the
    graphed image equals the eager one), the provenance says how FP8 layers were fused, and unloading gives
    the first image back bit for bit."""
    from flux_runtime.pipeline import Pipeline

    pipe = Pipeline.from_pretrained("tiny", device="cuda", dtype=torch.bfloat16, fp8=True)
    eager = Pipeline.from_pretrained("tiny", device="cuda", dtype=torch.bfloat16, fp8=True, cuda_graphs=False)
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in pipe.transformer.named_modules()
        if hasattr(m, "in_features")
    }
    cfg = pipe.transformer.config
    path = lf.kohya_file(
        tmp_path / "l.safetensors", shapes, lf.blocks("flux1", cfg.depth, cfg.depth_single_blocks), seed=3
    )
    kw = dict(seed=7, num_steps=3, width=128, height=128, output_type="latent")
    before = [pipe("a red fox", **kw).latents for _ in range(3)]  # eager, captured, replayed
    assert all(torch.equal(before[0], x) for x in before)
    for p in (pipe, eager):
        loaded = p.load_lora(path, scale=0.8)
        assert loaded.fp8_layers > 0
    after = [pipe("a red fox", **kw) for _ in range(3)]
    want = eager("a red fox", **kw).latents
    assert all(torch.equal(a.latents, want) for a in after) and not torch.equal(want, before[0])
    assert after[-1].info["cuda_graphs"] and "requantized" in after[-1].info["lora_fp8"]
    pipe.unload_loras()
    restored = [pipe("a red fox", **kw).latents for _ in range(3)]
    assert all(torch.equal(before[0], x) for x in restored)
