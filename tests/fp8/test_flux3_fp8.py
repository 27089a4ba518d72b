"""FLUX.3 in FP8 on the CPU: quantize on load, ModelOpt-style folders, our own export, BFL e4m3 files.

Each loaded model's output is compared with an FP8 reference built here from diffusers' own
`Flux3Transformer2DModel`, each quantized `nn.Linear` replaced by the quantize + `torch._scaled_mm` chain
(tests/fp8_fixtures.py). FLUX.3 keeps q, k and v apart, so every FP8 layer of ours is one diffusers
Linear with the same scales: the outputs are `torch.equal`, not merely close. On the CPU the FP8 model
runs the reference ops (the tier's kernels are "off"), so this is also the FP8 eager reference.
"""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import load_file, save_file

from flux_runtime.cli.convert import main as convert_main
from flux_runtime.cli.gen import main as gen_main
from flux_runtime.models.dit.layers import Fp8Linear
from flux_runtime.pipeline import Pipeline
from flux_runtime.weights import flux3_layout
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.fp8 import may_run_fp8
from flux_runtime.weights.fp8_export import IGNORE
from flux_runtime.weights.transformer import load_transformer
from tests import flux3_fixtures as f3
from tests.fp8_fixtures import (
    E4M3,
    RefFp8Linear,
    calibrate,
    fp8_params,
    fp8_reference,
    quantized_modules,
    rel,
    write_modelopt,
)
from tests.lora.lora_fixtures import FLUX3_BLOCK

BF16 = torch.bfloat16
# diffusers names of the layers a FLUX.3 FP8 folder keeps in bf16 (embedders, modulation, final layer), as our
# exporter writes them
IGNORE3 = IGNORE["flux3"]
# Measured on the CPU with these tiny random models and inputs: the FP8 model's output is 0.4-0.7% (relative
# L2) from the bf16 model's, quantized at load or from a ModelOpt-style folder; the bound is ~3x that.
BF16_TOL = 0.02
FP8_LAYERS = 6 * 8  # q, k, v, attn_out, mlp_in, mlp_out of 2 blocks x 3 modes + 2 joint blocks


@pytest.fixture(scope="module")
def models():
    """bf16 diffusers FLUX.3 models as `from_pretrained(torch_dtype=bf16)` loads them (QK norms fp32)."""
    return {f: f3.as_loaded(f3.make_diffusers_flux3(f, seed=7 if f else 0), BF16) for f in (False, True)}


def _inputs(flow_map: bool):
    return f3.make_inputs(1, 3, 3, 6, BF16, seed=2, refs=((2, 2),), flow_map=flow_map)


def _per_channel_params(model):
    """What quantize-on-load means, written out: e4m3 weights with `amax(|row|) / 448` per output row, no input scale."""
    out = {}
    for name in quantized_modules(model):
        w = model.get_submodule(name).weight.detach()
        s = w.abs().amax(dim=1).float().clamp(min=1e-12) / 448.0
        out[name] = ((w.float() / s[:, None]).clamp(-448, 448).to(E4M3), s, None)
    return out


