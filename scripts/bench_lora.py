#!/usr/bin/env python3
"""LoRA load + fuse time at full size: FLUX.1 [dev] (random bf16 weights) on the GPU, a kohya LoRA on every
block projection (rank 16 ≈ 150 MB, bf16), timed through the pipeline's own `load_lora` path (read, sha256,
convert, fuse), then unload, a switch to a second LoRA, and the same on the model quantized to FP8.
Usage: python3 scripts/bench_lora.py [--rank 16] [--no-fp8]
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

from flux_runtime.models.dit import FLUX1_DEV, Flux1Transformer
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
    args = ap.parse_args()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = Flux1Transformer(FLUX1_DEV)
    model = model.to_empty(device="cuda").requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.02)
    torch.set_default_dtype(torch.float32)
    shapes = {
        n: (m.out_features, m.in_features) for n, m in model.named_modules() if hasattr(m, "in_features")
    }
    mods = lf.blocks("flux1", FLUX1_DEV.depth, FLUX1_DEV.depth_single_blocks)
    tmp = Path(tempfile.mkdtemp())
    a = lf.kohya_file(
        tmp / "a.safetensors", shapes, mods, rank=args.rank, alpha=8.0, dtype=torch.bfloat16, seed=1
    )
    b = lf.kohya_file(
        tmp / "b.safetensors", shapes, mods, rank=args.rank, alpha=8.0, dtype=torch.bfloat16, seed=2
    )
    mb = a.stat().st_size / 2**20
    pipe = SimpleNamespace(transformer=model, text_encoder=None, _graphed={})
    print(
        f"FLUX.1-dev bf16 on {torch.cuda.get_device_name()}; kohya LoRA rank {args.rank}, {mb:.0f} MB, {len(mods)} layers"
    )
    for label in ("bf16", "fp8"):
        if label == "fp8":
            if args.no_fp8:
                break
            quantize_model(model, torch.bfloat16)
        first = timed(lambda: load_lora(pipe, a, 0.8))
        unload = timed(lambda: unload_loras(pipe))
        again = timed(lambda: load_lora(pipe, a, 0.8))
        switch = timed(lambda: (unload_loras(pipe), load_lora(pipe, b, 1.0)))
        unload_loras(pipe)
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(
            f"{label}: load+fuse first {first:.2f} s, again {again:.2f} s; unload {unload:.3f} s; "
            f"switch to another LoRA {switch:.2f} s; peak {peak:.1f} GiB  [target: load+fuse <= 1 s]"
        )


if __name__ == "__main__":
    main()
