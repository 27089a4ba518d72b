"""The FLUX.3 DiT is bit-identical to diffusers' Flux3Transformer2DModel (CPU, tiny random weights)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flux_runtime.models.dit import FLUX3_KLEIN, FLUX3_KLEIN_BASE, PRESETS, TINY_FLUX2, TINY_FLUX3, DiTConfig
from flux_runtime.models.dit.flux3 import Flux3Transformer
from flux_runtime.weights import flux3_layout
from tests.flux3_fixtures import (
    as_loaded,
    bfl_state_dict,
    make_diffusers_flux3,
    make_inputs,
    our_forward,
    reference_forward,
)
from tests.models.helpers import check_layout_table


def _ours_from(ref_model, dtype: torch.dtype) -> Flux3Transformer:
    """Our model holding `ref_model`'s fp32 weights (through the BFL key table), cast as the loaders cast."""
    cfg = replace(TINY_FLUX3, flow_map=bool(ref_model.config.flow_map))
    with torch.device("meta"):
        model = Flux3Transformer(cfg)
    model.load_state_dict(bfl_state_dict(ref_model), strict=True, assign=True)
    return model.cast_to(dtype).eval()


@pytest.fixture(scope="module", params=[False, True], ids=["base", "flow-map"])
def ref_model(request):
    return make_diffusers_flux3(request.param, seed=3 if request.param else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "refs", [(), ((2, 3),), ((2, 2), (1, 3))], ids=["text-to-image", "one-reference", "two-references"]
)
def test_forward_equals_diffusers(ref_model, dtype, refs):
    flow_map = bool(ref_model.config.flow_map)
    ours = _ours_from(ref_model, dtype)
    x = make_inputs(2, 3, 4, 7, dtype, seed=1, refs=refs, flow_map=flow_map)
    expected = reference_forward(as_loaded(ref_model, dtype), x)
    got = our_forward(ours, x)
    assert got.shape == (2, 12, 128) and got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected), f"max diff {(got.float() - expected.float()).abs().max()}"


def test_norm_weights_stay_fp32_and_inputs_matter(ref_model):
    ours = _ours_from(ref_model, torch.bfloat16)
    dtypes = {n: p.dtype for n, p in ours.named_parameters()}
    assert {d for n, d in dtypes.items() if n.endswith("_norm.scale")} == {torch.float32}
    assert {d for n, d in dtypes.items() if not n.endswith("_norm.scale")} == {torch.bfloat16}
    flow_map = bool(ref_model.config.flow_map)
    x = make_inputs(1, 2, 3, 5, torch.bfloat16, refs=((2, 2),), flow_map=flow_map)
    base = our_forward(ours, x)
    # the reference tokens, their positions and (flow map) the target time all reach the output
    assert not torch.equal(base, our_forward(ours, x._replace(ref=x.ref + 1)))
    assert not torch.equal(base, our_forward(ours, x._replace(ref_ids=x.ref_ids - 1)))
    if flow_map:
        assert not torch.equal(base, our_forward(ours, x._replace(target=x.target * 0)))
    # precomputed RoPE and batched ids give the same output
    pe = ours.rope(x.txt_ids, x.img_ids, x.ref_ids)
    with torch.no_grad():
        again = ours(
            x.img, x.img_ids[None], x.txt, x.txt_ids[None], x.timesteps,
            ref=x.ref, ref_ids=x.ref_ids, target_timesteps=x.target, pe=pe,
        )  # fmt: skip
    assert torch.equal(base, again)


FLUX3_OPS = {
    "token_layer_norm_modulate",
    "qk_norm_rope_fp32",
    "token_gated_residual",
    "joint_token_gated_residual",
}


def test_lossless_tier_routes_the_per_token_chains_through_the_kernels(ref_model):
    """On the CPU every FLUX.3 op falls back to its reference (recorded by name), so the bits stay put."""
    from flux_runtime.kernels import fused_ops_report, reset_fused_ops_report, use_fused

    ours = _ours_from(ref_model, torch.bfloat16)
    x = make_inputs(1, 2, 3, 5, torch.bfloat16, refs=((2, 2),), flow_map=bool(ref_model.config.flow_map))
    off = our_forward(ours, x)
    reset_fused_ops_report(forget_signatures=True)
    with use_fused("lossless"):
        on = our_forward(ours, x)
    report = fused_ops_report()
    reset_fused_ops_report(forget_signatures=True)
    assert torch.equal(on, off)
    assert {op for op, _ in report.fallbacks} >= FLUX3_OPS
    assert report.tier_used == "lossless, partly reference"