def _fp8_names(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def _check_recipe(model) -> None:
    """The block projections are FP8; embedders, modulation, final layer bf16; the QK norms fp32."""
    names = _fp8_names(model)
    assert len(names) == FP8_LAYERS and all(may_run_fp8(n) for n in names)
    assert {n.rsplit(".", 1)[1] for n in names} == set(FLUX3_BLOCK)
    for kept in (model.emb_in["image"], model.txt_in, model.time_in.in_layer,
                 model.early_stream_modulations["txt"].lin, model.final_layer["image"].linear):  # fmt: skip
        assert not isinstance(kept, Fp8Linear) and kept.weight.dtype == BF16
    norms = {p.dtype for n, p in model.named_parameters() if n.endswith("_norm.scale")}
    assert norms == {torch.float32}


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
@pytest.mark.parametrize("flow_map", [False, True], ids=["base", "flow-map"])
def test_quantize_at_load_equals_the_fp8_reference(models, tmp_path, flow_map, layout):
    model = models[flow_map]
    path = (
        f3.save_bfl(model, tmp_path / "k.safetensors", "model.diffusion_model.")
        if layout == "bfl"
        else f3.save_diffusers(model, tmp_path / "transformer")
    )
    ours = load_transformer(path, dtype=BF16, fp8=True)
    assert ours.precision == "fp8-dynamic" and ours.quantized_at_load is True
    _check_recipe(ours)
    x = _inputs(flow_map)
    got = f3.our_forward(ours, x)
    assert torch.equal(got, f3.reference_forward(fp8_reference(model, _per_channel_params(model)), x))
    err = rel(got, f3.reference_forward(model, x))
    assert 0 < err < BF16_TOL


def test_builtin_model_quantizes_at_load():
    ours = load_transformer("tiny-flux3-random", dtype=BF16, fp8=True)
    bf16 = load_transformer("tiny-flux3-random", dtype=BF16)
    assert ours.precision == "fp8-dynamic" and bf16.precision == "bf16"
    _check_recipe(ours)
    x = _inputs(False)
    assert 0 < rel(f3.our_forward(ours, x), f3.our_forward(bf16, x)) < BF16_TOL


@pytest.mark.parametrize("static", [True, False], ids=["static", "no-input-scale"])
def test_modelopt_folder_equals_the_fp8_reference(models, tmp_path, static, caplog):
    model = models[False]
    x = _inputs(False)
    params = fp8_params(model, calibrate(model, lambda m: f3.reference_forward(m, x)) if static else None)
    folder = write_modelopt(model, params, tmp_path / "transformer", ignore=IGNORE3)
    with caplog.at_level(logging.WARNING):
        ours = load_transformer(folder, dtype=BF16)
    assert "matches no layer" not in caplog.text  # the ignore list names real layers
    assert ours.precision == ("fp8-static" if static else "fp8-dynamic")
    assert ours.quantized_at_load is False
    _check_recipe(ours)
    q = ours.content_mode_blocks["image_cond"][1].k_proj
    wq, ws, s_in = params["mode_blocks.image_cond.1.attn.to_k"]
    assert torch.equal(q.weight.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(q.weight_scale, ws)
    assert (q.input_scale is None) if not static else torch.equal(q.input_scale, s_in)
    expected = f3.reference_forward(fp8_reference(model, params), x)
    got = f3.our_forward(ours, x)
    assert torch.equal(got, expected)
    assert rel(f3.reference_forward(model, x), expected) > 0  # the reference is not the bf16 model


@pytest.mark.parametrize("kind", ["cast", "scaled"])
def test_bfl_e4m3_files_equal_the_fp8_reference(models, tmp_path, kind):
    """A plain e4m3 cast (weight scale 1, per-row activations) and a ComfyUI scaled-FP8 file of BFL names."""
    model = models[True]
    x = _inputs(True)
    amax = calibrate(model, lambda m: f3.reference_forward(m, x)) if kind == "scaled" else None
    sd = f3.bfl_state_dict(model)
    params = {}
    cfg = model.config
    for rule in flux3_layout.rules(cfg.num_layers, cfg.num_single_layers, cfg.flow_map):
        module, name = rule.bfl.rsplit(".", 1)[0], rule.diffusers[0].rsplit(".", 1)[0]
        if name not in quantized_modules(model):
            continue
        w = sd[rule.bfl]
        if kind == "cast":
            wq, ws, s_in = w.to(E4M3), torch.tensor(1.0), None
        else:
            ws = (w.abs().amax().float() / 448.0).reshape(())
            wq, s_in = (w.float() / ws).clamp(-448, 448).to(E4M3), torch.tensor(amax[name] / 448.0)
            sd[f"{module}.scale_weight"], sd[f"{module}.scale_input"] = ws, s_in
        sd[rule.bfl] = wq
        params[name] = (wq, ws, s_in)
    if kind == "scaled":
        sd["scaled_fp8"] = torch.zeros(2, dtype=E4M3)
    save_file(sd, str(tmp_path / "klein-fp8.safetensors"))
    ours = load_transformer(tmp_path / "klein-fp8.safetensors", dtype=BF16)
    assert ours.precision == ("fp8-dynamic" if kind == "cast" else "fp8-static")
    _check_recipe(ours)
    assert torch.equal(f3.our_forward(ours, x), f3.reference_forward(fp8_reference(model, params), x))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`flux-convert quantize tiny-flux3-random DST`: calibrated on two prompts (the second with a reference)."""
    root = tmp_path_factory.mktemp("flux3-fp8")
    prompts = root / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    dst = root / "fp8"
    r = CliRunner().invoke(
        convert_main,
        ["quantize", "tiny-flux3-random", str(dst), "--calibration-prompts", str(prompts),
         "--calibration-steps", "1", "--calibration-size", "32", "--device", "cpu", "-q"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return dst


def _reference_from_folder(folder):
    """diffusers' model rebuilt from an FP8 folder's files alone: bf16 tensors loaded, FP8 layers as the chain."""
    from diffusers import Flux3Transformer2DModel

    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config")
    sd = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    with torch.device("meta"):
        model = Flux3Transformer2DModel.from_config(cfg)
    fp8 = sorted(k.removesuffix(".weight_scale") for k in sd if k.endswith(".weight_scale"))
    plain = {k: v for k, v in sd.items() if k.rsplit(".", 1)[0] not in fp8}
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    assert not unexpected and sorted(m.removesuffix(".weight") for m in missing) == fp8
    for name in fp8:
        parent, _, child = name.rpartition(".")
        lin = model.get_submodule(name)
        ref = RefFp8Linear(lin, sd[f"{name}.weight"], sd[f"{name}.weight_scale"], sd[f"{name}.input_scale"])
        setattr(model.get_submodule(parent), child, ref)
    return model.eval(), fp8


def test_our_fp8_export_loads_and_equals_the_reference_of_its_files(exported):
    cfg = json.loads((exported / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["quant_algo"], q["ignore"]) == ("modelopt", "FP8", IGNORE3)
    ours = load_transformer(exported, dtype=BF16)
    assert ours.precision == "fp8-static"
    _check_recipe(ours)
    reference, fp8 = _reference_from_folder(exported)
    assert len(fp8) == FP8_LAYERS and any(n.startswith("mode_blocks.image_cond.") for n in fp8)
    sd = load_file(str(exported / "diffusion_pytorch_model.safetensors"))
    assert sd["txt_mode_blocks.0.attn.norm_q.weight"].dtype == torch.float32
    assert sd["single_stream_modulations.image.linear.weight"].dtype == BF16
    # q, k and v read one input: one calibrated scale
    assert torch.equal(sd["single_transformer_blocks.0.attn.to_q.input_scale"],
                       sd["single_transformer_blocks.0.attn.to_v.input_scale"])  # fmt: skip
    x = _inputs(False)
    assert torch.equal(f3.our_forward(ours, x), f3.reference_forward(reference, x))
    bf16 = load_transformer("tiny-flux3-random", dtype=BF16)
    assert 0 < rel(f3.our_forward(ours, x), f3.our_forward(bf16, x)) < BF16_TOL


def _edit(folder, fn, tmp_path):
    """A copy of the exported folder with its tensors edited by `fn`."""
    out = tmp_path / "edited"
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    sd = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    fn(sd)
    save_file(sd, str(out / "diffusion_pytorch_model.safetensors"))
    return out


K = "single_transformer_blocks.1.attn.to_k"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda sd: sd.pop(f"{K}.weight_scale"), "is FP8 but has no scale"),
        (lambda sd: sd.__setitem__(f"{K}.weight_scale", torch.ones(3)), "has shape"),
        (lambda sd: sd.__setitem__(f"{K}.input_scale", torch.tensor(float("nan"))), "finite and positive"),
        (lambda sd: sd.__setitem__(f"{K}.weight_scale", torch.tensor(0.0)), "finite and positive"),
        (lambda sd: sd.__setitem__(f"{K}.input_scale", torch.ones(2)), "expected \\[\\] or \\[1\\]"),
    ],
    ids=["no-scale", "scale-shape", "nan-scale", "zero-scale", "input-scale-shape"],
)
def test_bad_fp8_files_are_one_line_errors(exported, tmp_path, edit, message):
    folder = _edit(exported, edit, tmp_path)
    with pytest.raises(WeightsError, match=message) as e:
        load_transformer(folder, dtype=BF16)
    assert "\n" not in str(e.value) and K in str(e.value)


def test_fp8_settings_that_cannot_work_are_refused(models, exported, tmp_path):
    with pytest.raises(WeightsError, match="bfloat16"):
        load_transformer(exported, dtype=torch.float32)  # an FP8 checkpoint computes in bf16
    with pytest.raises(WeightsError, match="bfloat16"):
        load_transformer("tiny-flux3-random", dtype=torch.float16, fp8=True)
    folder = f3.save_diffusers(models[False], tmp_path / "raw")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": IGNORE3}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="flux-convert quantize"):
        load_transformer(folder, dtype=BF16)


def test_fp8_text_encoder_stays_close_to_bf16():
    """The Qwen3-VL decoder layers' projections in FP8 (`fp8_text`): measured cosine 0.997, relative error 0.08."""
    from flux_runtime.text.flux3 import Flux3TextEncoder
    from flux_runtime.text.fp8 import Fp8TextLinear, embedding_error

    te = Flux3TextEncoder.tiny(dtype=BF16)
    want = te.encode("a red fox in the snow")[0]
    layers = te.parts()[1]
    assert te.quantize_fp8() == 7 * len(layers)  # q, k, v, o, gate, up, down of every decoder layer
    assert all(isinstance(m, Fp8TextLinear) for m in (layers[0].self_attn.q_proj, layers[-1].mlp.down_proj))
    err = embedding_error(want, te.encode("a red fox in the snow")[0])
    assert 0.98 < err.cosine < 1 and 0 < err.rel_error < 0.2


def _record(png):
    return json.loads(Image.open(png).text["flux_runtime"])


@pytest.mark.slow
def test_fp8_pipeline_records_its_precision_and_stays_close():
    kw = dict(height=32, width=32, num_steps=2, seed=0, output_type="pt")
    fp8 = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=BF16, fp8=True, fp8_text=True)
    bf16 = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=BF16)
    assert len(_fp8_names(fp8.transformer)) == FP8_LAYERS
    a, b = fp8("a red fox", **kw), bf16("a red fox", **kw)
    assert (a.info["precision"], a.info["fp8_at_load"], a.info["fp8_text"]) == ("fp8-dynamic", True, True)
    assert (b.info["precision"], b.info["fp8_at_load"], b.info["fp8_text"]) == ("bf16", False, False)
    diff = (a.images.float() - b.images.float()).abs().mean().item()
    assert 0 < diff < 0.05


