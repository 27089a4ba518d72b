#!/usr/bin/env python3
"""Memory plans on one GPU at full size with random weights: peak memory and time per step for each budget.

FLUX.2-dev (32 B transformer + Mistral Small 3.1, both FP8 with `--fp8`, the default here, since two bf16
copies do not fit the host memory the plans page-lock) and FLUX.1-dev (12 B + T5-XXL + CLIP-L, bf16), built
on meta and filled with random weights on the GPU. For each budget, `torch.cuda.set_per_process_memory_fraction`
stands in for a smaller GPU: the pipeline re-plans (`set_memory`), runs two 1024² calls of `--steps` steps (the second timed), and
we print the plan, the peak `torch.cuda.max_memory_allocated`, ms per denoising step and its ratio to the
resident run, and the call's end-to-end time (encode with its weight moves, denoise, decode). The latents of
every plan are checked `torch.equal` to the resident run's. With FP8 text encoders the embeddings' error
against the bf16 encoder is printed (cosine, relative L2; random weights, so only a rough guide).

FLUX.1-dev is then run by diffusers at the same budgets, with `enable_model_cpu_offload()` and with group
offloading on streams (`diffusers_flux1`; `--no-diffusers` skips it). A failed run prints
`torch.cuda.memory_summary()` to stderr, to show what is still allocated. `--trace-build` runs only the
build on the meta device and prints the GPU memory it would allocate at its peak (no GPU needed).

    python scripts/bench_memory.py --model flux1    # ours at no budget / 24 / 16 GB, then diffusers'
    python scripts/bench_memory.py --model flux2 --json mem.json
    python scripts/bench_memory.py --trace-build    # on any machine: the builds' peaks, counted on meta
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from random_fill import fill_module  # scripts/random_fill.py, beside this file

from flux_runtime.models.dit.config import FLUX1_DEV, FLUX2_DEV
from flux_runtime.models.dit.flux1 import Flux1Transformer
from flux_runtime.models.dit.flux2 import Flux2Transformer
from flux_runtime.models.vae.flux1 import FLUX1_VAE, Flux1VAE
from flux_runtime.models.vae.flux2 import FLUX2_VAE, Flux2VAE
from flux_runtime.pipeline import Pipeline
from flux_runtime.pipeline.flux2 import Flux2Pipe
from flux_runtime.pipeline.memory import GiB
from flux_runtime.pipeline.memory_trace import LiveBytes, clip_l_config, mistral_small_config, t5_xxl_config
from flux_runtime.sampling import FLUX2_SCHEDULE
from flux_runtime.text.chat import load_mistral_tokenizer
from flux_runtime.text.flux1 import Flux1TextEncoder
from flux_runtime.text.flux2 import Flux2TextEncoder
from flux_runtime.text.fp8 import embedding_error
from flux_runtime.text.tokenizers import (
    TINY_TOKENIZERS,
    load_clip_tokenizer,
    load_t5_tokenizer,
    tiny_tokenizer_path,
)
from flux_runtime.weights.fp8 import quantize_model

DEV = torch.device("cuda")  # the meta device under --trace-build
TRACE: LiveBytes | None = None  # --trace-build: the allocations of a build, counted on meta
BF = torch.bfloat16
PROMPT = "a red fox in the snow, photographed at dawn"
BUDGETS = {"flux2": (None, 80, 48, 24), "flux1": (None, 24, 16)}


@contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on meta: no memory anywhere (and none counted by --trace-build)."""
    with torch.device("meta"), TRACE.untracked() if TRACE is not None else nullcontext():
        yield


def _cuda(fn: Callable[[], Any]) -> Any:
    """`fn()` on a CUDA run; nothing when the build is traced on meta."""
    return fn() if DEV.type == "cuda" else None


