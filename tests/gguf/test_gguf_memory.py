"""A GGUF transformer under the memory plans, on the CPU: the same bits as resident under every plan, the blocks
moved and streamed as the file stores them (uint8, never a dequantized copy), plans chosen on those stored sizes,
the dequantization's temporaries in the peak estimate, and LoRAs fused into a streamed model.

The placement code runs here with plain copies (host and "device" both the CPU), as in tests/pipeline/test_memory.py;
tests/gguf/test_gguf_memory_gpu.py runs it on CUDA.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from flux_runtime.kernels.dispatch import use_fused
from flux_runtime.models.dit.layers import GgufLinear
from flux_runtime.pipeline import Pipeline
from flux_runtime.pipeline.dequant_memory import dequant_bytes, reference_peak
from flux_runtime.pipeline.memory import (
    Footprint,
    MemoryBudgetError,
    Part,
    Plan,
    budget_needed,
    plan_memory,
    spread,
)
from flux_runtime.pipeline.memory_trace import LiveBytes
from flux_runtime.pipeline.placement import apply_plan, denoise_bytes, dit_layers, footprint
from flux_runtime.weights.gguf_file import GgufSource
from tests.gguf_fixtures import text_encoder_folders, write_flux1_pair

pytest.importorskip("diffusers")

BF = torch.bfloat16
KW = dict(height=32, width=48, max_sequence_length=64, num_steps=1, seed=1, output_type="latent")


def build_files(root: Path) -> dict[str, Path]:
    """A tiny FLUX.1-dev pipeline folder under `root`, its transformer as a BFL-named GGUF file (Q4_0, Q8_0 where a
    row does not hold whole Q4_0 blocks), and CLIP and T5 folders for the BFL file set."""
    from diffusers import FluxTransformer2DModel

    from tests.pipeline.test_flux1_pipeline import _save_pipeline

    folder = _save_pipeline(root / "FLUX.1-tiny", True)
    model = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    bfl, _, _ = write_flux1_pair(model, root / "files", "Q4_0")
    text_encoder_folders(folder, root)
    return {"gguf": bfl, "vae": folder / "vae", "clip": root / "clip", "t5": root / "t5"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_files(tmp_path_factory.mktemp("gguf-memory"))


def load(files: dict[str, Path], device: str = "cpu", **kw: object) -> Pipeline:
    """The GGUF pipeline of `build_files` in bf16 on `device`."""
    return Pipeline.from_pretrained(
        files["gguf"], device=device, dtype=BF, vae=files["vae"], text_encoder=files["clip"],
        text_encoder_2=files["t5"], **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def resident(files: dict[str, Path]) -> tuple[Pipeline, torch.Tensor]:
    """The GGUF pipeline without a plan and its latents for "a red fox"."""
    pipe = load(files)
    return pipe, pipe("a red fox", **KW).latents


def _plans(fp: Footprint) -> list[Plan]:
    nt, nd = len(fp.text.layers), len(fp.dit.layers)
    big = 1 << 40
    return [
        Plan("offload-text", big, text="offloaded"),
        Plan("swap", big, text="offloaded", dit="offloaded", together=False),
        Plan("stream", big, text="offloaded", dit="streamed", streamed_dit=spread(nd, nd // 2), together=False),
        Plan(
            "stream", big, text="streamed", dit="streamed", streamed_text=spread(nt, nt),
            streamed_dit=spread(nd, nd), together=False,
        ),
        # one slot, an odd number of streamed blocks: the ring wraps around without overlap
        Plan("stream", big, text="offloaded", dit="streamed", streamed_dit=(0, 2, 3), slots=1, together=False),
    ]  # fmt: skip


def test_every_plan_gives_the_resident_bits(
    files: dict[str, Path], resident: tuple[Pipeline, torch.Tensor]
) -> None:
    _, want = resident
    pipe = load(files)
    plans = _plans(footprint(pipe))
    assert len(footprint(pipe).dit.layers) == 4  # the odd-slot plan's positions exist
    for plan in plans:
        apply_plan(pipe, plan, torch.device("cpu"))
        pipe._prompts.clear()
        for _ in range(2):  # the second call: the prompt from the cache, the ring wrapped around
            assert torch.equal(pipe("a red fox", **KW).latents, want), plan.describe()


def _gguf_layers(block: nn.Module, prefix: str) -> dict[str, GgufLinear]:
    return {f"{prefix}.{n}": m for n, m in block.named_modules() if isinstance(m, GgufLinear)}


def _block_names(transformer: nn.Module) -> list[str]:
    names = {id(m): n for n, m in transformer.named_modules()}
    return [names[id(block)] for block in dit_layers(transformer)]


def test_streamed_blocks_hold_the_files_quantized_bytes(files: dict[str, Path]) -> None:
    """Each streamed block's unit holds its projections' GGML blocks (uint8) with the file's byte counts and bytes,
    the unit is smaller than the block dequantized to bf16, and while a block computes its projection reads those
    bytes from a ring slot."""
    src = GgufSource(files["gguf"])
    pipe = load(files)
    t = pipe.transformer
    nd = len(dit_layers(t))
    apply_plan(pipe, Plan("stream", None, text="offloaded", dit="streamed", streamed_dit=spread(nd, nd),
                          together=False), torch.device("cpu"))  # fmt: skip
    model = pipe.placement.models["dit"]
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for i, (prefix, block) in enumerate(zip(_block_names(t), dit_layers(t), strict=True)):
        unit = model.units[i + 1]
        layers = _gguf_layers(block, prefix)
        assert layers, f"{prefix} has no GGUF projection"
        by_owner = {id(mod): e for e in unit.entries for mod, _ in e.owners}
        quantized = dequantized = 0
        for name, layer in layers.items():
            key = f"{name}.weight"
            e = by_owner[id(layer)]
            assert src.is_quantized(key) and e.dtype == torch.uint8
            assert e.nbytes == src.nbytes(key)
            assert torch.equal(unit.host[e.offset : e.offset + e.nbytes], src.raw(key).flatten())
            quantized += e.nbytes
            dequantized += layer.out_features * layer.in_features * 2
            hooks.append(layer.register_forward_pre_hook(partial(_keep, seen, key)))
        rest = unit.nbytes - quantized
        assert unit.nbytes < dequantized + rest
        assert unit.nbytes >= sum(e.nbytes for e in unit.entries)
    pipe("a red fox", **KW)
    for h in hooks:
        h.remove()
    assert seen and all(torch.equal(q.flatten(), src.raw(k).flatten()) for k, q in seen.items())
    # between calls a streamed projection's tensor is a view of a ring slot, not a dequantized copy
    layer = next(iter(_gguf_layers(dit_layers(t)[0], "x").values()))
    slots = {s.untyped_storage().data_ptr() for s in model.ring.slots}
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.untyped_storage().data_ptr() in slots


def _keep(seen: dict[str, torch.Tensor], key: str, module: GgufLinear, args: object) -> None:
    """A forward pre-hook: the blocks `module` reads as it computes, saved under `key` (once)."""
    seen.setdefault(key, module.qweight.clone())


def _bf16_part(transformer: nn.Module) -> Part:
    """The planner's view of the same transformer with every GGUF projection dequantized to bf16: its `part_of`
    sizes with each projection's blocks replaced by its bf16 weight (1 KiB aligned, as units align)."""
    from flux_runtime.pipeline.streaming import part_of

    def grown(module: nn.Module) -> int:
        return sum(
            -_align(m.qweight.nbytes) + _align(m.out_features * m.in_features * 2)
            for m in module.modules()
            if isinstance(m, GgufLinear)
        )

    layers = dit_layers(transformer)
    part = part_of([transformer], layers)
    rest = part.rest + grown(transformer) - sum(grown(layer) for layer in layers)
    return Part(rest, tuple(n + grown(layer) for n, layer in zip(part.layers, layers, strict=True)))