@pytest.mark.slow
def test_flux_gen_fp8_and_replay(tmp_path):
    runner = CliRunner()
    out = tmp_path / "a.png"
    args = ["--model", "tiny-flux3-random", "--prompt", "a red fox", "--fp8", "--out", str(out), "-q"]
    r = runner.invoke(gen_main, [*args, "--steps", "2", "--height", "32", "--width", "32"])
    assert r.exit_code == 0, r.output
    rec = _record(out)
    assert (rec["precision"], rec["fp8_at_load"], rec["fp8_text"]) == ("fp8-dynamic", True, True)
    again = tmp_path / "b.png"
    r = runner.invoke(gen_main, ["--replay", str(out), "--out", str(again), "-q"])
    assert r.exit_code == 0, r.output
    assert _record(again)["precision"] == "fp8-dynamic"
    assert np.array_equal(np.array(Image.open(out)), np.array(Image.open(again)))


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_fp8_lossless_equals_the_eager_reference(models, tmp_path):
    """On the GPU: the lossless tier's FP8 path (Triton quantization, `_scaled_mm`) `torch.equal` to the same
    model with the reference ops, and to diffusers' model with the quantize + scaled-matmul chain."""
    from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused

    model = models[True]
    x = f3.make_inputs(1, 32, 32, 80, BF16, seed=3, refs=((16, 16),), flow_map=True)
    x = type(x)(*(t.cuda() if t is not None else None for t in x))
    ours = load_transformer(
        f3.save_bfl(model, tmp_path / "k.safetensors"), dtype=BF16, device="cuda", fp8=True
    )
    reset_fused_ops_report(forget_signatures=True)
    with use_fused("lossless"):
        fused = f3.our_forward(ours, x)
    assert fused_ops_report().fused_calls.get("fp8_quantize", 0) > 0  # the Triton quantization ran
    with use_fused("off"):
        eager = f3.our_forward(ours, x)
    assert torch.equal(fused, eager)
    on_gpu = copy.deepcopy(model).cuda()  # the reference's e4m3 tensors are plain attributes: made on the GPU
    ref = fp8_reference(on_gpu, _per_channel_params(on_gpu))
    assert torch.equal(eager, f3.reference_forward(ref, x))