def test_bad_inputs_name_the_problem():
    with torch.device("meta"):
        base = Flux3Transformer(TINY_FLUX3)
        flow = Flux3Transformer(replace(TINY_FLUX3, flow_map=True))
    x = make_inputs(2, 2, 2, 3, torch.float32, refs=((1, 2),), flow_map=True)
    with pytest.raises(ValueError, match=r"flow map .* pass target_timesteps \(B,\)"):
        flow(x.img, x.img_ids, x.txt, x.txt_ids, x.timesteps)
    with pytest.raises(ValueError, match=r"not a flow map .* pass target_timesteps=None"):
        base(x.img, x.img_ids, x.txt, x.txt_ids, x.timesteps, target_timesteps=x.target)
    with pytest.raises(ValueError, match="pass ref and ref_ids together"):
        base(x.img, x.img_ids, x.txt, x.txt_ids, x.timesteps, ref=x.ref)
    with pytest.raises(ValueError, match=r"ref must be \(2, L, 128\)"):
        base(x.img, x.img_ids, x.txt, x.txt_ids, x.timesteps, ref=x.ref[..., :64], ref_ids=x.ref_ids)
    with pytest.raises(ValueError, match=r"txt must be \(2, L, 256\)"):
        base(x.img, x.img_ids, x.txt[..., :32], x.txt_ids, x.timesteps)
    with pytest.raises(ValueError, match=r"img_ids must be \(L, 4\) or \(B, L, 4\)"):
        base(x.img, x.img_ids[:, :3], x.txt, x.txt_ids, x.timesteps)


def test_configs_are_checked():
    with pytest.raises(ValueError, match="needs a flux3 config, got family 'flux2'"):
        Flux3Transformer(TINY_FLUX2)
    with pytest.raises(ValueError, match="flux3 embeds no guidance"):
        replace(TINY_FLUX3, guidance_embed=True)
    with pytest.raises(ValueError, match="flux3 needs cond_in_channels > 0"):
        replace(TINY_FLUX3, cond_in_channels=0)
    with pytest.raises(ValueError, match="are flux3 fields; flux2 has neither"):
        replace(TINY_FLUX2, flow_map=True)
    with pytest.raises(ValueError, match="flux3 has no biases"):
        DiTConfig(family="flux3", qkv_bias=True, vec_in_dim=0, cond_in_channels=64)
    assert PRESETS["flux3-klein-base"] is FLUX3_KLEIN_BASE and PRESETS["flux3-klein"] is FLUX3_KLEIN
    assert PRESETS["tiny-flux3"] is TINY_FLUX3 and FLUX3_KLEIN.flow_map and not FLUX3_KLEIN_BASE.flow_map


PARAMS = {False: 5_538_458_368, True: 5_548_681_984}