def _align(n: int) -> int:
    return (n + 1023) // 1024 * 1024


def test_plans_are_chosen_on_the_stored_sizes(
    files: dict[str, Path], resident: tuple[Pipeline, torch.Tensor]
) -> None:
    """A budget that holds the GGUF model resident (and the latents are the resident ones) but not the same model in
    bf16, which the planner would have to move; the plan's transformer is the file's stored bytes."""
    ref, want = resident
    fp = footprint(ref)
    src = GgufSource(files["gguf"])
    stored = sum(src.nbytes(k) for k in src.keys() if src.is_quantized(k))
    quantized = sum(_align(m.qweight.nbytes) for m in ref.transformer.modules() if isinstance(m, GgufLinear))
    assert quantized >= stored and quantized - stored < 1024 * sum(
        isinstance(m, GgufLinear) for m in ref.transformer.modules()
    )
    bf16 = replace(fp, dit=_bf16_part(ref.transformer))
    assert bf16.dit.total - fp.dit.total > 2 * stored  # Q4_0 is about a quarter of bf16
    budget = budget_needed(plan_memory(fp, 1 << 40).peak, fp.workspace)
    assert plan_memory(fp, budget).name == "resident"
    assert plan_memory(bf16, budget).name != "resident"
    pipe = load(files, memory=budget)
    assert pipe.memory_plan.name == "resident"
    assert torch.equal(pipe("a red fox", **KW).latents, want)
    # and one that must stream the GGUF blocks: the bf16 blocks do not fit it at all
    lean = fp.vae + fp.dit.rest + 2 * max(fp.dit.layers) + max(fp.act_denoise, fp.act_decode_tiled)
    budget = budget_needed(lean, fp.workspace)
    assert plan_memory(fp, budget).name == "stream"
    with pytest.raises(MemoryBudgetError, match="cannot hold this model"):
        plan_memory(bf16, budget)


