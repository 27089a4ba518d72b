"""The attention backends in the blocks (`kernels.attention_backends`, `models.dit.fp8_attention`).

`lossless` runs SDPA only, bit for bit as before; `high` runs SDPA too unless FP8 attention is asked for, and set to
"auto" runs FA3's e4m3 attention where it can (a CUDA sm90 device, the fa3-fwd package, bf16, heads of 128) and
otherwise says once why attention stays bf16. Every test but the default's starts from "auto". On the CPU the
FP8 path is exercised with a stand-in for FA3 (`fp8_attention_reference`: the attention its e4m3 inputs stand
for) and the obstacle check switched off: the producers then run their eager references, and every block's
wiring (double blocks' joint `[txt | img]`, single blocks' 16-bit, static-e4m3 and per-row FP8 outputs) runs.
The GPU tests run the real thing.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels import attention_backends as backends
from flux_runtime.kernels import use_fused
from flux_runtime.kernels.attention_quant import (
    Fp8Heads,
    attention_fp32,
    fp8_attention_reference,
    relative_error,
)
from flux_runtime.models.dit import fp8_attention
from tests.kernels.helpers import gpu
from tests.models.test_head_major import forward, set_static_scales
from tests.parallel.workers import random_model

MISSING = f"the fa3-fwd package is not installed ({backends.EXTRA}): No module named 'fa3_fwd_interface'"


def _reset() -> None:
    backends._choose.cache_clear()
    backends._said.clear()
    backends.reset_attention_record()


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each test starts with no cached choice, nothing said, nothing recorded, the default preference."""
    monkeypatch.setattr(backends, "_preference", ["auto"])
    _reset()
    yield
    _reset()


@pytest.fixture
def fake_fa3(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Fp8Heads, Fp8Heads, Fp8Heads]]:
    """FP8 attention "available" on the CPU, FA3 replaced by the attention of its dequantized inputs (bf16 out);
    returns the inputs of each call."""
    calls: list[tuple[Fp8Heads, Fp8Heads, Fp8Heads]] = []

    def stand_in(q: Fp8Heads, k: Fp8Heads, v: Fp8Heads) -> Tensor:
        calls.append((q, k, v))
        return fp8_attention_reference(q, k, v).to(torch.bfloat16)

    monkeypatch.setattr(backends, "fp8_obstacle", lambda device, dtype, head_dim: None)
    monkeypatch.setattr(backends, "_fa3", lambda: MISSING.replace("not installed", "faked"))
    monkeypatch.setattr(fp8_attention, "fa3_fp8_attention", stand_in)
    return calls


def missing_fa3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "_fa3", lambda: MISSING)


def run(model: Any, tier: str) -> Tensor:
    with use_fused(tier):  # type: ignore[arg-type]
        return forward(model, 2)


@pytest.mark.parametrize("tier", ["off", "lossless"])
def test_lossless_runs_sdpa_bit_for_bit(tier: str, fake_fa3: list) -> None:
    """Even with FP8 attention available, `off` and `lossless` run SDPA: the same bits as before, recorded."""
    model = random_model("flux1", 3, torch.bfloat16)
    want = forward(model, 2)
    backends.reset_attention_record()
    assert torch.equal(run(model, tier), want)
    assert not fake_fa3
    reason = "reference ops (no fused kernels here)" if tier == "off" else "the lossless tier runs SDPA only"
    assert backends.attention_record() == {"attention": "sdpa", "attention_reason": reason}
    assert backends.attention_calls() == {"sdpa": 4}  # 2 double + 2 single blocks


