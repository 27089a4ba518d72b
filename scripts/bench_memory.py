#!/usr/bin/env python3
"""Memory plans on one GPU at full size with random weights: peak memory and time per step for each budget.

FLUX.2-dev (32 B transformer + Mistral Small 3.1, both FP8 with `--fp8`, the default here, since two bf16
copies do not fit the host memory the plans page-lock) and FLUX.1-dev (12 B + T5-XXL + CLIP-L, bf16), built
on meta and filled with random weights on the GPU. For each budget, `torch.cuda.set_per_process_memory_fraction`
stands in for a smaller GPU: the pipeline re-plans (`set_memory`), runs one 1024² call of `--steps` steps, and
we print the plan, the peak `torch.cuda.max_memory_allocated`, ms per denoising step and its ratio to the
resident run, and the call's end-to-end time (encode with its weight moves, denoise, decode). The latents of
every plan are checked `torch.equal` to the resident run's. With FP8 text encoders the embeddings' error
against the bf16 encoder is printed (cosine, relative L2; random weights, so only a rough guide).

    python scripts/bench_memory.py                  # both models, ~4 min on an H200
    python scripts/bench_memory.py --model flux1 --steps 4 --json mem.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.models.dit.config import FLUX1_DEV, FLUX2_DEV
from flux_runtime.models.dit.flux1 import Flux1Transformer
from flux_runtime.models.dit.flux2 import Flux2Transformer
from flux_runtime.models.vae.flux1 import FLUX1_VAE, Flux1VAE
from flux_runtime.models.vae.flux2 import FLUX2_VAE, Flux2VAE
from flux_runtime.pipeline.flux1 import Pipeline
from flux_runtime.pipeline.flux2 import Flux2Pipe
from flux_runtime.pipeline.memory import GiB
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

DEV = torch.device("cuda")
BF = torch.bfloat16
PROMPT = "a red fox in the snow, photographed at dawn"
BUDGETS = {"flux2": (None, 80, 48, 24), "flux1": (None, 24, 16)}


@torch.no_grad()
def fill_random(model: nn.Module, seed: int) -> nn.Module:
    """Materialise a meta model on the GPU in bf16 with N(0, 1/fan_in) matrices and unit norms."""
    model.to(BF)
    model.to_empty(device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=gen)
        elif "norm" in name or name.endswith(("scale", "running_var")):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for name, b in model.named_buffers():
        if name.endswith("position_ids"):  # CLIP's (1, 77) arange
            b.copy_(torch.arange(b.shape[-1], device=DEV).expand_as(b))
        elif b.is_floating_point() and "inv_freq" not in name:
            b.fill_(1.0 if "var" in name else 0.0)
    return model.eval()


def _rope_buffers(model: nn.Module) -> None:
    """Rotary `inv_freq` buffers are computed at construction: rebuild them on the GPU (to_empty left garbage)."""
    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "rope_init_fn"):
            inv_freq, _ = m.rope_init_fn(m.config, DEV)
            m.register_buffer("inv_freq", inv_freq, persistent=False)
            m.original_inv_freq = inv_freq


def mistral_text(fp8: bool) -> tuple[Flux2TextEncoder, Any]:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer, template = load_mistral_tokenizer(TINY_TOKENIZERS / "mistral")
    text = dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                hidden_act="silu", rms_norm_eps=1e-5, rope_theta=1e9, max_position_embeddings=131072,
                sliding_window=None, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    vision = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14)  # fmt: skip
    cfg = Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2, projector_hidden_act="gelu", multimodal_projector_bias=False, vision_feature_layer=-1,
    )  # fmt: skip
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(cfg)
    fill_random(model, 3)
    _rope_buffers(model)
    te = Flux2TextEncoder(model, tokenizer, template)
    return te, _quantize_and_compare(te, fp8)


def t5_text(fp8: bool) -> tuple[Flux1TextEncoder, Any]:
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = (
        load_clip_tokenizer(tiny_tokenizer_path("clip")),
        load_t5_tokenizer(tiny_tokenizer_path("t5")),
    )
    with torch.device("meta"):
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                                            num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                                            projection_dim=768))  # fmt: skip
        t5 = T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                     num_heads=64, feed_forward_proj="gated-gelu", is_encoder_decoder=False))  # fmt: skip
    fill_random(clip, 4)
    fill_random(t5, 5)
    te = Flux1TextEncoder(clip, clip_tok, t5, t5_tok)
    return te, _quantize_and_compare(te, fp8)


def _quantize_and_compare(te: Any, fp8: bool) -> Any:
    if not fp8:
        return None
    want = te.encode(PROMPT, max_sequence_length=512, device=DEV)[0]
    te.quantize_fp8()
    torch.cuda.empty_cache()
    return embedding_error(want, te.encode(PROMPT, max_sequence_length=512, device=DEV)[0])


def build(model: str, fp8: bool) -> tuple[Any, Any]:
    t0 = time.perf_counter()
    # the transformer first, quantized before the text encoder is built: a bf16 FLUX.2-dev (64 GB) beside a
    # bf16 Mistral (48 GB) and the quantization's temporaries do not fit one H200
    with torch.device("meta"):
        if model == "flux2":
            dit, vae = Flux2Transformer(FLUX2_DEV), Flux2VAE(FLUX2_VAE)
        else:
            dit, vae = Flux1Transformer(FLUX1_DEV), Flux1VAE(FLUX1_VAE)
    fill_random(dit, 1)
    fill_random(vae, 2)
    if fp8:
        dit.precision = quantize_model(dit, BF)
        torch.cuda.empty_cache()
    text, err = mistral_text(fp8) if model == "flux2" else t5_text(fp8)
    cls: Any = Flux2Pipe if model == "flux2" else Pipeline
    pipe = cls(dit, vae, text, schedule=FLUX2_SCHEDULE if model == "flux2" else _flux1_schedule(),
               model_name=f"{model}-dev (random)")  # fmt: skip
    pipe.fp8_text = fp8
    print(
        f"{model}-dev built (random{', FP8 transformer and text encoder' if fp8 else ', bf16'}): "
        f"{torch.cuda.memory_allocated() / GiB:.1f} GiB in {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    if err is not None:
        print(f"  FP8 text encoder vs bf16 (random weights): cosine {err.cosine:.5f} (min {err.min_cosine:.5f}), "
              f"relative error {err.rel_error:.4f}", flush=True)  # fmt: skip
    return pipe, err


def _flux1_schedule() -> Any:
    from flux_runtime.pipeline.sources import schedule_config

    return schedule_config(None, True)


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

    t0 = time.perf_counter()
    try:
        out = pipe(
            PROMPT, height=1024, width=1024, num_steps=steps, seed=0, output_type="pil", progress=progress
        )
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {
        "budget_gb": budget,
        "plan": plan.describe(),
        "peak_gib": torch.cuda.max_memory_allocated() / GiB,
        "ms_per_step": (marks["denoiseTrue"] - marks["denoiseFalse"]) * 1000 / steps,
        "call_s": time.perf_counter() - t0,
        "latents": out.latents,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["flux1", "flux2", "both"], default="both")
    ap.add_argument("--steps", type=int, default=3, help="denoising steps per run (ms/step is their mean)")
    ap.add_argument(
        "--bf16-flux2", action="store_true", help="FLUX.2-dev in bf16 (needs ~120 GB host memory)"
    )
    ap.add_argument("--fp8-flux1", action="store_true", help="FLUX.1-dev and T5 in FP8")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results: dict[str, Any] = {}
    for model in ("flux2", "flux1") if args.model == "both" else (args.model,):
        fp8 = not args.bf16_flux2 if model == "flux2" else args.fp8_flux1
        pipe, err = build(model, fp8)
        pipe(PROMPT, height=1024, width=1024, num_steps=1, seed=0, output_type="latent")  # warm-up, compiles
        rows, base = [], None
        for budget in BUDGETS[model]:
            try:
                r = run(pipe, budget, args.steps)
            except Exception as e:
                print(f"  {budget} GB: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append({"budget_gb": budget, "error": str(e)})
                continue
            latents = r.pop("latents")
            if base is None:
                base = (r["ms_per_step"], latents)
            r["ratio"] = r["ms_per_step"] / base[0]
            r["bits_equal_resident"] = bool(torch.equal(latents.cpu(), base[1].cpu()))
            rows.append(r)
            name = "resident (no budget)" if budget is None else f"{budget} GB"
            print(
                f"  {name:>20}: peak {r['peak_gib']:5.1f} GiB, {r['ms_per_step']:7.1f} ms/step ({r['ratio']:.2f}x "
                f"resident), call {r['call_s']:5.1f} s, bits equal: {r['bits_equal_resident']} | {r['plan']}",
                flush=True,
            )
        results[model] = {"fp8": fp8, "text_fp8_error": None if err is None else err._asdict(), "runs": rows}
        del pipe
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