def fill_random(
    model: nn.Module,
    seed: int,
    blocks: list[nn.Module] = (),
    quantize: Callable[[str, nn.Module], None] | None = None,
) -> nn.Module:
    """Materialise a meta model on the GPU: everything outside `blocks` first, then block by block, each
    block quantized (`quantize(name, block)`) as soon as it is filled. The bf16 bytes on the GPU at once are
    the model outside its blocks plus one block (plus what is already quantized), never the whole model:
    a bf16 FLUX.2-dev is 64 GB, Mistral Small 48 GB."""
    with on_meta():
        model.to(BF)
    gen = torch.Generator(device=DEV).manual_seed(seed) if DEV.type == "cuda" else None
    inside = {id(m) for b in blocks for m in b.modules()}
    names = {id(m): n for n, m in model.named_modules()}
    for m in model.modules():
        if id(m) not in inside:
            fill_module(m, DEV, gen, position_buffers=True, prefix=names[id(m)], recurse=False)
    for block in blocks:
        fill_module(block, DEV, gen, position_buffers=True, prefix=names[id(block)])
        if quantize is not None:
            quantize(names[id(block)], block)
    return model.eval()


def _rope_buffers(model: nn.Module) -> None:
    """Rotary `inv_freq` buffers are computed at construction: rebuild them on the GPU (to_empty left garbage)."""
    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "rope_init_fn"):
            inv_freq, _ = m.rope_init_fn(m.config, DEV)
            m.register_buffer("inv_freq", inv_freq, persistent=False)
            m.original_inv_freq = inv_freq


def mistral_text(fp8: bool) -> tuple[Flux2TextEncoder, Any]:
    from transformers import Mistral3ForConditionalGeneration

    tokenizer, template = load_mistral_tokenizer(TINY_TOKENIZERS / "mistral")
    cfg = mistral_small_config(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
    )  # fmt: skip
    with on_meta():
        model = Mistral3ForConditionalGeneration(cfg)
    fill_random(model, 3)  # bf16 whole (48 GB): the FP8 error needs the bf16 embeddings first
    _rope_buffers(model)
    te = Flux2TextEncoder(model, tokenizer, template)
    return te, _quantize_and_compare(te, fp8)


def t5_text(fp8: bool) -> tuple[Flux1TextEncoder, Any]:
    from transformers import CLIPTextModel, T5EncoderModel

    clip_tok, t5_tok = (
        load_clip_tokenizer(tiny_tokenizer_path("clip")),
        load_t5_tokenizer(tiny_tokenizer_path("t5")),
    )
    with on_meta():
        clip = CLIPTextModel(clip_l_config())
        t5 = T5EncoderModel(t5_xxl_config())
    fill_random(clip, 4)
    fill_random(t5, 5)
    te = Flux1TextEncoder(clip, clip_tok, t5, t5_tok)
    return te, _quantize_and_compare(te, fp8)


def _quantize_and_compare(te: Any, fp8: bool) -> Any:
    if not fp8:
        return None
    want = te.encode(PROMPT, max_sequence_length=512, device=DEV)[0]
    te.quantize_fp8()  # layer by layer
    if DEV.type != "cuda":  # traced: no values to compare
        return None
    torch.cuda.empty_cache()
    return embedding_error(want, te.encode(PROMPT, max_sequence_length=512, device=DEV)[0])