@pytest.mark.parametrize(
    "family, precision", [("flux1", "bf16"), ("flux2", "bf16"), ("flux1", "fp8"), ("flux2", "fp8-static")]
)
def test_high_runs_fp8_attention_in_every_block(family: str, precision: str, fake_fa3: list) -> None:
    """Every block's attention goes through the FP8 path in `high`: e4m3 q, k, v with (B, H) descales, the
    joint length in the double blocks; the forward stays close to the lossless one and the record says so."""
    model = random_model(family, 3, torch.bfloat16)
    if precision != "bf16":
        from flux_runtime.weights.fp8 import quantize_model

        quantize_model(model, torch.bfloat16)
        if precision == "fp8-static":
            set_static_scales(model)
    want = run(model, "lossless")
    backends.reset_attention_record()
    got = run(model, "high")
    assert len(fake_fa3) == len(model.double_blocks) + len(model.single_blocks)
    for q, k, v in fake_fa3:
        for t in (q, k, v):
            assert t.data.dtype == torch.float8_e4m3fn and t.data.shape == (2, 5 + 12, 3, 16)
            assert t.descale.shape == (2, 3) and t.descale.dtype == torch.float32
    assert backends.attention_record() == {
        "attention": "fa3-fp8",
        "attention_reason": backends.FA3_FP8.reason,
    }
    err = relative_error(got, want)
    assert 0 < err < 0.1, err


def test_high_without_fa3_stays_bf16_and_says_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On the CPU (and without the package) `high` attention is today's SDPA, bit for bit, said once."""
    missing_fa3(monkeypatch)
    model = random_model("flux2", 3, torch.bfloat16)
    want = run(model, "lossless")
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        assert torch.equal(run(model, "high"), want)
        assert torch.equal(run(model, "high"), want)
    said = [r.message for r in caplog.records if "attention stays bf16" in r.message]
    assert said == [
        "quality 'high': attention stays bf16 (SDPA): on cpu; FP8 attention needs an sm90 (Hopper) GPU"
    ]
    assert backends.attention_record()["attention"] == "sdpa"