def test_the_peak_estimate_counts_the_dequantization(resident: tuple[Pipeline, torch.Tensor]) -> None:
    """The denoising estimate is the blocks' activations plus the largest projection's dequantization, which is at
    least what the torch reference holds when it runs for real on the CPU; on CUDA the kernel's output comes on
    top (its first-use check runs the reference beside it)."""
    pipe, _ = resident
    t = pipe.transformer
    layers = [m for m in t.modules() if isinstance(m, GgufLinear)]
    measured = 0
    for layer in layers:
        with use_fused("off"), torch.inference_mode(), LiveBytes([layer.qweight], device_type="cpu") as live:
            w = layer.weight
            assert w.dtype == BF
            del w
        measured = max(measured, live.peak)
    extra = dequant_bytes(t, kernel=False)
    assert extra >= measured > max(m.out_features * m.in_features * 2 for m in layers)
    fp = footprint(pipe)
    max_len, _ = pipe.planned_tokens(None)
    size = pipe.default_size
    assert fp.act_denoise == denoise_bytes(t.config, BF, size, size, max_len, 1, False) + extra
    largest = max(layers, key=lambda m: m.qweight.numel())
    peak, out = reference_peak(largest.ggml_type.name, tuple(largest.qweight.shape), BF)
    assert out == _round512(largest.out_features * largest.in_features * 2)
    assert dequant_bytes(t, kernel=True) >= peak + out > extra - 1


def _round512(n: int) -> int:
    return (n + 511) // 512 * 512


def test_full_size_projection_dequantization_is_counted() -> None:
    """FLUX.1-dev's largest projection (a single block's linear1, 21504 x 3072) in Q5_0 on meta: the reference holds
    several times the bf16 weight (126 MiB) while it unpacks the codes; that is what the estimate adds."""
    from flux_runtime.kernels.gguf_dequant import BY_NAME

    with torch.device("meta"):
        model = nn.Sequential(
            GgufLinear(3072, 21504, True, BY_NAME["Q5_0"], BF),
            GgufLinear(3072, 3072, True, BY_NAME["Q8_0"], BF),
        )
    weight = 21504 * 3072 * 2
    extra = dequant_bytes(model, kernel=False)
    assert extra > 2 * weight
    assert dequant_bytes(model, kernel=True) == extra + weight


def test_a_lora_on_a_streamed_gguf_model(files: dict[str, Path], tmp_path: Path) -> None:
    """A LoRA fused into a GGUF model whose blocks stream dequantizes the right blocks (the host bytes, not a ring
    slot's) and keeps streaming; unloading gives the streamed GGUF latents back."""
    from tests.lora import lora_fixtures as lf

    ref = load(files)
    base = ref("a red fox", **KW).latents
    shapes = lf.linear_shapes(ref.transformer)
    lora = lf.bfl_file(
        tmp_path / "style.safetensors", shapes, ["double_blocks.1.img_attn.qkv", "single_blocks.1.linear1"]
    )
    ref.load_lora(lora, 0.9)
    want = ref("a red fox", **KW).latents
    assert not torch.equal(want, base)
    pipe = load(files)
    nd = len(dit_layers(pipe.transformer))
    plan = Plan("stream", None, text="offloaded", dit="streamed", streamed_dit=spread(nd, nd), together=False)
    apply_plan(pipe, plan, torch.device("cpu"))
    assert torch.equal(pipe("a red fox", **KW).latents, base)  # the ring's slots now hold the last blocks
    pipe.load_lora(lora, 0.9)
    assert pipe.memory_plan.streams_dit
    assert torch.equal(pipe("a red fox", **KW).latents, want)
    pipe.unload_loras()
    assert torch.equal(pipe("a red fox", **KW).latents, base)
