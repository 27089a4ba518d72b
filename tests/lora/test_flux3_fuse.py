"""FLUX.3 LoRAs (diffusers / PEFT written by peft itself, BFL-named, kohya) fused into a tiny transformer: the
weights diffusers' FLUX.3 loader + fuse_lora gives, bit for bit; unfused exactly; other families refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from flux_runtime.models.dit import TINY, TINY_FLUX2, Flux1Transformer, Flux2Transformer
from flux_runtime.weights import flux3_layout, load_transformer
from flux_runtime.weights.lora import FusedState, unfuse
from flux_runtime.weights.lora_formats import LoraError, convert, read_lora
from flux_runtime.weights.lora_layers import LayerTable
from tests.flux3_fixtures import bfl_state_dict, make_diffusers_flux3, save_diffusers
from tests.lora import lora_fixtures as lf

DEPTH, SINGLE = 2, 2
# every projection of a FLUX.3 model outside its blocks (BFL names), the flow map's target embedder included
GLOBALS = (
    "emb_in.image", "emb_in.image_cond", "txt_in", "time_in.in_layer", "time_in.out_layer",
    "ref_time_in.in_layer", "ref_time_in.out_layer", "early_stream_modulations.txt.lin",
    "early_stream_modulations.image.lin", "single_stream_modulations.image_cond.lin",
    "final_layer.image.linear", "final_layer.image.adaLN_modulation.1",
)  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny flow-map FLUX.3 folder, {bfl module: (out, in)} and {diffusers module: (out, in)}."""
    folder = save_diffusers(
        make_diffusers_flux3(True, seed=4), tmp_path_factory.mktemp("flux3") / "transformer"
    )
    from diffusers import Flux3Transformer2DModel

    sd = Flux3Transformer2DModel.from_pretrained(folder).state_dict()
    model = load_transformer(folder, device="cpu", dtype=torch.float32)
    return folder, lf.linear_shapes(model), lf.diffusers_shapes(sd)


def diffusers_pipe(transformer):
    """diffusers' FLUX.3 modular pipeline holding only `transformer` (its LoRA loader is the pipeline's)."""
    from diffusers.modular_pipelines.flux3 import Flux3AutoBlocks

    pipe = Flux3AutoBlocks().init_pipeline()
    pipe.update_components(transformer=transformer)
    return pipe


def reference(folder, dtype, files_scales):
    """diffusers: load_lora_weights + fuse_lora(lora_scale) + unload_lora_weights per file, in order."""
    from diffusers import Flux3Transformer2DModel

    tr = Flux3Transformer2DModel.from_pretrained(folder, torch_dtype=dtype)
    lf.diffusers_fused(diffusers_pipe(tr), files_scales)
    return bfl_state_dict(tr)


def peft_written(folder, path, targets, *, rank=4, alpha=6, rank_pattern=None, alpha_pattern=None, seed=0):
    """A diffusers FLUX.3 LoRA as diffusers + peft write one: adapters added by peft (random A and B), saved with
    their `lora_adapter_metadata` by the FLUX.3 loader's `save_lora_weights`."""
    from diffusers import Flux3Transformer2DModel
    from diffusers.loaders import Flux3LoraLoaderMixin
    from peft import LoraConfig, get_peft_model_state_dict

    tr = Flux3Transformer2DModel.from_pretrained(folder)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
        rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
    )  # fmt: skip
    torch.manual_seed(seed)
    tr.add_adapter(config)
    Flux3LoraLoaderMixin.save_lora_weights(
        path.parent, transformer_lora_layers=get_peft_model_state_dict(tr),
        weight_name=path.name, transformer_lora_adapter_metadata=config.to_dict(),
    )  # fmt: skip
    return path


@lf.DTYPES
def test_flux3_layouts_equal_diffusers(base, tmp_path, dtype):
    """A peft-written diffusers LoRA (rank / alpha patterns in its metadata) and a BFL-named one on every block
    projection, stacked at two scales: diffusers' fused weights; unfused: the base weights again."""
    folder, shapes, dshapes = base
    targets = [m for m in dshapes if ".attn.to_" in m or ".ff." in m][::2]
    peft = peft_written(folder, tmp_path / "p.safetensors", targets, rank_pattern={targets[1]: 2},
                        alpha_pattern={targets[2]: 3}, seed=3)  # fmt: skip
    bfl = lf.bfl_file(tmp_path / "b.safetensors", shapes, lf.flux3_blocks(DEPTH, SINGLE), rank=3, seed=2)
    runs = [(peft, 0.7), (bfl, 1.0)]
    model, state = lf.ours(folder, dtype, runs)
    lf.assert_same(model, reference(folder, dtype, runs))
    unfuse(model, None, state)
    lf.assert_same(model, load_transformer(folder, device="cpu", dtype=dtype).state_dict())


