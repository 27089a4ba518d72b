"""Merged row-block GEMMs: not a Triton kernel, a different cuBLAS call for the same math.

- `split_linear`: BFL stores q, k, v (and the single block's MLP input) as one weight; diffusers runs
  one GEMM per block. One GEMM over the merged rows has better wave quantisation, and cuBLAS usually
  accumulates each output element in the same order, but that is a heuristic's choice, not a promise.
  So it is a `lossless` kernel like the others: verified `torch.equal` against the per-block GEMMs on
  the first call of each signature, and the per-block GEMMs stay for any signature that differs.

cuBLASLt's GELU_BIAS epilogue (`torch._addmm_activation`) was tried for the `high` tier
and measured slower on the H200 (FLUX.1-dev step 134.5 ms eager against 126.7 ms lossless, 2026-11-29):
cuBLAS picks a slower kernel for the epilogue variant, so it is not mounted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, fused_tier, run_op


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` as aten runs it when `weight` requires grad, whatever its flag here.

    diffusers' parameters require grad (also under `no_grad`); ours do not. The flag changes one thing:
    an input of 3 or more dims that `F.linear` hands to `matmul` (not contiguous, or no bias) and whose
    leading dims cannot be flattened without a copy (a transposed or expanded view) goes through the folded
    route, flattened with a copy into one GEMM and the bias
    added after, instead of a batched GEMM on the view. The two round differently on some CPUs (bf16 and
    fp32 on AVX2), so that case is spelled out; every other input is plain `F.linear`.
    """
    if x.dim() < 3 or (bias is not None and x.is_contiguous()) or _foldable(x):
        return F.linear(x, weight, bias)  # aten's fused path, or a fold that needs no copy: no difference
    out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out.add_(bias)


def _foldable(x: Tensor) -> bool:
    """Whether `x.view(-1, x.shape[-1])` needs no copy (aten's test for folding a batch into the rows)."""
    strides, shape = x.stride(), x.shape
    return all(strides[i] == strides[i + 1] * shape[i + 1] for i in range(x.dim() - 2))


def split_linear_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, sizes: tuple[int, ...]
) -> tuple[Tensor, ...]:
    """One `F.linear` per consecutive row block of `weight` (what diffusers' separate modules compute)."""
    weights = weight.split(sizes, dim=0)
    biases = bias.split(sizes, dim=0) if bias is not None else (None,) * len(sizes)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))


def split_linear_merged(
    x: Tensor, weight: Tensor, bias: Tensor | None, sizes: tuple[int, ...]
) -> tuple[Tensor, ...]:
    """One `F.linear` over all rows; the blocks are column views of its output (unit last stride)."""
    if x.device.type != "cuda":
        raise UnsupportedInput(f"split_linear: the merged GEMM is only verified on CUDA, got {x.device.type}")
    if sum(sizes) != weight.shape[0]:
        raise UnsupportedInput(f"split_linear: sizes {sizes} do not cover {weight.shape[0]} rows")
    return F.linear(x, weight, bias).split(sizes, dim=-1)


_SPLIT_LINEAR = FusedOp("split_linear", fused=split_linear_merged, reference=split_linear_reference)


def split_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, sizes: tuple[int, ...]
) -> tuple[Tensor, ...]:
    """Project `x` through consecutive row blocks of `weight`; merged into one GEMM where verified exact."""
    if fused_tier() == "off":
        return split_linear_reference(x, weight, bias, sizes)
    return run_op(_SPLIT_LINEAR, x, weight, bias, tuple(sizes))
