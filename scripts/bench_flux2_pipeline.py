#!/usr/bin/env python3
"""FLUX.2-dev end to end on one GPU at full size with random weights: time and peak memory.

The 32 B transformer, the FLUX.2 VAE and a full-size Mistral Small 3.1 (24 B, random, built on meta and
filled on the GPU) in bf16; 1024², guidance 4. Two runs: the text encoder resident, then offloaded to
the CPU after encoding (`offload_text_encoders=True`). Ours only: two copies of FLUX.2-dev do not fit
beside the text encoder, and bench_flux2.py already checks the step against diffusers bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from random_fill import fill_module  # scripts/random_fill.py, beside this file

from flux_runtime.models.dit.config import FLUX2_DEV
from flux_runtime.models.dit.flux2 import Flux2Transformer
from flux_runtime.models.vae.flux2 import FLUX2_VAE, Flux2VAE
from flux_runtime.pipeline.flux2 import Flux2Pipe
from flux_runtime.pipeline.memory_trace import mistral_small_config
from flux_runtime.sampling import FLUX2_SCHEDULE
from flux_runtime.text.chat import load_mistral_tokenizer
from flux_runtime.text.flux2 import Flux2TextEncoder
from flux_runtime.text.tokenizers import TINY_TOKENIZERS

DEV = torch.device("cuda")
BF = torch.bfloat16


@torch.no_grad()
def fill_random(model: nn.Module, seed: int) -> nn.Module:
    """Materialise a meta model on the GPU in bf16 with N(0, 1/fan_in) matrices and unit norms."""
    model.to(BF)  # on meta: allocate bf16 directly, not fp32 first
    # every floating buffer filled, `inv_freq` included (unlike bench_memory.py, which rebuilds them)
    fill_module(model, DEV, torch.Generator(device=DEV).manual_seed(seed), position_buffers=False)
    return model.eval()


def mistral_small_31(tokenizer):
    from transformers import Mistral3ForConditionalGeneration

    cfg = mistral_small_config(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
    )  # fmt: skip
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(cfg)
    return fill_random(model, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    with torch.device("meta"):
        dit, vae = Flux2Transformer(FLUX2_DEV), Flux2VAE(FLUX2_VAE)
    fill_random(dit, 1)
    fill_random(vae, 2)
    tokenizer, template = load_mistral_tokenizer(TINY_TOKENIZERS / "mistral")
    text = Flux2TextEncoder(mistral_small_31(tokenizer), tokenizer, template)
    weights_gib = torch.cuda.memory_allocated() / 2**30
    print(
        f"built FLUX.2-dev + Mistral Small 3.1 (random, bf16): {weights_gib:.1f} GiB in {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    results = {"weights_gib": weights_gib}
    for offload in (False, True):
        pipe = Flux2Pipe(
            dit,
            vae,
            text,
            schedule=FLUX2_SCHEDULE,
            model_name="flux2-dev (random)",
            offload_text_encoders=offload,
        )
        pipe("warm-up", height=1024, width=1024, num_steps=2, seed=0, output_type="latent")
        if offload:
            text.to(DEV)  # start from the resident state; the pipeline moves it off after encoding
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t1 = time.perf_counter()
        out = pipe(
            "a red fox in the snow", height=1024, width=1024, num_steps=args.steps, guidance=4.0, seed=0
        )
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t1) * 1000
        peak = torch.cuda.max_memory_allocated() / 2**30
        key = "text encoder offloaded after encoding" if offload else "text encoder resident"
        results[key] = {"end_to_end_ms": ms, "peak_gib": peak, "kernels": out.info.get("kernels")}
        print(
            f"FLUX.2-dev 1024², {args.steps} steps, {key}: {ms / 1000:.1f} s end to end, peak {peak:.1f} GiB "
            f"(kernels: {out.info.get('kernels')})",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
