#!/usr/bin/env python3
"""The DiT's joint attention at 1024² on one GPU: bf16 SDPA (cuDNN, what every tier runs today) against the
FP8 flash-attention candidate for `high`, with each one's relative L2 error against a float64 attention.

Shapes (B=1, 4096 image + 512 text tokens, heads of 128): FLUX.1-dev and klein-4B 24 heads, FLUX.2-dev 48.
Several tile configurations of the FP8 kernel are timed; the quantization passes are included in its
time. Never a test: run it on the device, quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.kernels.attention_fp8 import attention_fp8_triton, attention_reference

DEV = torch.device("cuda")
SHAPES = {"flux1-dev / klein-4B": (1, 4608, 24, 128), "flux2-dev": (1, 4608, 48, 128)}
CONFIGS = [
    (128, 128, 8, 3),
    (128, 64, 4, 3),
    (128, 128, 8, 4),
    (128, 64, 8, 3),
    (64, 128, 4, 3),
    (128, 128, 4, 3),
]


def cuda_time(fn, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel(a: torch.Tensor, exact: torch.Tensor) -> float:
    return ((a.double() - exact).norm() / exact.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results = {name: bench_shape(*shape) for name, shape in SHAPES.items()}
    for name, row in results.items():
        print(name, json.dumps(row, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def bench_shape(b: int, n: int, h: int, d: int) -> dict[str, object]:
    gen = torch.Generator(device=DEV).manual_seed(0)
    # q, k as after the QK RMSNorm (unit rms, a few larger channels), v as a projection's output
    q, k, v = (torch.randn(b, n, h, d, device=DEV, generator=gen) for _ in range(3))
    q, k = q * 1.5, k * 1.5
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    exact = F.scaled_dot_product_attention(*(t.double().permute(0, 2, 1, 3) for t in (q, k, v)))
    exact = exact.permute(0, 2, 1, 3)
    ref = attention_reference(q, k, v)
    row: dict[str, object] = {"sdpa_bf16_ms": cuda_time(lambda: attention_reference(q, k, v))}
    row["sdpa_bf16_rel_err"] = rel(ref, exact)
    flops = 4 * b * h * n * n * d
    row["sdpa_tflops"] = flops / row["sdpa_bf16_ms"] / 1e9
    for cfg in CONFIGS:
        key = "fp8_m{}_n{}_w{}_s{}".format(*cfg)
        try:
            out = attention_fp8_triton(q, k, v, *cfg)
            ms = cuda_time(lambda cfg=cfg: attention_fp8_triton(q, k, v, *cfg))
            row[key] = {"ms": ms, "rel_err": rel(out, exact), "vs_sdpa": ms / row["sdpa_bf16_ms"]}
        except Exception as e:  # a config the compiler rejects: say so, try the next
            row[key] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    del exact
    torch.cuda.empty_cache()
    return row


if __name__ == "__main__":
    main()