def test_obstacles_name_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason `high` keeps bf16 attention, checked in order: device, GPU generation, dtype, head width,
    package."""
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16
    missing_fa3(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert "sm89" in str(backends.fp8_obstacle(cuda, bf16, 128))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "float16" in str(backends.fp8_obstacle(cuda, torch.float16, 128))
    assert "heads of 64" in str(backends.fp8_obstacle(cuda, bf16, 64))
    assert backends.fp8_obstacle(cuda, bf16, 128) == MISSING
    assert "pip install 'flux-runtime[fp8-attention]'" in MISSING
    monkeypatch.setattr(backends, "_fa3", lambda: object())  # the package imports
    assert backends.fp8_obstacle(cuda, bf16, 128) is None
    assert backends.choose_attention("high", cuda, bf16, 128) == backends.FA3_FP8
    assert not backends.choose_attention("lossless", cuda, bf16, 128).fp8


def test_asking_for_fp8_attention_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    missing_fa3(monkeypatch)
    with pytest.raises(backends.MissingFp8Attention) as e:
        backends.set_attention_backend("fa3-fp8")
    assert "\n" not in str(e.value) and backends.EXTRA in str(e.value)
    with pytest.raises(ValueError, match="unknown attention backend"):
        backends.set_attention_backend("flash")  # type: ignore[arg-type]
    with pytest.raises(backends.MissingFp8Attention):
        backends.fa3_fp8_attention(*(Fp8Heads(torch.empty(0), torch.empty(0)),) * 3)


def test_forcing_sdpa_keeps_high_in_bf16(fake_fa3: list) -> None:
    model = random_model("flux1", 3, torch.bfloat16)
    want = run(model, "lossless")
    with backends.attention_backend("sdpa"):
        assert torch.equal(run(model, "high"), want)
    assert not fake_fa3 and backends._preference == ["auto"]
    assert "attention backend set to sdpa" in backends.attention_record()["attention_reason"]


def test_fp8_attention_is_opt_in(
    fake_fa3: list, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """By default `high` attends in bf16 even where FP8 attention could run (its image error is outside `high`'s
    budget): the lossless bits, nothing said, and the record says why."""
    monkeypatch.setattr(backends, "_preference", ["sdpa"])  # the module's default, as a fresh process has it
    model = random_model("flux1", 3, torch.bfloat16)
    want = run(model, "lossless")
    backends.reset_attention_record()
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        assert torch.equal(run(model, "high"), want)
    assert not fake_fa3 and not caplog.records
    assert backends.attention_record()["attention_reason"].endswith("(FP8 attention is opt-in)")


def test_sequence_parallel_attention_stays_bf16(fake_fa3: list) -> None:
    """A block whose `attend` is not full attention (Ulysses' head exchange) keeps bf16 heads."""
    model = random_model("flux1", 3, torch.bfloat16)
    block = model.single_blocks[0]
    block.attend = lambda *a, **kw: fp8_attention.attention(*a, **kw)
    x = torch.zeros(1, 4, 3, 16, dtype=torch.bfloat16)
    with use_fused("high"):
        assert fp8_attention.attention_choice(block, x) == fp8_attention.SEQUENCE_PARALLEL
        assert fp8_attention.attention_choice(model.single_blocks[1], x).fp8


def test_first_and_last_blocks_kept_in_bf16(fake_fa3: list) -> None:
    """`keep_bf16_attention`: those blocks run SDPA under `high`, the rest FP8, and the record names both."""
    model = random_model("flux2", 3, torch.bfloat16)
    fp8_attention.keep_bf16_attention(model, first=1, last=1)
    run(model, "high")
    assert len(fake_fa3) == 2 and backends.attention_calls() == {"fa3-fp8": 2, "sdpa": 2}
    record = backends.attention_record()
    assert record["attention"] == "fa3-fp8, sdpa"
    assert fp8_attention.KEPT_BF16.reason in record["attention_reason"]
    fp8_attention.keep_bf16_attention(model)
    backends.reset_attention_record()
    run(model, "high")
    assert backends.attention_calls() == {"fa3-fp8": 4}


def test_pipeline_records_the_attention_backend(fake_fa3: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The provenance names the backend that ran; `high` with FP8 attention lists it among its approximations."""
    from flux_runtime.pipeline import Pipeline, core
    from flux_runtime.pipeline.provenance import OPTIONAL_FIELDS
    from flux_runtime.pipeline.tiers import FP8_ATTENTION, RunTier

    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.bfloat16)
    kw = dict(height=32, width=32, num_steps=2, output_type="latent", seed=1)
    info = pipe("a cat", **kw).info
    assert info["attention"] == "sdpa" and FP8_ATTENTION not in info["approximations"]
    assert OPTIONAL_FIELDS["attention"].ok(info["attention"])
    monkeypatch.setattr(core, "resolve_tier", lambda q, d, t: RunTier("high", "high"))
    info = pipe("a cat", quality="high", **kw).info
    assert info["attention"] == "fa3-fp8" and FP8_ATTENTION in info["approximations"]


@gpu
@pytest.mark.gpu
def test_fa3_fp8_at_flux_shapes_gpu() -> None:
    """FA3 e4m3 (per-head scales from the producers' reference) against float64 attention of the bf16 inputs at
    FLUX shapes: within 8 % relative (the CPU reference measures 4-6 % at these statistics; the issue 5.2 %),
    and no more than 1.5 points above the e4m3 reference with e4m3 probabilities (FA3's own rounding of P)."""
    if backends.fp8_obstacle(torch.device("cuda"), torch.bfloat16, 128) is not None:
        pytest.skip(str(backends.fp8_obstacle(torch.device("cuda"), torch.bfloat16, 128)))
    from flux_runtime.kernels.attention_quant import quantize_heads_reference
    from tests.kernels.test_attention_quant import attention_inputs

    for heads, tokens in ((24, 512 + 4096), (48, 512 + 4096), (24, 512 + 16384)):
        q, k, v = (t.cuda() for t in attention_inputs(1, tokens, heads, key_offset=2.0))
        q8, k8, v8 = (quantize_heads_reference(t) for t in (q, k, v))
        got = backends.fa3_fp8_attention(q8, k8, v8)
        assert got.dtype == torch.bfloat16 and got.shape == q.shape
        # the references on the first 4 heads (each head is its own attention; the 2048² scores of all heads in
        # float64 would not fit)
        few = slice(0, 4)
        ref = attention_fp32(q[:, :, few], k[:, :, few], v[:, :, few], torch.float64)
        model = fp8_attention_reference(
            *(Fp8Heads(t.data[:, :, few], t.descale[:, few]) for t in (q8, k8, v8)), fp8_probabilities=True
        )
        err, err_model = relative_error(got[:, :, few], ref), relative_error(model, ref)
        assert err < 0.08 and err < err_model + 0.015, (heads, tokens, err, err_model)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_high_fp8_attention_forward_gpu(family: str) -> None:
    """The real path on an sm90 GPU with fa3-fwd: a tiny 128-wide-head model's `high` forward within 10 %
    of its lossless forward, every attention call FA3's."""
    if backends.fp8_obstacle(torch.device("cuda"), torch.bfloat16, 128) is not None:
        pytest.skip(str(backends.fp8_obstacle(torch.device("cuda"), torch.bfloat16, 128)))
    from dataclasses import replace

    from flux_runtime.models.dit import TINY, TINY_FLUX2, Flux1Transformer, Flux2Transformer

    base = TINY if family == "flux1" else TINY_FLUX2
    axes = (16, 56, 56) if family == "flux1" else (32, 32, 32, 32)
    cfg = replace(base, num_heads=2, hidden_size=256, axes_dim=axes)
    model = (Flux1Transformer if family == "flux1" else Flux2Transformer)(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model = model.to("cuda", torch.bfloat16).eval()
    from tests.parallel.workers import inputs

    args, kwargs = inputs(model, 1, 16, 16, 64)
    args = tuple(a.cuda() if isinstance(a, Tensor) else a for a in args)
    kwargs = {"pe": tuple(t.cuda() for t in kwargs["pe"])}
    with torch.no_grad(), use_fused("lossless"):
        want = model(*args, **kwargs)
    backends.reset_attention_record()
    with torch.no_grad(), use_fused("high"):
        got = model(*args, **kwargs)
    assert backends.attention_calls() == {"fa3-fp8": len(model.double_blocks) + len(model.single_blocks)}
    assert relative_error(got, want) < 0.1


def wide_head_pipe(device: str) -> Any:
    """The built-in `tiny` pipeline with its transformer swapped for a random one of 2 heads of 128 (the width the
    e4m3 producers take; the tiny models' heads are narrower): same text and latent widths, so its text encoders
    and autoencoder still fit."""
    from dataclasses import replace

    from flux_runtime.models.dit import Flux1Transformer
    from flux_runtime.pipeline import Pipeline

    pipe = Pipeline.from_pretrained("tiny", device=device, dtype=torch.bfloat16)
    model = Flux1Transformer(
        replace(pipe.transformer.config, hidden_size=256, num_heads=2, axes_dim=(16, 56, 56))
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.02))
    pipe.transformer = model.to(device, torch.bfloat16).eval()
    return pipe


def psnr_high_fp8_vs_sdpa(pipe: Any) -> tuple[float, dict]:
    """PSNR (dB) of a `high` image with FP8 attention against the `high` image with SDPA (the other approximations
    the same in both), and the FP8 call's record."""
    import numpy as np

    kw = dict(height=64, width=64, num_steps=4, output_type="np", seed=1)
    with backends.attention_backend("sdpa"):
        want = np.asarray(pipe("a cat", quality="high", **kw).images, dtype=np.float64)
    out = pipe("a cat", quality="high", **kw)
    got = np.asarray(out.images, dtype=np.float64)
    mse = max(float(((got - want) ** 2).mean()), 1e-12)
    return 10 * float(np.log10(255.0**2 / mse)), out.info


def test_high_image_with_fp8_attention(fake_fa3: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-step image through the whole pipeline with the FP8 path in every block (FA3's stand-in, with its e4m3
    probabilities) stays at least 40 dB PSNR from the same `high` image with SDPA (measured: 51.3 dB)."""
    from flux_runtime.pipeline import core
    from flux_runtime.pipeline.tiers import FP8_ATTENTION, RunTier

    monkeypatch.setattr(
        fp8_attention,
        "fa3_fp8_attention",
        lambda q, k, v: fp8_attention_reference(q, k, v, fp8_probabilities=True).to(torch.bfloat16),
    )
    monkeypatch.setattr(core, "resolve_tier", lambda q, d, t: RunTier("high", "high"))
    psnr, info = psnr_high_fp8_vs_sdpa(wide_head_pipe("cpu"))
    assert info["attention"] == "fa3-fp8" and FP8_ATTENTION in info["approximations"]
    assert 40 < psnr < 90, psnr


@gpu
@pytest.mark.gpu
def test_high_image_with_fp8_attention_gpu() -> None:
    """The same with FA3 on an sm90 GPU (CUDA graphs, the producers fused): at least 40 dB."""
    if backends.fp8_obstacle(torch.device("cuda"), torch.bfloat16, 128) is not None:
        pytest.skip(str(backends.fp8_obstacle(torch.device("cuda"), torch.bfloat16, 128)))
    psnr, info = psnr_high_fp8_vs_sdpa(wide_head_pipe("cuda"))
    assert info["attention"] == "fa3-fp8" and info["quality"] == "high"
    assert 40 < psnr < 90, psnr


def _flux3() -> tuple[Any, Any]:
    """Our tiny FLUX.3 (QK-norm weights fp32, the rest bf16, as loaded) and inputs with one reference image."""
    from tests.flux3_fixtures import make_diffusers_flux3, make_inputs
    from tests.models.test_flux3_dit import _ours_from

    model = _ours_from(make_diffusers_flux3(flow_map=False, seed=4), torch.bfloat16)
    return model, make_inputs(2, 3, 4, 5, torch.bfloat16, refs=((2, 2),))


def _flux3_run(model: Any, x: Any, tier: str) -> Tensor:
    from tests.flux3_fixtures import our_forward

    with use_fused(tier):  # type: ignore[arg-type]
        return our_forward(model, x)


def test_flux3_high_runs_fp8_attention_in_every_block(fake_fa3: list) -> None:
    """FLUX.3's blocks (per-mode and joint) attend in FP8 under `high`: e4m3 q, k, v with (B, H) descales, every
    call recorded; the forward stays close to the lossless one, which is unchanged and recorded as SDPA."""
    model, x = _flux3()
    want = _flux3_run(model, x, "lossless")
    calls = backends.attention_calls()
    assert not fake_fa3 and set(calls) == {"sdpa"} and calls["sdpa"] > 0
    assert backends.attention_record()["attention_reason"] == "the lossless tier runs SDPA only"
    backends.reset_attention_record()
    got = _flux3_run(model, x, "high")
    assert len(fake_fa3) == calls["sdpa"] and backends.attention_calls() == {"fa3-fp8": calls["sdpa"]}
    heads, dim = model.config.num_heads, model.config.head_dim
    for q, k, v in fake_fa3:
        for t in (q, k, v):
            assert t.data.dtype == torch.float8_e4m3fn and t.data.shape[2:] == (heads, dim)
            assert t.descale.shape == (2, heads)
    err = relative_error(got, want)
    assert 0 < err < 0.1, err


def test_flux3_high_without_fa3_is_lossless_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    missing_fa3(monkeypatch)
    model, x = _flux3()
    want = _flux3_run(model, x, "lossless")
    assert torch.equal(_flux3_run(model, x, "high"), want)
    assert backends.attention_record()["attention"] == "sdpa"


@gpu
@pytest.mark.gpu
def test_flux3_high_fp8_attention_forward_gpu() -> None:
    """FLUX.3 on an sm90 GPU with fa3-fwd: a tiny model with heads of 128, its `high` forward within 10 % of its
    lossless one, every attention call FA3's, the producers fused."""
    if backends.fp8_obstacle(torch.device("cuda"), torch.bfloat16, 128) is not None:
        pytest.skip(str(backends.fp8_obstacle(torch.device("cuda"), torch.bfloat16, 128)))
    from dataclasses import replace

    from flux_runtime.models.dit import TINY_FLUX3
    from flux_runtime.models.dit.flux3 import Flux3Transformer
    from tests.flux3_fixtures import make_inputs, our_forward

    model = Flux3Transformer(replace(TINY_FLUX3, num_heads=2, hidden_size=256, axes_dim=(32, 32, 32, 32)))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.02)
                + (p.ndim == 1)
            )
    model = model.cast_to(torch.bfloat16).to("cuda").eval()
    x = make_inputs(1, 16, 16, 64, torch.bfloat16, refs=((8, 8),))
    x = type(x)(*(t.cuda() if isinstance(t, Tensor) else t for t in x))
    with use_fused("lossless"):
        want = our_forward(model, x)
    lossless_calls = backends.attention_calls()["sdpa"]
    backends.reset_attention_record()
    with use_fused("high"):
        got = our_forward(model, x)
    assert backends.attention_calls() == {"fa3-fp8": lossless_calls}
    assert relative_error(got, want) < 0.1