def build(model: str, fp8: bool) -> tuple[Any, Any]:
    """The pipeline with random full-size weights, its GPU memory bounded while it is built.

    The text encoder first, in bf16 whole (the FP8 embeddings' error is measured against it), then
    quantized layer by layer; then the transformer, filled and quantized block by block, so at most one
    bf16 block is on the GPU beside what is already FP8. Counted on meta (`--trace-build`), FLUX.2-dev FP8
    in GiB allocated: Mistral Small bf16 43.5 (peak 44.7), FP8 22.8 (peak 45.1 while quantizing); with the
    transformer 53.6 at the end, peak 56.6 (one block's quantization temporaries). The build that ran out
    of memory on the H200 counted 405 GiB here: `quantize_weight` ran with grad on Parameters, so every
    e4m3 weight carried an autograd graph holding its bf16 weight, its abs and two fp32 copies (now
    `no_grad`). FLUX.1-dev bf16: 31.4 GiB.
    """
    t0 = time.perf_counter()
    text, err = mistral_text(fp8) if model == "flux2" else t5_text(fp8)
    with on_meta():
        if model == "flux2":
            dit, vae = Flux2Transformer(FLUX2_DEV), Flux2VAE(FLUX2_VAE)
        else:
            dit, vae = Flux1Transformer(FLUX1_DEV), Flux1VAE(FLUX1_VAE)
    quantize = (lambda name, block: quantize_model(dit, BF, under=name + ".")) if fp8 else None
    fill_random(dit, 1, [*dit.double_blocks, *dit.single_blocks], quantize)
    if fp8:
        dit.precision = "fp8-dynamic"
    fill_random(vae, 2)
    _cuda(torch.cuda.empty_cache)
    if DEV.type != "cuda":
        return None, None
    cls: Any = Flux2Pipe if model == "flux2" else Pipeline
    pipe = cls(dit, vae, text, schedule=FLUX2_SCHEDULE if model == "flux2" else _flux1_schedule(),
               model_name=f"{model}-dev (random)")  # fmt: skip
    pipe.fp8_text = fp8
    print(
        f"{model}-dev built (random{', FP8 transformer and text encoder' if fp8 else ', bf16'}): "
        f"{torch.cuda.memory_allocated() / GiB:.1f} GiB in {time.perf_counter() - t0:.0f} s, build peak "
        f"{torch.cuda.max_memory_allocated() / GiB:.1f} GiB allocated",
        flush=True,
    )
    if err is not None:
        print(f"  FP8 text encoder vs bf16 (random weights): cosine {err.cosine:.5f} (min {err.min_cosine:.5f}), "
              f"relative error {err.rel_error:.4f}", flush=True)  # fmt: skip
    return pipe, err


def _flux1_schedule() -> Any:
    from flux_runtime.pipeline.sources import schedule_config

    return schedule_config(None, True)


def streamed_bytes(pipe: Any) -> int:
    """The transformer weights a streamed plan copies to the GPU each step (0 for any other plan)."""
    model = pipe.placement.models.get("dit") if pipe.placement is not None else None
    if model is None or model.mode != "streamed":
        return 0
    return sum(model.units[i + 1].nbytes for i in model.streamed)