@lf.DTYPES
def test_layers_outside_the_blocks_fuse_where_diffusers_names_them(base, tmp_path, dtype):
    """BFL and kohya LoRAs on the embedders, modulations and final layer (which diffusers' BFL converter leaves
    unnamed, so it drops them): fused as diffusers fuses the same factors written under its own names, the final
    adaLN's lora_B halves swapped into diffusers' (scale, shift) order; kohya's alpha / rank in the factors."""
    folder, shapes, _ = base
    bfl = lf.bfl_file(tmp_path / "b.safetensors", shapes, list(GLOBALS), rank=2, seed=5)
    kohya_mods = ["final_layer.image.adaLN_modulation.1", "txt_in", "single_blocks.1.mlp_in"]
    kohya = lf.kohya_file(tmp_path / "k.safetensors", shapes, kohya_mods, rank=4, alpha=2.0, seed=6)

    # the same factors under diffusers' names, written here: a file diffusers reads whole
    names = {r.bfl.removesuffix(".weight"): r for r in flux3_layout.rules(DEPTH, SINGLE, True)}
    named = {}
    for path, scale in ((bfl, 1.0), (kohya, 0.5)):  # kohya: alpha 2 / rank 4, baked into lora_down
        sd, _ = read_lora(path.read_bytes(), path.name)
        for key, t in sd.items():
            if key.endswith(".alpha"):
                continue
            module, _, leaf = (
                key.removeprefix("diffusion_model.").removeprefix("lora_unet_").partition(".lora")
            )
            module = next(m for m in names if m == module or m.replace(".", "_") == module)
            rule = names[module]
            up = leaf in ("_B.weight", "_up.weight")
            if up and rule.swap_halves:
                t = torch.cat(t.chunk(2, dim=0)[::-1])
            if not up:
                t = t * scale
            named.setdefault(path, {})[f"transformer.{rule.diffusers[0].removesuffix('.weight')}.lora_{'B' if up else 'A'}.weight"] = t  # fmt: skip
    files = []
    for i, sd in enumerate(named.values()):
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / f"d{i}.safetensors"))
        files.append(tmp_path / f"d{i}.safetensors")

    model, state = lf.ours(folder, dtype, [(bfl, 0.8), (kohya, 1.2)])
    lf.assert_same(model, reference(folder, dtype, [(files[0], 0.8), (files[1], 1.2)]))
    unfuse(model, None, state)
    lf.assert_same(model, load_transformer(folder, device="cpu", dtype=dtype).state_dict())


def test_layouts_are_told_from_the_module_names(base, tmp_path):
    """`txt_mode_blocks.N` starts both namings: the leaf tells them, with or without a prefix."""
    folder, shapes, dshapes = base
    model = load_transformer(folder, device="cpu", dtype=torch.float32)
    table = LayerTable.of(model)
    cases = [
        (lf.bfl_file(tmp_path / "a.safetensors", shapes, ["txt_mode_blocks.0.q_proj"], prefix=""), "bfl"),
        (lf.bfl_file(tmp_path / "b.safetensors", shapes, ["txt_mode_blocks.1.mlp_out"]), "bfl"),
        (lf.peft_file(tmp_path / "c.safetensors", dshapes, ["txt_mode_blocks.0.attn.to_q"]), "diffusers"),
        (lf.peft_file(tmp_path / "d.safetensors", dshapes, ["txt_mode_blocks.0.ff.linear_in"], prefix=""), "diffusers"),
        (lf.kohya_file(tmp_path / "e.safetensors", shapes, ["txt_mode_blocks.0.v_proj"]), "kohya"),
        (lf.kohya_file(tmp_path / "f.safetensors", shapes, ["txt_mode_blocks.1.k_proj"], comfy=True), "kohya"),
    ]  # fmt: skip
    # kohya's spelling of diffusers' names
    down, up = lf.factors(dshapes["txt_mode_blocks.1.attn.to_out.0"], 2, torch.Generator().manual_seed(0))
    g = "lora_transformer_txt_mode_blocks_1_attn_to_out_0"
    save_file({f"{g}.lora_down.weight": down, f"{g}.lora_up.weight": up}, str(tmp_path / "g.safetensors"))
    cases.append((tmp_path / "g.safetensors", "kohya"))
    for path, kind in cases:
        sd, meta = read_lora(path.read_bytes(), path.name)
        weights = convert(sd, meta, table, None, path.name)
        assert weights.format == kind and len(weights.transformer) == 1, path.name
        (module,) = weights.transformer
        assert module.startswith("txt_mode_blocks.") and (".attn." in module or ".ff." in module)


