"""The FLUX.1 DiT is bit-identical to diffusers' FluxTransformer2DModel (CPU, tiny random weights)."""

from __future__ import annotations

import pytest
import torch

from flux_runtime import load_transformer
from flux_runtime.models.dit import FLUX1_DEV, FLUX1_SCHNELL, TINY, Flux1Transformer
from tests import flux1_fixtures
from tests.flux1_fixtures import make_diffusers_transformer, make_inputs, save_bfl
from tests.models.helpers import diffusers_forward, run_without_diffusers, save_as

DTYPES = [torch.float32, torch.bfloat16]


def _reference(model, inputs):
    img, img_ids, txt, txt_ids, timesteps, y, guidance = inputs
    return diffusers_forward(model, img, img_ids, txt, txt_ids, timesteps, guidance, pooled_projections=y)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
@pytest.mark.parametrize(("batch", "h", "w", "txt_len"), [(1, 3, 5, 7), (2, 4, 4, 11)])
def test_forward_equals_diffusers(tmp_path, guidance, dtype, layout, batch, h, w, txt_len):
    ref_model = make_diffusers_transformer(guidance)
    ours = load_transformer(save_as(layout, ref_model, tmp_path, flux1_fixtures), dtype=dtype)
    ref_model = ref_model.to(dtype)

    inputs = make_inputs(batch, h, w, txt_len, dtype)
    expected = _reference(ref_model, inputs)
    img, img_ids, txt, txt_ids, timesteps, y, g = inputs
    with torch.no_grad():
        got = ours(img, img_ids, txt, txt_ids, timesteps, y, g if guidance else None)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected), f"max diff {(got.float() - expected.float()).abs().max()}"


def test_precomputed_rope_and_batched_ids_give_the_same_output(tmp_path):
    model = load_transformer(
        save_bfl(make_diffusers_transformer(True), tmp_path / "f.safetensors"), dtype=torch.bfloat16
    )
    img, img_ids, txt, txt_ids, t, y, g = make_inputs(2, 3, 5, 7, torch.bfloat16)
    with torch.no_grad():
        plain = model(img, img_ids, txt, txt_ids, t, y, g)
        pe = model.rope(txt_ids, img_ids)
        batched = model(img, img_ids.expand(2, -1, -1), txt, txt_ids.expand(2, -1, -1), t, y, g, pe=pe)
    assert torch.equal(plain, batched)


def test_bad_inputs_name_the_problem():
    with torch.device("meta"):
        model = Flux1Transformer(TINY)
    img, img_ids, txt, txt_ids, t, y, g = make_inputs(1, 2, 2, 3, torch.float32)
    with pytest.raises(ValueError, match="pass guidance"):
        model(img, img_ids, txt, txt_ids, t, y, None)
    with pytest.raises(ValueError, match=r"img must be \(B, L, 64\)"):
        model(img[..., :10], img_ids, txt, txt_ids, t, y, g)
    with pytest.raises(ValueError, match=r"txt must be \(1, L, 32\)"):
        model(img, img_ids, txt[..., :5], txt_ids, t, y, g)


@pytest.mark.parametrize(
    ("cfg", "guidance"), [(FLUX1_DEV, True), (FLUX1_SCHNELL, False)], ids=["dev", "schnell"]
)
def test_full_size_parameter_count_matches_diffusers(cfg, guidance):
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        ours = Flux1Transformer(cfg)
        ref = FluxTransformer2DModel(guidance_embeds=guidance)
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_ours == sum(p.numel() for p in ref.parameters())
    if guidance:
        assert n_ours == 11_901_408_320


def test_runtime_never_imports_diffusers(tmp_path):
    path = save_bfl(make_diffusers_transformer(True), tmp_path / "f.safetensors")
    run_without_diffusers(
        f"""
        from tests.flux1_fixtures import make_inputs
        model = flux_runtime.load_transformer({str(path)!r}, dtype=torch.float32)
        img, img_ids, txt, txt_ids, t, y, g = make_inputs(1, 2, 3, 4, torch.float32)
        out = model(img, img_ids, txt, txt_ids, t, y, g)
        assert out.shape == (1, 6, 64)
        """
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_modulation_table_rows_give_the_live_forward(tmp_path, dtype):
    model = load_transformer(
        save_bfl(make_diffusers_transformer(True), tmp_path / "f.safetensors"), dtype=dtype
    )
    img, img_ids, txt, txt_ids, t, y, g = make_inputs(2, 3, 4, 5, dtype)
    with torch.no_grad():
        live = model(img, img_ids, txt, txt_ids, t, y, g)
        table = model.modulation_table(model.conditioning(t, y, g))  # (B, total) for this one step
        sliced = model(img, img_ids, txt, txt_ids, t, y, g, mods=table)
        other = model(img, img_ids, txt, txt_ids, t, y, g, mods=torch.zeros_like(table))
    cfg = model.config
    assert table.shape == (2, cfg.hidden_size * (12 * cfg.depth + 3 * cfg.depth_single_blocks + 2))
    assert torch.equal(sliced, live)
    assert not torch.equal(other, live)  # the table is really what the blocks read
