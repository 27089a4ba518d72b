"""The FLUX.2 DiT is bit-identical to diffusers' Flux2Transformer2DModel (CPU, tiny random weights)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flux_runtime import load_transformer
from flux_runtime.models.dit import (
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX2_KLEIN_9B,
    PRESETS,
    TINY,
    TINY_FLUX2,
    DiTConfig,
    Flux2Transformer,
)
from flux_runtime.weights import flux2_layout
from tests import flux2_fixtures
from tests.flux2_fixtures import make_diffusers_flux2, make_inputs, save_bfl, save_diffusers
from tests.models.helpers import check_layout_table, diffusers_forward, run_without_diffusers, save_as

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _reference(model, inputs):
    return diffusers_forward(model, *inputs)


def _ours(model, inputs, guidance: bool):
    img, img_ids, txt, txt_ids, timesteps, g = inputs
    with torch.no_grad():
        return model(img, img_ids, txt, txt_ids, timesteps, g if guidance else None)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "klein"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
@pytest.mark.parametrize(("batch", "h", "w", "txt_len"), [(1, 3, 5, 7), (2, 4, 6, 11)])
def test_forward_equals_diffusers(tmp_path, guidance, dtype, layout, batch, h, w, txt_len):
    ref_model = make_diffusers_flux2(guidance)
    ours = load_transformer(save_as(layout, ref_model, tmp_path, flux2_fixtures), dtype=dtype)
    assert isinstance(ours, Flux2Transformer) and ours.config.family == "flux2"
    ref_model = ref_model.to(dtype)

    inputs = make_inputs(batch, h, w, txt_len, dtype)
    expected = _reference(ref_model, inputs)
    got = _ours(ours, inputs, guidance)
    assert got.shape == (batch, h * w, 128)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected), f"max diff {(got.float() - expected.float()).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_image_tokens_equal_diffusers(tmp_path, dtype):
    # editing: a 2x3 reference image's tokens follow the noise tokens, with time id 10
    ref_model = make_diffusers_flux2(False, seed=3)
    ours = load_transformer(save_bfl(ref_model, tmp_path / "k.safetensors"), dtype=dtype)
    inputs = make_inputs(2, 3, 4, 9, dtype, seed=5, ref=(2, 3))
    expected = _reference(ref_model.to(dtype), inputs)
    assert torch.equal(_ours(ours, inputs, False), expected)


def test_one_block_kind_only_equals_diffusers(tmp_path):
    # depth 0 or single depth 0: inference of the shape must not lean on the missing block kind
    for overrides in ({"num_layers": 0}, {"num_single_layers": 0}):
        ref_model = make_diffusers_flux2(True, seed=7, **overrides)
        ours = load_transformer(
            save_diffusers(ref_model, tmp_path / next(iter(overrides))), dtype=torch.float32
        )
        inputs = make_inputs(1, 2, 5, 3, torch.float32)
        assert torch.equal(_ours(ours, inputs, True), _reference(ref_model, inputs))


def test_precomputed_rope_and_batched_ids_give_the_same_output(tmp_path):
    model = load_transformer(
        save_bfl(make_diffusers_flux2(True), tmp_path / "f.safetensors"), dtype=torch.bfloat16
    )
    img, img_ids, txt, txt_ids, t, g = make_inputs(2, 3, 5, 7, torch.bfloat16)
    with torch.no_grad():
        plain = model(img, img_ids, txt, txt_ids, t, g)
        pe = model.rope(txt_ids, img_ids)
        batched = model(img, img_ids.expand(2, -1, -1), txt, txt_ids.expand(2, -1, -1), t, g, pe=pe)
    assert torch.equal(plain, batched)
    # RoPE positions matter: shifting the image ids changes the output
    with torch.no_grad():
        shifted = model(img, img_ids + torch.tensor([0, 1, 0, 0]), txt, txt_ids, t, g)
    assert not torch.equal(plain, shifted)


def test_bad_inputs_name_the_problem():
    with torch.device("meta"):
        dev = Flux2Transformer(replace(TINY_FLUX2, guidance_embed=True))
        klein = Flux2Transformer(TINY_FLUX2)
    img, img_ids, txt, txt_ids, t, g = make_inputs(2, 2, 2, 3, torch.float32)
    with pytest.raises(ValueError, match=r"pass guidance \(B,\)"):
        dev(img, img_ids, txt, txt_ids, t, None)
    with pytest.raises(ValueError, match=r"FLUX.2 \[klein\]\): pass guidance=None"):
        klein(img, img_ids, txt, txt_ids, t, g)
    with pytest.raises(ValueError, match=r"img must be \(B, L, 128\)"):
        klein(img[..., :64], img_ids, txt, txt_ids, t)
    with pytest.raises(ValueError, match=r"txt must be \(2, L, 96\)"):
        klein(img, img_ids, txt[..., :32], txt_ids, t)
    with pytest.raises(ValueError, match=r"timesteps must be \(2,\)"):
        klein(img, img_ids, txt, txt_ids, t[:1])
    with pytest.raises(ValueError, match=r"img_ids must be \(L, 4\) or \(B, L, 4\), got \(4, 3\)"):
        klein(img, img_ids[:, :3], txt, txt_ids, t)
    different = torch.stack([txt_ids, txt_ids + 1])
    with pytest.raises(ValueError, match="txt_ids must hold the same positions for every batch row"):
        klein(img, img_ids, txt, different, t)


def test_configs_are_checked():
    with pytest.raises(ValueError, match="needs a flux2 config, got family 'flux1'"):
        Flux2Transformer(TINY)
    with pytest.raises(ValueError, match="qkv_bias True must be False"):
        replace(TINY_FLUX2, qkv_bias=True)
    with pytest.raises(ValueError, match="vec_in_dim 768 must be 0"):
        DiTConfig(family="flux2", qkv_bias=False)
    assert PRESETS["tiny-flux2"] is TINY_FLUX2 and PRESETS["flux2-dev"] is FLUX2_DEV
    assert PRESETS["flux2-klein-4b"] is FLUX2_KLEIN_4B and PRESETS["flux2-klein-9b"] is FLUX2_KLEIN_9B


_KLEIN_KW = ("num_layers", "num_single_layers", "num_attention_heads", "joint_attention_dim")
DIFFUSERS_KW = {
    "dev": {},  # diffusers' defaults are FLUX.2 [dev]
    "klein-4b": dict(zip(_KLEIN_KW, (5, 20, 24, 7680), strict=True), guidance_embeds=False),
    "klein-9b": dict(zip(_KLEIN_KW, (8, 24, 32, 12288), strict=True), guidance_embeds=False),
}
PARAMS = {"dev": 32_223_281_152, "klein-4b": 3_875_544_576, "klein-9b": 9_078_581_248}


@pytest.mark.parametrize(
    ("name", "cfg"), [("dev", FLUX2_DEV), ("klein-4b", FLUX2_KLEIN_4B), ("klein-9b", FLUX2_KLEIN_9B)]
)
def test_full_size_parameter_count_matches_diffusers(name, cfg):
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        ours = Flux2Transformer(cfg)
        ref = Flux2Transformer2DModel(**DIFFUSERS_KW[name])
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_ours == sum(p.numel() for p in ref.parameters()) == PARAMS[name]
    # and tensor for tensor: the layout table maps every diffusers tensor onto ours with its shape
    rules = flux2_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.guidance_embed)
    check_layout_table(flux2_layout, rules, ours, ref)


def test_runtime_never_imports_diffusers(tmp_path):
    path = save_bfl(make_diffusers_flux2(True), tmp_path / "f.safetensors")
    run_without_diffusers(
        f"""
        from tests.flux2_fixtures import make_inputs
        model = flux_runtime.load_transformer({str(path)!r}, dtype=torch.float32)
        img, img_ids, txt, txt_ids, t, g = make_inputs(1, 2, 3, 4, torch.float32)
        out = model(img, img_ids, txt, txt_ids, t, g)
        assert out.shape == (1, 6, 128)
        """
    )
