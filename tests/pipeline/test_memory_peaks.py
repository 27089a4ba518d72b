"""The planner's activation estimates against the measured peaks of the real full-size models.

Each model runs at full size on the meta device under `memory_trace.LiveBytes`, which counts the bytes of
every live tensor our code allocates (no memory is used, so FLUX.2-dev's 32 B transformer runs on a laptop
CPU in seconds). A test fails when an estimate the planner budgets with is below what was measured, so a
change to a model that makes it allocate more cannot go unnoticed by the memory plans.
"""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from transformers import CLIPTextModel, Mistral3ForConditionalGeneration, T5EncoderModel

from flux_runtime.models.dit.config import FLUX1_DEV, FLUX2_DEV
from flux_runtime.models.vae.flux1 import FLUX1_VAE, Flux1VAE
from flux_runtime.models.vae.flux2 import FLUX2_VAE, Flux2VAE
from flux_runtime.pipeline.memory import WORKSPACE, Footprint, GiB, plan_memory, usable
from flux_runtime.pipeline.memory_trace import (
    META,
    LiveBytes,
    clip_l_config,
    decode_peak,
    dit_model,
    dit_peak,
    encoder_peak,
    mistral_small_config,
    t5_xxl_config,
)
from flux_runtime.pipeline.placement import decode_bytes, denoise_bytes, encode_bytes
from flux_runtime.pipeline.streaming import part_of

BF = torch.bfloat16
CONFIGS = {"flux1-dev": FLUX1_DEV, "flux2-dev": FLUX2_DEV}


def test_the_tracker_counts_each_storage_once_while_it_lives() -> None:
    with META:
        w = torch.empty(100, 100)
    with torch.inference_mode(), LiveBytes([w]) as t:
        x = torch.empty(1000, device=META)  # 4000 bytes: one 4096-byte block
        y = x[10:].view(-1, 10)  # a view: no new bytes
        x.add_(1)  # in place: none
        assert t.live == 4096
        v = w[:50]  # a view of an excluded weight: not counted
        z = torch.cat([y, y])  # 7920 bytes: 8192 allocated
        assert t.live == 4096 + 8192
        del x
        assert t.live == 4096 + 8192  # y still holds the storage
        del y, z, v
        assert t.live == 0 and t.peak == 4096 + 8192 and "cat" in t.peak_op


@pytest.fixture(scope="module")
def dits() -> dict[tuple[str, bool], torch.nn.Module]:
    return {(name, fp8): dit_model(cfg, fp8=fp8) for name, cfg in CONFIGS.items() for fp8 in (False, True)}


@pytest.mark.parametrize(
    ("name", "fp8", "batch"),
    [("flux1-dev", False, 1), pytest.param("flux1-dev", False, 2, marks=pytest.mark.slow),
     pytest.param("flux1-dev", True, 1, marks=pytest.mark.slow), ("flux2-dev", False, 1), ("flux2-dev", True, 1)],
)  # fmt: skip
def test_denoise_estimate_covers_the_measured_peak(
    dits: dict[tuple[str, bool], torch.nn.Module], name: str, fp8: bool, batch: int
) -> None:
    """At 1024² with 512 text tokens. FP8 runs the reference quantization (fp32 temporaries the fused GPU
    kernel does not make), so its measured peak bounds the GPU's from above."""
    measured = dit_peak(dits[name, fp8], batch).peak
    estimate = denoise_bytes(CONFIGS[name], BF, 1024, 1024, 512, batch, cfg=False)
    assert measured > 0.3 * GiB * batch  # the forward really ran at full size
    assert estimate >= measured, (
        f"{name} fp8={fp8} B={batch}: estimate {estimate / GiB:.2f} GiB < {measured / GiB:.2f}"
    )


@pytest.mark.parametrize(("cls", "config"), [(Flux1VAE, FLUX1_VAE), (Flux2VAE, FLUX2_VAE)])
def test_decode_estimate_covers_the_measured_peak(cls: type, config: object) -> None:
    with META:
        vae = cls(config).to(BF).eval()
    for batch in (1, 2):
        measured = decode_peak(vae, batch).peak
        estimate = decode_bytes(config, BF, 1024, 1024, batch, tiled=False)
        assert measured > GiB * batch
        assert estimate >= measured, f"B={batch}: estimate {estimate / GiB:.2f} GiB < {measured / GiB:.2f}"


@pytest.mark.slow
def test_encode_estimates_cover_the_measured_peaks() -> None:
    """T5-XXL + CLIP-L (FLUX.1) and Mistral Small 3.1 (FLUX.2-dev, all hidden states kept), 512 tokens."""
    with META:
        t5 = T5EncoderModel(t5_xxl_config()).to(BF).eval()
        clip = CLIPTextModel(clip_l_config()).to(BF).eval()
        mistral = Mistral3ForConditionalGeneration(mistral_small_config()).to(BF).eval()
    flux1 = max(encoder_peak(t5, 1, 512).peak, encoder_peak(clip, 1, 77).peak)
    assert encode_bytes([clip, t5], 512, 1) >= flux1 > 32 << 20
    flux2 = encoder_peak(
        mistral, 1, 512, attention_mask=True, output_hidden_states=True, use_cache=False
    ).peak
    assert encode_bytes([mistral], 512, 1) >= flux2 > 256 << 20


