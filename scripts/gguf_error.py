#!/usr/bin/env python3
"""The weight error of each GGUF type `flux-convert gguf` writes, on Gaussian weights (256 x 3072, std 0.02,
bf16 values): the `gguf` package's quantizer for the legacy types, ours (`weights.gguf_kquants`) for the K-quants,
both read back through our dequantization. Prints the relative RMS error per type.
Usage: python3 scripts/gguf_error.py (CPU, seconds; needs the gguf extra)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.kernels import gguf_dequant
from flux_runtime.weights.gguf_kquants import quantize_k

TYPES = ("Q8_0", "Q6_K", "Q5_1", "Q5_K", "Q5_0", "Q4_1", "Q4_K", "Q4_0", "Q3_K", "Q2_K")


def main() -> None:
    import gguf

    torch.manual_seed(0)
    w = (torch.randn(256, 3072) * 0.02).to(torch.bfloat16).float()
    print("| type | relative RMS error |\n|---|---|")
    for name in TYPES:
        if name.endswith("_K"):
            raw = quantize_k(w, name)
        else:
            raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[name]))
        raw = raw.view(torch.uint8).reshape(w.shape[0], -1)
        back = gguf_dequant.dequantize(raw, gguf_dequant.BY_NAME[name]).float()
        rel = (back - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
        print(f"| {name} | {rel.item():.4f} |")


if __name__ == "__main__":
    main()
