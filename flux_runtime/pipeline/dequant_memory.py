"""What a GGUF transformer's dequantization adds to the denoising activations, for the memory planner.

A `GgufLinear` keeps its weight as GGML blocks (uint8) and dequantizes it just before each GEMM: while the
projection runs, a whole weight in the compute dtype exists beside the block's activations, and while it is being
made, the torch reference's intermediates too (bit unpacking, fp16 codes and scales, the fp16 weight before the
cast): 2 to 5 times the weight's compute-dtype bytes, by type. The planner's `denoise_activations` counts the
blocks' activations only, so the worst of these, over the model's GGUF projections, is added to it.

The reference path is measured, not modelled: it runs on the meta device under `memory_trace.LiveBytes`, which
counts every tensor it allocates as the CUDA caching allocator would (so the number follows the code). The fused
Triton kernel allocates only its output, the weight in the compute dtype; but its first call for each weight shape
runs the reference beside it to check the bits (`kernels.dispatch`), so where the kernel may run (CUDA) the
estimate is that output plus the reference's peak. Everything here is a CPU measurement of allocation sizes; no
GPU peak has been measured against it.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from flux_runtime.kernels.gguf_dequant import BY_NAME
from flux_runtime.kernels.gguf_dequant_triton import dequantize_reference
from flux_runtime.models.dit.layers import GgufLinear
from flux_runtime.pipeline.memory_trace import LiveBytes


def dequant_bytes(model: nn.Module, *, kernel: bool) -> int:
    """The most bytes one GGUF projection of `model` holds while its weight is dequantized (0 with none).

    `kernel`: whether the fused kernel may run (on CUDA), which adds its output beside the reference's peak
    during its first-use check (see the module docstring)."""
    seen = {
        (m.ggml_type.name, tuple(m.qweight.shape), m.out_dtype)
        for m in model.modules()
        if isinstance(m, GgufLinear)
    }
    worst = 0
    for name, shape, dtype in seen:
        peak, out = reference_peak(name, shape, dtype)
        worst = max(worst, peak + (out if kernel else 0))
    return worst


@cache
def reference_peak(ggml_type: str, byte_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """(peak bytes live during the reference dequantization of blocks of `byte_shape`, bytes of its output): both
    rounded as the allocator rounds, measured on the meta device (no memory is used)."""
    raw = torch.empty(byte_shape, dtype=torch.uint8, device="meta")
    with torch.inference_mode(), LiveBytes([raw]) as live:
        out = dequantize_reference(raw, BY_NAME[ggml_type], dtype)
        held = live.live  # the intermediates are gone: what is left is the output
    del out
    return live.peak, held