@pytest.mark.parametrize("flow_map", [False, True], ids=["base", "flow-map"])
def test_full_size_parameter_count_matches_diffusers(flow_map):
    from diffusers import Flux3Transformer2DModel

    cfg = FLUX3_KLEIN if flow_map else FLUX3_KLEIN_BASE
    with torch.device("meta"):
        ours = Flux3Transformer(cfg)
        ref = Flux3Transformer2DModel(flow_map=flow_map)  # diffusers' defaults are FLUX.3 Klein
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_ours == sum(p.numel() for p in ref.parameters()) == PARAMS[flow_map]
    # and tensor for tensor: the layout table maps every diffusers tensor onto ours with its shape
    rules = flux3_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.flow_map)
    check_layout_table(flux3_layout, rules, ours, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("flow_map", [False, True], ids=["base", "flow-map"])
def test_full_size_one_step_at_1024_equals_diffusers_on_gpu(flow_map):
    """FLUX.3 Klein at full size, random bf16 weights (QK norms fp32, as from_pretrained keeps them), one step at
    1024² with 480 text tokens, without and with one 1024² reference; eager reference ops and the lossless tier."""
    from diffusers import Flux3Transformer2DModel

    from flux_runtime.kernels import fused_ops_report, reset_fused_ops_report, use_fused
    from flux_runtime.sampling.flux3 import flux3_image_ids
    from flux_runtime.text.flux3 import text_ids

    dev, bf = torch.device("cuda"), torch.bfloat16
    cfg = FLUX3_KLEIN if flow_map else FLUX3_KLEIN_BASE
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(bf)
    try:
        with torch.device(dev):
            ref = Flux3Transformer2DModel(flow_map=flow_map).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
                if ".norm_q." in name or ".norm_k." in name:
                    p.data = p.data.float()
    sd = ref.state_dict()
    table = flux3_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.flow_map)
    with torch.device("meta"):
        ours = Flux3Transformer(cfg)
    ours.load_state_dict(
        {r.bfl: flux3_layout.diffusers_to_bfl(r, sd.__getitem__) for r in table}, strict=True, assign=True
    )
    g = torch.Generator(device=dev).manual_seed(1)
    img = torch.randn(1, 4096, 128, device=dev, generator=g).to(bf)
    txt = torch.randn(1, 480, cfg.context_in_dim, device=dev, generator=g).to(bf)
    img_ids, txt_ids = flux3_image_ids(64, 64, device=dev), text_ids(480, dev)
    t = (torch.tensor(988.0, device=dev) / 1000).expand(1).to(bf)
    target = (torch.tensor(953.0, device=dev) / 1000).expand(1).to(bf) if flow_map else None
    for with_ref in (False, True):
        rf = torch.randn(1, 4096, 128, device=dev, generator=g).to(bf) if with_ref else None
        rf_ids = flux3_image_ids(64, 64, -1, device=dev) if with_ref else None
        with torch.no_grad():
            want = ref(
                hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=img_ids, txt_ids=txt_ids,
                image_cond_hidden_states=rf, image_cond_ids=rf_ids, target_timestep=target, return_dict=False,
            )[0]  # fmt: skip
            for tier in ("off", "lossless"):
                reset_fused_ops_report()
                with use_fused(tier):
                    got = ours(img, img_ids, txt, txt_ids, t, ref=rf, ref_ids=rf_ids, target_timesteps=target)
                assert torch.equal(got, want), f"reference={with_ref} tier={tier}: {(got - want).abs().max()}"
            # the lossless step ran every FLUX.3 kernel, each verified bit-exact, nothing on its reference
            report = fused_ops_report()
            assert not report.mismatches and not report.fallbacks, str(report)
            assert set(report.fused_calls) >= FLUX3_OPS, str(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fixed_streams_equal_the_full_forward_and_are_refused_by_a_flow_map(dtype):
    """`fixed_streams` + `forward(fixed=...)` is the forward with its text and reference work done beforehand."""
    base = _ours_from(make_diffusers_flux3(False, seed=0), dtype)
    gen = torch.Generator().manual_seed(0)
    img = torch.randn(2, 12, 128, generator=gen).to(dtype)
    txt = torch.randn(2, 7, base.config.context_in_dim, generator=gen).to(dtype)
    ref = torch.randn(2, 6, 128, generator=gen).to(dtype)
    img_ids, txt_ids, ref_ids = (torch.rand(n, 4, generator=gen) for n in (12, 7, 6))
    t = torch.tensor([0.7, 0.2]).to(dtype)
    want = base(img, img_ids, txt, txt_ids, t, ref=ref, ref_ids=ref_ids)
    fixed = base.fixed_streams(txt, txt_ids, img_ids, ref=ref, ref_ids=ref_ids)
    assert torch.equal(base(img, img_ids, None, txt_ids, t, ref_ids=ref_ids, fixed=fixed), want)
    assert torch.equal(base(img, img_ids, None, txt_ids, t, fixed=base.fixed_streams(txt, txt_ids, img_ids)),
                       base(img, img_ids, txt, txt_ids, t))  # fmt: skip
    with pytest.raises(ValueError, match="in place of txt and ref"):
        base(img, img_ids, txt, txt_ids, t, fixed=fixed)
    flow = _ours_from(make_diffusers_flux3(True, seed=3), dtype)
    with pytest.raises(ValueError, match="no fixed streams"):
        flow.fixed_streams(txt, txt_ids, img_ids)