@pytest.mark.gpu
def test_gpu_full_size_fp8_step():
    """Full-size FLUX.3 Klein (random weights) quantized as `fp8=True` does, one 1024² forward with 480 text tokens
    and a 1024² reference: lossless `torch.equal` to the eager reference; relative error to bf16 printed, bounded."""
    from flux_runtime.kernels.dispatch import use_fused
    from flux_runtime.models.dit import FLUX3_KLEIN
    from flux_runtime.weights.flux3_transformer import random_flux3
    from flux_runtime.weights.fp8 import quantize_model

    bf16 = random_flux3(FLUX3_KLEIN, 0, torch.device("cuda"), BF16)
    x = f3.make_inputs(1, 64, 64, 480, BF16, seed=0, refs=((64, 64),), flow_map=True)
    x = type(x)(*(t.cuda() if t is not None else None for t in x))
    x = x._replace(txt=torch.randn(1, 480, 20480, device="cuda").to(BF16))
    with use_fused("lossless"):
        want = f3.our_forward(bf16, x)
    # the same model quantized in place, as `fp8=True` does a built-in one (drawing 5.5 B weights once is enough)
    fp8 = bf16
    assert quantize_model(fp8, BF16) == "fp8-dynamic" and len(_fp8_names(fp8)) == 6 * (3 * 5 + 28)
    torch.cuda.empty_cache()
    with use_fused("lossless"):
        got = f3.our_forward(fp8, x)
    with use_fused("off"):
        eager = f3.our_forward(fp8, x)
    assert torch.equal(got, eager)
    err = rel(got, want)
    print(
        f"FLUX.3 Klein FP8 (per-channel weights, per-row activations) vs bf16, one 1024² step: relative L2 {err:.4f}"
    )
    assert err < 0.25


@pytest.mark.gpu
def test_gpu_fp8_pipeline_graphs_equal_eager():
    """`tiny-flux3-random` with `fp8=True` on the GPU: CUDA-graph replays equal the eager run, with a reference."""
    kw = dict(height=64, width=64, num_steps=3, seed=0, output_type="latent")
    graphed = Pipeline.from_pretrained("tiny-flux3-random", device="cuda", dtype=BF16, fp8=True)
    eager = Pipeline.from_pretrained(
        "tiny-flux3-random", device="cuda", dtype=BF16, fp8=True, cuda_graphs=False
    )
    ref = Image.new("RGB", (64, 48), (200, 40, 40))
    for image in (None, [ref]):
        want = eager("a red fox", image=image, **kw)
        assert want.info["precision"] == "fp8-dynamic" and want.info["kernels"].startswith("lossless")
        runs = [graphed("a red fox", image=image, **kw) for _ in range(3)]  # eager, captured, replayed
        assert all(torch.equal(r.latents, want.latents) for r in runs)