def _ones(keys_shapes):
    return {k: torch.ones(s) for k, s in keys_shapes}


def _pair(name, a, b, prefix="transformer."):
    return [(f"{prefix}{name}.lora_A.weight", a), (f"{prefix}{name}.lora_B.weight", b)]


BAD = [
    (
        _pair("double_blocks_0_img_mod_lin", (2, 64), (384, 2), prefix="lora_unet_"),
        r"is a FLUX.1 LoRA \(keys like lora_unet_double_blocks_0_img_mod_lin.lora_A.weight\); this pipeline runs FLUX.3",
    ),
    (
        _pair("single_transformer_blocks.0.attn.to_qkv_mlp_proj", (2, 64), (8, 2)),
        r"is a FLUX.2 LoRA \(keys like transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj",
    ),
    (
        _pair("transformer_blocks.0.attn.to_q", (2, 64), (64, 2)),
        r"is a FLUX.1 / FLUX.2 LoRA \(keys like transformer.transformer_blocks.0.attn.to_q",
    ),
    (
        [*_pair("single_transformer_blocks.5.attn.to_q", (2, 64), (64, 2)),
         *_pair("single_transformer_blocks.1.attn.to_q", (2, 64), (64, 2)),
         *_pair("mode_blocks.image.2.ff.linear_out", (2, 192), (64, 2))],
        r"2 LoRA keys match no layer of this FLUX.3 model \(2 blocks per mode / 2 single blocks\) \(diffusers "
        r"layout\): transformer.mode_blocks.image.2.ff.linear_out, transformer.single_transformer_blocks.5.attn.to_q",
    ),
    (
        _pair("mode_blocks.image_cond.0.attn.to_out.0", (2, 64), (48, 2)),
        r"mode_blocks.image_cond.0.attn.to_out.0 \(our content_mode_blocks.image_cond.0.attn_out\) gets a LoRA "
        r"update of shape \(48, 64\); the model's layer is \(64, 64\)",
    ),
    (
        _pair("single_blocks.0.mlp_out", (2, 64), (64, 2), prefix="diffusion_model."),
        r"single_blocks.0.mlp_out gets a LoRA update of shape \(64, 64\); the model's layer is \(64, 192\)",
    ),
    (
        _pair("txt_in", (2, 256), (64, 3), prefix="diffusion_model."),
        r"txt_in has down \(2, 256\) and up \(64, 3\); expected \(r, in\) and \(out, r\)",
    ),
    (
        [*_pair("txt_in", (2, 256), (64, 2), prefix="diffusion_model."), ("diffusion_model.txt_in.lora_B.bias", (64,))],
        r"txt_in has no bias for the LoRA's lora_B.bias",
    ),
    (
        [*_pair("txt_in", (2, 256), (64, 2), prefix="diffusion_model."),
         ("diffusion_model.single_blocks.0.norm.query_norm.scale", (32,))],
        r"1 LoRA key match no layer .* \(bfl layout\): diffusion_model.single_blocks.0.norm.query_norm.scale",
    ),
    (
        [*_pair("txt_in", (2, 256), (64, 2), prefix="diffusion_model."), *_pair("context_embedder", (2, 256), (64, 2))],
        r"mixes BFL module names \(diffusion_model.txt_in.lora_A.weight\) and diffusers ones "
        r"\(transformer.context_embedder.lora_A.weight\)",
    ),
    (
        _pair("model.layers.0.self_attn.q_proj", (2, 8), (8, 2), prefix="text_encoder."),
        r"holds text-encoder LoRA weights \(model.layers.0.self_attn.q_proj\); only FLUX.1's CLIP-L takes LoRAs",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("keys", "message"), BAD, ids=["flux1", "flux2", "flux1-2", "unmatched", "rows",
                         "cols", "rank", "bias", "norm", "mixed", "text-encoder"])  # fmt: skip
def test_bad_loras_are_refused_before_any_change(base, tmp_path, keys, message):
    folder, _, _ = base
    model = load_transformer(folder, device="cpu", dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_file(_ones(keys), str(tmp_path / "bad.safetensors"))
    with pytest.raises(LoraError, match=message):
        lf.fuse_file(model, tmp_path / "bad.safetensors", 1.0, FusedState())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_flux3_lora_on_flux1_and_flux2_is_refused(base, tmp_path, family):
    _, shapes, dshapes = base
    with torch.device("meta"):
        model = Flux1Transformer(TINY) if family == "flux1" else Flux2Transformer(TINY_FLUX2)
    table = LayerTable.of(model)
    mine = "FLUX.1" if family == "flux1" else "FLUX.2"
    files = [
        lf.bfl_file(tmp_path / "a.safetensors", shapes, ["single_blocks.0.mlp_in"]),
        lf.peft_file(tmp_path / "b.safetensors", dshapes, ["single_transformer_blocks.0.ff.linear_in"]),
        lf.kohya_file(tmp_path / "c.safetensors", shapes, ["content_mode_blocks.image.0.q_proj"]),
        lf.peft_file(tmp_path / "d.safetensors", dshapes, ["early_stream_modulations.txt.linear"]),
    ]
    for path in files:
        sd, meta = read_lora(path.read_bytes(), path.name)
        with pytest.raises(
            LoraError, match=rf"{path.name} is a FLUX.3 LoRA \(keys like .*\); this pipeline runs {mine}"
        ):
            convert(sd, meta, table, None, path.name)


def test_fp8_layers_are_requantized_and_restored(base, tmp_path):
    """FLUX.3's FP8 projections (no biases): dequantized to bf16, every LoRA's update added in load order (the
    final adaLN's in its swapped rows), quantized again; unfused: the very e4m3 tensors and scales."""
    from flux_runtime.models.dit.layers import Fp8Linear
    from flux_runtime.weights.fp8 import Fp8Tensors, _install, dequantize, quantize_weight
    from flux_runtime.weights.lora import lora_delta

    folder, shapes, _ = base
    fp8 = ("single_blocks.1.q_proj", "final_layer.image.adaLN_modulation.1")
    model = load_transformer(folder, device="cpu", dtype=torch.bfloat16)
    sd = {}
    _install(model, {n: quantize_weight(model.get_submodule(n).weight.data) for n in fp8}, sd, torch.bfloat16)
    model.load_state_dict(sd, strict=False, assign=True)
    orig = {n: (model.get_submodule(n).weight, model.get_submodule(n).weight_scale) for n in fp8}
    a = lf.bfl_file(tmp_path / "a.safetensors", shapes, [*fp8, "txt_mode_blocks.0.k_proj"], seed=7)
    b = lf.kohya_file(tmp_path / "b.safetensors", shapes, [fp8[1]], alpha=4.0, seed=8)
    state = FusedState()
    runs = [(lf.fuse_file(model, a, 0.5, state)[1], 0.5), (lf.fuse_file(model, b, 1.0, state)[1], 1.0)]
    assert set(state.fp8_pieces) == set(fp8)

    w = dequantize(Fp8Tensors(*orig[fp8[1]], None), torch.bfloat16)
    for weights, scale in runs:
        delta = lora_delta(weights.transformer["norm_out.linear"], scale, w)[0]
        w += torch.cat(delta.chunk(2, dim=0)[::-1])  # diffusers' (scale, shift) rows into ours
    want, got = quantize_weight(w), model.get_submodule(fp8[1])
    assert isinstance(got, Fp8Linear) and torch.equal(
        got.weight.view(torch.uint8), want.weight.view(torch.uint8)
    )
    assert torch.equal(got.weight_scale, want.weight_scale)

    unfuse(model, None, state)
    for n in fp8:
        assert (
            model.get_submodule(n).weight is orig[n][0] and model.get_submodule(n).weight_scale is orig[n][1]
        )


def test_bfl_names_map_as_diffusers_converter_at_full_size():
    """At FLUX.3 Klein's real depth: every BFL-named block projection lands on the diffusers layer that diffusers'
    own FLUX.3 converter names, and the layers it leaves unnamed (so drops) are exactly those outside the blocks."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_flux3_lora_to_diffusers

    from flux_runtime.models.dit import FLUX3_KLEIN, Flux3Transformer

    with torch.device("meta"):
        model = Flux3Transformer(FLUX3_KLEIN)
    table = LayerTable.of(model)
    sd = {}
    for name, layer in table.layers.items():
        sd[f"diffusion_model.{name}.lora_A.weight"] = torch.ones(1, layer.in_features)
        sd[f"diffusion_model.{name}.lora_B.weight"] = torch.ones(layer.out_features, 1)
    theirs = list(_convert_non_diffusers_flux3_lora_to_diffusers({k: sd[k] for k in sd if "lora_A" in k}))
    weights = convert(sd, None, table, None, "full.safetensors")
    assert weights.format == "bfl" and len(weights.transformer) == len(table.layers) == 258 + 15
    dropped = []
    for name, key in zip(table.layers, theirs, strict=True):
        module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
        if module in table.parts:
            assert table.parts[module].layer.name == name and module in weights.transformer
        else:
            dropped.append(name)
    assert dropped == [n for n in table.layers if "blocks." not in n] and set(GLOBALS) < set(dropped)
