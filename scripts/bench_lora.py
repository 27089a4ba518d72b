#!/usr/bin/env python3
"""LoRA load + fuse time at full size: FLUX.1 [dev] or FLUX.3 Image Klein (random bf16 weights) on the GPU, a
LoRA on every block projection (FLUX.1: kohya, rank 16 ≈ 150 MB; FLUX.3: BFL-named `diffusion_model.` keys,
rank 16 ≈ 80 MB; bf16), timed through the pipeline's own `load_lora` path (read, sha256, convert, fuse), then
unload, a switch to a second LoRA, and the same on the model quantized to FP8.
Usage: python3 scripts/bench_lora.py [--model flux1-dev|flux3-klein] [--rank 16] [--no-fp8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.models.dit import FLUX1_DEV, FLUX3_KLEIN, Flux1Transformer, Flux3Transformer
from flux_runtime.pipeline.loras import load_lora, unload_loras
from flux_runtime.weights.fp8 import quantize_model
from tests.lora import lora_fixtures as lf


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--model", choices=("flux1-dev", "flux3-klein"), default="flux1-dev")
    args = ap.parse_args()
    flux3 = args.model == "flux3-klein"
    cfg = FLUX3_KLEIN if flux3 else FLUX1_DEV
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = Flux3Transformer(cfg) if flux3 else Flux1Transformer(cfg)
    model = model.to_empty(device="cuda").requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.02)
    torch.set_default_dtype(torch.float32)
    shapes = {
        n: (m.out_features, m.in_features) for n, m in model.named_modules() if hasattr(m, "in_features")
    }
    tmp = Path(tempfile.mkdtemp())
    if flux3:
        mods = lf.flux3_blocks(cfg.depth, cfg.depth_single_blocks)
        a, b = (
            lf.bfl_file(
                tmp / f"{n}.safetensors", shapes, mods, rank=args.rank, dtype=torch.bfloat16, seed=seed
            )
            for n, seed in (("a", 1), ("b", 2))
        )
    else:
        mods = lf.blocks("flux1", cfg.depth, cfg.depth_single_blocks)
        a, b = (
            lf.kohya_file(
                tmp / f"{n}.safetensors",
                shapes,
                mods,
                rank=args.rank,
                alpha=8.0,
                dtype=torch.bfloat16,
                seed=seed,
            )
            for n, seed in (("a", 1), ("b", 2))
        )
    mb = a.stat().st_size / 2**20
    pipe = SimpleNamespace(transformer=model, text_encoder=None, _graphed={})
    layout = "BFL-named" if flux3 else "kohya"
    print(
        f"{args.model} bf16 on {torch.cuda.get_device_name()}; {layout} LoRA rank {args.rank}, {mb:.0f} MB, "
        f"{len(mods)} layers"
    )
    for label in ("bf16", "fp8"):
        if label == "fp8":
            if args.no_fp8:
                break
            quantize_model(model, torch.bfloat16)
        first = timed(lambda: load_lora(pipe, a, 0.8))
        fp8_layers = pipe._loras.loaded[-1].fp8_layers
        unload = timed(lambda: unload_loras(pipe))
        again = timed(lambda: load_lora(pipe, a, 0.8))
        switch = timed(lambda: (unload_loras(pipe), load_lora(pipe, b, 1.0)))
        unload_loras(pipe)
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(
            f"{label} ({fp8_layers} FP8 layers): load+fuse first {first:.2f} s, again {again:.2f} s; unload {unload:.3f} s; "
            f"switch to another LoRA {switch:.2f} s; peak {peak:.1f} GiB  [target: load+fuse <= 1 s]"
        )


if __name__ == "__main__":
    main()