@pytest.mark.parametrize("budget_gb", [24, pytest.param(16, marks=pytest.mark.slow)])
def test_flux1_dev_stream_plan_holds_the_measured_peaks(
    dits: dict[tuple[str, bool], torch.nn.Module], budget_gb: int
) -> None:
    """FLUX.1-dev bf16 (the real sizes: 23.8 GB transformer, T5-XXL, CLIP-L) at the budgets that ran out of
    memory on the H200: the plan streams, and the transformer stage's weights plus the measured activation
    peaks (denoise and decode) fit what the budget leaves after the allocator's headroom and workspaces."""
    dit = dits["flux1-dev", False]
    with META:
        t5 = T5EncoderModel(t5_xxl_config()).to(BF).eval()
        clip = CLIPTextModel(clip_l_config()).to(BF).eval()
        vae = Flux1VAE(FLUX1_VAE).to(BF).eval()
    fp = Footprint(
        text=part_of([clip, t5], list(t5.encoder.block)),
        dit=part_of([dit], [*dit.double_blocks, *dit.single_blocks]),
        vae=part_of([vae], []).rest,
        act_encode=encode_bytes([clip, t5], 512, 1),
        act_denoise=denoise_bytes(FLUX1_DEV, BF, 1024, 1024, 512, 1, cfg=False),
        act_decode=decode_bytes(FLUX1_VAE, BF, 1024, 1024, 1, tiled=False),
        act_decode_tiled=decode_bytes(FLUX1_VAE, BF, 1024, 1024, 1, tiled=True),
        workspace=WORKSPACE,
    )
    assert 22 * GiB < fp.dit.total < 22.5 * GiB
    plan = plan_memory(fp, budget_gb * GiB)
    assert plan.name == "stream" and plan.dit == "streamed" and plan.peak <= budget_gb * GiB
    streamed = [fp.dit.layers[i] for i in plan.streamed_dit]
    weights = fp.dit.total - sum(streamed) + plan.slots * max(streamed) + fp.vae
    measured = max(dit_peak(dit, 1).peak, decode_peak(vae, 1).peak)
    assert weights + measured <= usable(budget_gb * GiB, WORKSPACE)


def test_an_out_of_memory_inside_a_plan_names_it_and_leaves_nothing_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A simulated CUDA out-of-memory in the middle of a streamed forward: one FluxError naming the budget,
    the plan and what to try; every non-resident model off the device, the ring closed, no unit holding a
    device buffer, and the failed forward's own tensors freed (even through a reference cycle)."""
    from flux_runtime.pipeline import FluxError, Pipeline
    from flux_runtime.pipeline.memory import Plan, spread
    from flux_runtime.pipeline.placement import apply_plan, footprint

    pipe = Pipeline.from_pretrained("tiny", device="cpu")
    n = len(footprint(pipe).dit.layers)
    plan = Plan(
        "stream", 8 * GiB, text="offloaded", dit="streamed", streamed_dit=spread(n, 2), together=False
    )
    apply_plan(pipe, plan, torch.device("cpu"))
    block = pipe.transformer.single_blocks[1]

    held: list[weakref.ref] = []

    def boom(*args: object, **kwargs: object) -> None:
        activation = torch.empty(1000)  # what a failed forward still holds in its frames
        frame = sys._getframe()  # a reference cycle through the frame, as tracebacks often make
        held.append(weakref.ref(activation))
        del frame
        frame = sys._getframe()  # noqa: F841
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")

    monkeypatch.setattr(block, "forward", boom)
    with pytest.raises(
        FluxError, match=r"under the stream plan with a 8\.0 GB budget: try a smaller size"
    ) as e:
        pipe("a red fox", num_steps=1, output_type="latent", seed=3, height=64, width=64)
    assert "--memory" in str(e.value) and "\n" not in str(e.value)
    assert held and held[0]() is None, "the failed forward's tensors outlived the error"
    for model in pipe.placement.models.values():
        assert not model.on_device and model.ring is None
        assert all(unit.owned is None for unit in model.units)
    monkeypatch.undo()
    assert (
        pipe("a red fox", num_steps=1, output_type="latent", seed=3, height=64, width=64)
        .latents.isfinite()
        .all()
    )


@pytest.mark.gpu
def test_a_budget_above_what_the_gpu_has_is_lowered_to_it() -> None:
    from flux_runtime.pipeline.memory import resolve_budget

    dev = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info(dev)
    most = free + torch.cuda.memory_reserved(dev)
    assert resolve_budget("100000GB", dev) <= most
    assert resolve_budget("1GB", dev) == GiB
