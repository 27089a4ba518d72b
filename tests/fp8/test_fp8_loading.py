"""FP8 checkpoints load in every format and compute what an independent FP8 reference computes (CPU)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from flux_runtime.models.dit.layers import Fp8Linear
from flux_runtime.weights import flux1_layout
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.transformer import load_transformer
from tests import flux1_fixtures as f1
from tests import flux2_fixtures as f2
from tests.fp8_fixtures import calibrate, fp8_params, fp8_reference, rel, write_modelopt

# Tolerance against the reference: our merged q/k/v (one row-wise GEMM, per-channel scales) and the
# reference's three tensor-wise GEMMs round their bf16 outputs apart by at most an ulp here and there.
TOL = 2e-2


def _flux1_run(inputs):
    img, img_ids, txt, txt_ids, t, y, g = inputs

    def run(model):
        return model(
            hidden_states=img, encoder_hidden_states=txt, pooled_projections=y, timestep=t,
            img_ids=img_ids, txt_ids=txt_ids, guidance=g, return_dict=False,
        )[0]  # fmt: skip

    def ours(model):
        return model(img, img_ids, txt, txt_ids, t, y, g)

    return run, ours


def _flux2_run(inputs):
    img, img_ids, txt, txt_ids, t, g = inputs

    def run(model):
        return model(
            hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=img_ids, txt_ids=txt_ids,
            guidance=g, return_dict=False,
        )[0]  # fmt: skip

    def ours(model):
        return model(img, img_ids, txt, txt_ids, t, g)

    return run, ours


def _assert_near_the_fp8_reference(ours, model, params, run, ours_run) -> None:
    """`ours` computes within `TOL` of the FP8 reference built from `model` and `params`, and clearly closer to it
    than the un-quantized `model` does."""
    with torch.no_grad():
        expected = run(fp8_reference(model, params))
        got = ours_run(ours)
        bf16 = run(model)
    assert rel(got, expected) < TOL
    assert rel(got, expected) < 0.3 * rel(bf16, expected)


def _family(name):
    if name == "flux1":
        model = f1.make_diffusers_transformer(True).to(torch.bfloat16)
        return model, _flux1_run(f1.make_inputs(1, 4, 4, 7, torch.bfloat16))
    model = f2.make_diffusers_flux2(True).to(torch.bfloat16)
    return model, _flux2_run(f2.make_inputs(1, 4, 4, 7, torch.bfloat16))


@pytest.mark.parametrize("family", ["flux1", "flux2"])
@pytest.mark.parametrize("static", [True, False], ids=["static", "no-input-scale"])
def test_modelopt_folder_matches_the_fp8_reference(tmp_path, family, static):
    model, (run, ours_run) = _family(family)
    params = fp8_params(model, calibrate(model, run) if static else None)
    folder = write_modelopt(model, params, tmp_path / "transformer")
    ours = load_transformer(folder, dtype=torch.bfloat16)
    assert ours.precision == ("fp8-static" if static else "fp8-dynamic")
    assert isinstance(ours.double_blocks[0].img_attn.qkv, Fp8Linear)
    assert ours.double_blocks[0].img_attn.qkv.weight_scale.shape == (ours.config.hidden_size * 3,)
    assert not isinstance(ours.double_blocks[0].img_mod.lin if family == "flux1" else ours.img_in, Fp8Linear)

    _assert_near_the_fp8_reference(ours, model, params, run, ours_run)


def test_merged_shards_keep_their_bytes_and_scales(tmp_path):
    model, (run, _) = _family("flux1")
    params = fp8_params(model, calibrate(model, run))
    ours = load_transformer(write_modelopt(model, params, tmp_path / "t"), dtype=torch.bfloat16)
    qkv = ours.single_blocks[1].linear1
    names = [f"single_transformer_blocks.1.{p}" for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]
    rows = torch.cat([params[n][0] for n in names]).view(torch.uint8)
    assert torch.equal(qkv.weight.view(torch.uint8), rows)
    scales = torch.cat([params[n][1].expand(params[n][0].shape[0]) for n in names])
    assert torch.equal(qkv.weight_scale, scales)
    assert torch.equal(qkv.input_scale, params[names[0]][2])


def test_different_input_scales_take_the_max_and_say_so(tmp_path, caplog):
    model, (run, _) = _family("flux1")
    params = fp8_params(model, calibrate(model, run))
    name = "transformer_blocks.0.attn.to_k"
    wq, ws, s_in = params[name]
    params[name] = (wq, ws, s_in * 2)
    with caplog.at_level(logging.WARNING):
        ours = load_transformer(write_modelopt(model, params, tmp_path / "t"), dtype=torch.bfloat16)
    assert torch.equal(ours.double_blocks[0].img_attn.qkv.input_scale, s_in * 2)
    assert "different input scales" in caplog.text


def _comfy_file(model, path, with_input_scale: bool, new_style: bool):
    """A ComfyUI scaled-FP8 BFL file quantized per BFL tensor, and the per-diffusers-module params it means."""
    sd = model.state_dict()
    cfg = model.config
    out, params = {}, {}
    amax = (
        calibrate(model, _flux1_run(f1.make_inputs(1, 4, 4, 7, torch.bfloat16))[0])
        if with_input_scale
        else None
    )
    for r in flux1_layout.rules(cfg.num_layers, cfg.num_single_layers, cfg.guidance_embeds):
        t = flux1_layout.diffusers_to_bfl(r, sd.__getitem__).contiguous()
        module = r.bfl.rsplit(".", 1)[0]
        quantize = r.bfl.endswith(".weight") and (
            "_attn." in r.bfl or "_mlp." in r.bfl or ".linear" in module.split("blocks")[-1]
        )
        quantize = (
            quantize
            and module.startswith(("double_blocks", "single_blocks"))
            and not module.endswith(("mod.lin", "modulation.lin"))
        )
        if not quantize:
            out[r.bfl] = t
            continue
        ws = (t.abs().amax().float() / 448.0).reshape(())
        wq = (t.float() / ws).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[r.bfl] = wq
        s_in = None if amax is None else torch.tensor(amax[r.diffusers[0].rsplit(".", 1)[0]] / 448.0)
        out[f"{module}.{'weight_scale' if new_style else 'scale_weight'}"] = ws
        if s_in is not None:
            out[f"{module}.{'input_scale' if new_style else 'scale_input'}"] = s_in
        if new_style:
            out[f"{module}.comfy_quant"] = torch.tensor(
                list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8
            )
        start = 0
        for d in r.diffusers:
            n = sd[d].shape[0]
            params[d.rsplit(".", 1)[0]] = (wq[start : start + n], ws, s_in)
            start += n
    if not new_style:
        out["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    save_file(out, str(path))
    return params


@pytest.mark.parametrize("new_style", [False, True], ids=["scale_weight", "weight_scale"])
def test_comfy_scaled_fp8_file_matches_the_fp8_reference(tmp_path, new_style):
    model, (run, ours_run) = _family("flux1")
    params = _comfy_file(model, tmp_path / "flux1-dev-fp8.safetensors", True, new_style)
    ours = load_transformer(tmp_path / "flux1-dev-fp8.safetensors", dtype=torch.bfloat16)
    assert ours.precision == "fp8-static"
    _assert_near_the_fp8_reference(ours, model, params, run, ours_run)


def test_plain_e4m3_cast_runs_with_unit_weight_scales(tmp_path):
    model, (run, ours_run) = _family("flux1")
    path = f1.save_bfl(model, tmp_path / "f.safetensors")
    sd = load_file(str(path))
    for k in list(sd):
        if (
            k.startswith(("double_blocks", "single_blocks"))
            and k.endswith("weight")
            and sd[k].ndim == 2
            and "mod" not in k
        ):
            sd[k] = sd[k].to(torch.float8_e4m3fn)
    save_file(sd, str(path))
    ours = load_transformer(path, dtype=torch.bfloat16)
    assert ours.precision == "fp8-dynamic"
    assert float(ours.single_blocks[0].linear1.weight_scale) == 1.0
    with torch.no_grad():
        assert rel(ours_run(ours), run(model)) < 0.1


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_quantize_at_load_is_close_to_bf16(tmp_path, family):
    model, (_run, ours_run) = _family(family)
    path = (f1 if family == "flux1" else f2).save_bfl(model, tmp_path / "f.safetensors")
    ours = load_transformer(path, dtype=torch.bfloat16, fp8=True)
    bf16 = load_transformer(path, dtype=torch.bfloat16)
    assert ours.precision == "fp8-dynamic" and bf16.precision == "bf16"
    n_fp8 = sum(isinstance(m, Fp8Linear) for m in ours.modules())
    assert (
        n_fp8 == 2 * 8 + 2 * 2
    )  # per double block img + txt (qkv, proj, mlp.0, mlp.2); single linear1, linear2
    with torch.no_grad():
        err = rel(ours_run(ours), ours_run(bf16))
    assert 0 < err < 0.05


def _edit(folder, fn):
    f = folder / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda sd: sd.pop("transformer_blocks.0.attn.to_q.weight_scale"), "has no scale"),
        (
            lambda sd: sd.__setitem__("transformer_blocks.0.attn.to_q.weight_scale", torch.ones(3)),
            "has shape",
        ),
        (
            lambda sd: sd.__setitem__(
                "transformer_blocks.0.attn.to_q.input_scale", torch.tensor(float("nan"))
            ),
            "finite and positive",
        ),
        (
            lambda sd: sd.__setitem__("transformer_blocks.0.attn.to_q.weight_scale", torch.tensor(-1.0)),
            "finite and positive",
        ),
        (
            lambda sd: sd.__setitem__(
                "transformer_blocks.0.attn.to_k.weight",
                sd["transformer_blocks.0.attn.to_k.weight"].bfloat16(),
            ),
            "only some are FP8",
        ),
        (lambda sd: sd.pop("transformer_blocks.0.attn.to_k.input_scale"), "only some have an input scale"),
    ],
    ids=["no-scale", "scale-shape", "nan-scale", "negative-scale", "mixed-shards", "mixed-input-scales"],
)
def test_bad_fp8_checkpoints_name_the_problem(tmp_path, edit, message):
    model, (run, _) = _family("flux1")
    folder = write_modelopt(model, fp8_params(model, calibrate(model, run)), tmp_path / "t")
    _edit(folder, edit)
    with pytest.raises(WeightsError, match=message):
        load_transformer(folder, dtype=torch.bfloat16)


def test_raw_modelopt_export_names_the_quantize_command(tmp_path):
    model, _ = _family("flux1")
    folder = f1.save_diffusers(model, tmp_path / "t")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": []}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="flux-convert quantize"):
        load_transformer(folder, dtype=torch.bfloat16)


def test_ignore_glob_that_matches_nothing_warns(tmp_path, caplog):
    model, (_run, _) = _family("flux1")
    folder = write_modelopt(model, fp8_params(model, None), tmp_path / "t")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("no_such_layer*")
    (folder / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING):
        load_transformer(folder, dtype=torch.bfloat16)
    assert "'no_such_layer*' matches no layer" in caplog.text


def test_fp8_needs_bf16(tmp_path):
    with pytest.raises(WeightsError, match="bfloat16"):
        load_transformer("tiny", dtype=torch.float16, fp8=True)
    model, _ = _family("flux1")
    folder = write_modelopt(model, fp8_params(model, None), tmp_path / "t")
    with pytest.raises(WeightsError, match="bfloat16"):
        load_transformer(folder, dtype=torch.float32)
