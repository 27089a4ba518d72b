"""FLUX.3 under memory plans: every plan gives the resident pipeline's bits (base with CFG and a reference, and
the flow map), budgets pick plans end to end, text-encoder offload works, and the planner's activation estimate
covers the full-size transformer's measured peak (meta device, `memory_trace.LiveBytes`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flux_runtime.models.dit.config import FLUX3_KLEIN, FLUX3_KLEIN_BASE
from flux_runtime.pipeline import Pipeline
from flux_runtime.pipeline.flux3 import UPSAMPLED_TEXT_TOKENS
from flux_runtime.pipeline.memory import GiB, MemoryBudgetError, plan_memory
from flux_runtime.pipeline.memory_trace import dit_model, flux3_peak
from flux_runtime.pipeline.placement import apply_plan, denoise_bytes, dit_layers, footprint
from tests.pipeline.test_flux3_pipeline import folders  # noqa: F401 - the tiny FLUX.3 folders
from tests.pipeline.test_memory import _plans

KW = dict(num_steps=2, output_type="latent", seed=3, height=32, width=48)
REF = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 48, 3), dtype=np.uint8))


@pytest.mark.parametrize("name", ["base", "flow-map"])
def test_every_plan_gives_the_same_bits(folders, name):  # noqa: F811
    ref = Pipeline.from_pretrained(folders[name], device="cpu", dtype=torch.float32)
    pipe = Pipeline.from_pretrained(folders[name], device="cpu", dtype=torch.float32)
    calls = [dict(prompt="a red fox"), dict(prompt="a cat", image=[REF])]
    want = [ref(**c, **KW).latents for c in calls]
    # the ring streams the image and joint blocks; the text and reference blocks stay with the rest
    t = pipe.transformer
    assert dit_layers(t) == [*t.content_mode_blocks["image"], *t.single_blocks]
    for plan in _plans(footprint(pipe))[:-1]:  # the plans test_memory runs (the last, resident, is `ref`)
        apply_plan(pipe, plan, torch.device("cpu"))
        pipe._prompts.clear()
        for _ in range(2):  # the second call: prompts from the cache, the ring wrapped around
            for c, w in zip(calls, want, strict=True):
                out = pipe(**c, **KW)
                assert torch.equal(out.latents, w), plan.describe()
        assert out.info["memory_plan"] == pipe.memory_plan.describe()
        assert not pipe.placement.models["text"].on_device  # left after encoding


def test_budgets_and_offload_end_to_end(tmp_path):
    """A budget that holds everything keeps it resident; the leanest budget the planner accepts moves weights
    (the tiny model's text and reference blocks are half its transformer, so it swaps rather than streams);
    both give the resident bits, as does text-encoder offload."""
    ref = Pipeline.from_pretrained("tiny-flux3-random", device="cpu")
    fp = footprint(ref)
    want = ref("a red fox", **KW).latents
    lean = 2 * (fp.text.total + fp.dit.total + fp.vae + fp.act_decode)
    while True:  # the smallest budget (within 3%) the planner accepts
        try:
            plan_memory(fp, int(lean * 0.97))
        except MemoryBudgetError:
            break
        lean = int(lean * 0.97)
    seen = []
    for budget in (2 * (fp.text.total + fp.dit.total + fp.vae + fp.act_decode), lean):
        pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", memory=budget)
        assert torch.equal(pipe("a red fox", **KW).latents, want)
        seen.append(pipe.memory_plan.name)
    assert seen[0] == "resident" and seen[1] in ("swap", "stream")
    off = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", offload_text_encoders=True)
    assert off.memory_plan.name == "offload-text" and torch.equal(off("a red fox", **KW).latents, want)
    with pytest.raises(MemoryBudgetError, match="cannot hold this model"):
        Pipeline.from_pretrained("tiny-flux3-random", device="cpu", memory=fp.vae)


def test_full_size_klein_plans_at_24_16_and_12_gb():
    """FLUX.3 Klein base in bf16 (11 GB transformer, Qwen3-VL-4B text encoder) on the planner's real sizes:
    24 GB holds everything, at 16 GB the text encoder and the transformer take turns, 12 GB streams the
    transformer's image and joint blocks."""
    from transformers import Qwen3VLForConditionalGeneration

    from flux_runtime.models.vae.flux2 import FLUX2_VAE, Flux2VAE
    from flux_runtime.pipeline.memory import WORKSPACE, Footprint
    from flux_runtime.pipeline.memory_trace import META, qwen3_vl_4b_config
    from flux_runtime.pipeline.placement import decode_bytes, encode_bytes
    from flux_runtime.pipeline.streaming import part_of
    from flux_runtime.text.llm import decoder_layers

    dit = dit_model(FLUX3_KLEIN_BASE)
    with META:
        text = Qwen3VLForConditionalGeneration(qwen3_vl_4b_config()).to(torch.bfloat16)
        vae = Flux2VAE(FLUX2_VAE).to(torch.bfloat16)
    fp = Footprint(
        text=part_of([text], decoder_layers(text)),
        dit=part_of([dit], dit_layers(dit)),
        vae=part_of([vae], []).rest,
        act_encode=encode_bytes([text], 512, 2),
        act_denoise=denoise_bytes(FLUX3_KLEIN_BASE, torch.bfloat16, 1024, 1024, 512, 1, cfg=True),
        act_decode=decode_bytes(FLUX2_VAE, torch.bfloat16, 1024, 1024, 1, tiled=False),
        act_decode_tiled=decode_bytes(FLUX2_VAE, torch.bfloat16, 1024, 1024, 1, tiled=True),
        workspace=WORKSPACE,
    )
    assert 10 * GiB < fp.dit.total < 10.5 * GiB and len(fp.dit.layers) == 5 + 28
    plans = {gb: plan_memory(fp, gb * GiB) for gb in (24, 16, 12)}
    assert plans[24].name == "resident"
    assert plans[16].name == "swap"  # text encoder and transformer (19 GB together) take turns
    assert plans[12].name == "stream" and plans[12].dit == "streamed"
    assert all(plan.peak <= gb * GiB for gb, plan in plans.items())


def test_planned_tokens_follow_the_call(folders):  # noqa: F811
    pipe = Pipeline.from_pretrained(folders["base"], device="cpu", dtype=torch.float32, memory=1 << 40)
    assert pipe.planned_tokens(None) == (512, 0)
    seen = {}
    planned = pipe.planned_tokens

    def record(call):  # what the plan's check of each call budgets
        seen["tokens"] = planned(call)
        return seen["tokens"]

    pipe.planned_tokens = record
    pipe("a red fox", **KW)
    assert seen["tokens"] == (pipe.text_encoder.text_window("a red fox"), 0) and seen["tokens"][0] % 80 == 0
    pipe("a red fox", image=[REF], **KW)  # one reference, on its canvas of at least 64 px a side
    assert seen["tokens"][1] == (64 // 4) ** 2  # 4 px a token with the tiny 2x VAE
    assert UPSAMPLED_TEXT_TOKENS % 80 == 0 and UPSAMPLED_TEXT_TOKENS >= 3584


@pytest.mark.parametrize(
    ("flow_map", "fp8", "batch", "ref_side"),
    [
        (False, False, 1, None),
        (True, False, 1, 1024),
        pytest.param(False, True, 2, None, marks=pytest.mark.slow),
    ],
)
def test_denoise_estimate_covers_the_full_size_peak(flow_map, fp8, batch, ref_side):
    """FLUX.3 Klein at 1024² with 512 text tokens (and a 1024² reference): the estimate the planner budgets a
    call with is above what the forward allocates (FP8 with the reference quantization's fp32 temporaries)."""
    cfg = FLUX3_KLEIN if flow_map else FLUX3_KLEIN_BASE
    measured = flux3_peak(dit_model(cfg, fp8=fp8), batch, 1024, 512, ref_side).peak
    extra = 0 if ref_side is None else (ref_side // 16) ** 2
    estimate = denoise_bytes(cfg, torch.bfloat16, 1024, 1024, 512, batch, cfg=False, extra_tokens=extra)
    assert measured > 0.5 * GiB * batch  # the forward really ran at full size
    assert estimate >= measured, f"estimate {estimate / GiB:.2f} GiB < measured {measured / GiB:.2f}"