def host_to_device_gbps(nbytes: int = GiB, repeats: int = 5) -> float:
    """The best of `repeats` copies of `nbytes` from page-locked host memory to the GPU, in GB/s: what a
    streamed plan's per-step copies cannot beat."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del host, dev
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def run(pipe: Any, budget: int | None, steps: int) -> dict[str, Any]:
    """One 1024² call under `budget` GB (None: everything resident, no plan)."""
    total = torch.cuda.get_device_properties(DEV).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0)
    plan = pipe.set_memory(None if budget is None else f"{budget}GB")
    pipe._prompts.clear()  # every run encodes (and moves the text encoder as its plan says)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if budget is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget * GiB / total))
    torch.cuda.reset_peak_memory_stats()
    marks: dict[str, float] = {}

    def progress(stage: str, done: int, n: int) -> None:
        if stage == "denoise" and done in (0, n):
            torch.cuda.synchronize()
            marks[f"denoise{done == n}"] = time.perf_counter()

    def call() -> Any:
        return pipe(
            PROMPT, height=1024, width=1024, num_steps=steps, seed=0, output_type="pil", progress=progress
        )

    try:
        # a first call warms the plan up (a resident plan's first steps run eagerly, then capture the CUDA
        # graph: `set_memory` drops graphs, their weight addresses change); the second one is timed
        call()
        torch.cuda.synchronize()
        pipe._prompts.clear()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {
        "budget_gb": budget,
        "plan": plan.describe(),
        "peak_gib": torch.cuda.max_memory_allocated() / GiB,
        "ms_per_step": (marks["denoiseTrue"] - marks["denoiseFalse"]) * 1000 / steps,
        "call_s": time.perf_counter() - t0,
        "streamed_gb_per_step": streamed_bytes(pipe) / 1e9,
        "latents": out.latents,
    }


def diffusers_flux1(
    budgets: tuple[int | None, ...], steps: int, resident_ms: float | None
) -> list[dict[str, Any]]:
    """diffusers' own offloading on FLUX.1-dev at the same budgets (random weights of the same sizes, bf16):
    `enable_model_cpu_offload()` (whole models moved per stage), then group offloading with streams
    (`enable_group_offload(block_level, 1 block per group, use_stream=True)` on the transformer and T5,
    CLIP and the VAE on the GPU). Each run: 1024², `steps` steps; peak, ms/step (vs our resident run),
    call time; an out-of-memory is recorded as such."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from diffusers.hooks import apply_group_offloading

    te, _ = t5_text(False)
    with on_meta():
        dit = FluxTransformer2DModel(guidance_embeds=True)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
            latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
            shift_factor=0.1159,
        )  # fmt: skip
    fill_random(dit, 11, [*dit.transformer_blocks, *dit.single_transformer_blocks])
    fill_random(vae, 12)
    sched = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )  # fmt: skip
    dp = FluxPipeline(scheduler=sched, vae=vae, text_encoder=te.clip, tokenizer=te.clip_tokenizer,
                      text_encoder_2=te.t5, tokenizer_2=te.t5_tokenizer, transformer=dit)  # fmt: skip
    for m in (dit, vae, te.clip, te.t5):
        m.to("cpu")
    torch.cuda.empty_cache()
    rows: list[dict[str, Any]] = []

    def one(mode: str, budget: int | None) -> None:
        total = torch.cuda.get_device_properties(DEV).total_memory
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if budget is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget * GiB / total))
        torch.cuda.reset_peak_memory_stats()
        marks: list[float] = []

        def on_step(p: Any, i: int, t: Any, kw: dict) -> dict:
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
            return kw

        row: dict[str, Any] = {"diffusers": mode, "budget_gb": budget}
        t0 = time.perf_counter()
        try:
            dp(PROMPT, height=1024, width=1024, num_inference_steps=steps + 1, guidance_scale=3.5,
               generator=torch.Generator("cpu").manual_seed(0), output_type="pil", callback_on_step_end=on_step)  # fmt: skip
            torch.cuda.synchronize()
            row["ms_per_step"] = (marks[-1] - marks[0]) * 1000 / (len(marks) - 1)  # the first step warms up
            row["call_s"] = time.perf_counter() - t0
            row["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
            if resident_ms:
                row["ratio"] = row["ms_per_step"] / resident_ms
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e)[:200]}"
            print(torch.cuda.memory_summary(abbreviated=True), file=sys.stderr, flush=True)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        rows.append(row)
        name = "no budget" if budget is None else f"{budget} GB"
        if "error" in row:
            print(f"  diffusers {mode:>22} {name:>10}: FAILED: {row['error']}", flush=True)
        else:
            print(
                f"  diffusers {mode:>22} {name:>10}: peak {row['peak_gib']:5.1f} GiB, {row['ms_per_step']:7.1f} ms/step"
                f" ({row.get('ratio', float('nan')):.2f}x our resident), call {row['call_s']:5.1f} s",
                flush=True,
            )

    dp.enable_model_cpu_offload()
    for budget in budgets:
        one("enable_model_cpu_offload", budget)
    dp.remove_all_hooks()
    for m in (dit, vae, te.clip, te.t5):
        m.to("cpu")
    dit.enable_group_offload(DEV, torch.device("cpu"), "block_level", num_blocks_per_group=1, use_stream=True)
    apply_group_offloading(
        te.t5, DEV, torch.device("cpu"), "block_level", num_blocks_per_group=1, use_stream=True
    )
    te.clip.to(DEV)
    vae.to(DEV)
    for budget in budgets:
        one("group offload + streams", budget)
    return rows


def trace_build(model: str, fp8: bool) -> None:
    """Run `build` on the meta device under `LiveBytes`: the GPU memory it would allocate, at its peak."""
    global DEV, TRACE
    import transformers.masking_utils as masking

    import flux_runtime.text.fp8 as text_fp8
    import flux_runtime.weights.fp8 as weights_fp8

    DEV, TRACE = torch.device("meta"), LiveBytes()
    # meta runs no GEMM, and transformers' test of an all-ones padding mask needs values: both assumed
    text_fp8.check_fp8_gemm = weights_fp8.check_fp8_gemm = lambda device: None  # type: ignore[assignment]
    masking._ignore_causal_mask_sdpa = lambda *a, **k: False  # type: ignore[assignment]
    with TRACE:
        build(model, fp8)
    print(
        f"{model}-dev build{' (FP8)' if fp8 else ' (bf16)'} traced on meta: peak {TRACE.peak / GiB:.1f} GiB "
        f"allocated (at {TRACE.peak_op}), {TRACE.live / GiB:.1f} GiB at the end",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["flux1", "flux2", "both"], default="both")
    ap.add_argument(
        "--steps",
        type=int,
        default=4,
        help="denoising steps per call (ms/step: their mean in the second of two calls)",
    )
    ap.add_argument(
        "--bf16-flux2", action="store_true", help="FLUX.2-dev in bf16 (needs ~120 GB host memory)"
    )
    ap.add_argument("--fp8-flux1", action="store_true", help="FLUX.1-dev and T5 in FP8")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--no-diffusers",
        action="store_true",
        help="skip diffusers' offloading on FLUX.1-dev at the same budgets",
    )
    ap.add_argument(
        "--trace-build", action="store_true", help="only count the build's GPU allocations on meta (no GPU)"
    )
    args = ap.parse_args()
    if args.trace_build:
        for model in ("flux2", "flux1") if args.model == "both" else (args.model,):
            trace_build(model, not args.bf16_flux2 if model == "flux2" else args.fp8_flux1)
        return 0
    results: dict[str, Any] = {}
    for model in ("flux2", "flux1") if args.model == "both" else (args.model,):
        fp8 = not args.bf16_flux2 if model == "flux2" else args.fp8_flux1
        try:
            pipe, err = build(model, fp8)
        except Exception:
            print(torch.cuda.memory_summary(abbreviated=True), file=sys.stderr, flush=True)
            raise
        pipe(PROMPT, height=1024, width=1024, num_steps=1, seed=0, output_type="latent")  # warm-up, compiles
        gbps = host_to_device_gbps()
        print(f"  page-locked host -> GPU copies: {gbps:.1f} GB/s (best of 5, 1 GiB)", flush=True)
        rows, base = [], None
        for budget in BUDGETS[model]:
            try:
                r = run(pipe, budget, args.steps)
            except Exception as e:
                print(f"  {budget} GB: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append({"budget_gb": budget, "error": str(e)})
                r = None
            if r is None:
                # what is left allocated once the error (and any frames it held) is gone: the plan's error
                # handling should leave only the resident weights
                gc.collect()
                left = torch.cuda.memory_allocated() / GiB
                print(f"  after the failure: {left:.2f} GiB allocated (memory_summary on stderr)", flush=True)
                rows[-1]["allocated_after_gib"] = left
                print(torch.cuda.memory_summary(abbreviated=True), file=sys.stderr, flush=True)
                continue
            latents = r.pop("latents")
            if base is None:
                base = (r["ms_per_step"], latents)
            r["ratio"] = r["ms_per_step"] / base[0]
            r["bits_equal_resident"] = bool(torch.equal(latents.cpu(), base[1].cpu()))
            # a streamed step is at least its copies: bytes over the measured bus bandwidth
            r["copy_floor_ms"] = r["streamed_gb_per_step"] / gbps * 1000
            rows.append(r)
            name = "resident (no budget)" if budget is None else f"{budget} GB"
            copies = (
                f", copies {r['streamed_gb_per_step']:.1f} GB/step (floor {r['copy_floor_ms']:.0f} ms)"
                if r["streamed_gb_per_step"] else ""
            )  # fmt: skip
            print(
                f"  {name:>20}: peak {r['peak_gib']:5.1f} GiB, {r['ms_per_step']:7.1f} ms/step ({r['ratio']:.2f}x "
                f"resident{copies}), call {r['call_s']:5.1f} s, bits equal: {r['bits_equal_resident']} | {r['plan']}",
                flush=True,
            )
        results[model] = {
            "fp8": fp8, "text_fp8_error": None if err is None else err._asdict(), "runs": rows,
            "host_to_device_gbps": gbps,
        }  # fmt: skip
        del pipe
        torch.cuda.empty_cache()
        if model == "flux1" and not args.no_diffusers:
            try:
                results[model]["diffusers"] = diffusers_flux1(BUDGETS[model], args.steps, base and base[0])
            except Exception as e:  # the comparison must not lose the runs above
                print(f"  diffusers comparison FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                print(torch.cuda.memory_summary(abbreviated=True), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
