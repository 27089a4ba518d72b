"""Projection fusions around cuBLAS: merged row-block GEMMs (F8) and the GELU epilogue (F10, option A).

Neither is a Triton kernel: both pick a different cuBLAS call for the same math.

- `split_linear`: BFL stores q, k, v (and the single block's MLP input) as one weight; diffusers runs
  one GEMM per block. One GEMM over the merged rows has better wave quantisation, and cuBLAS usually
  accumulates each output element in the same order, but that is a heuristic's choice, not a promise.
  So it is a `lossless` kernel like the others: verified `torch.equal` against the per-block GEMMs on
  the first call of each signature, and the per-block GEMMs stay for any signature that differs.
- `linear_gelu`: cuBLASLt's GELU_BIAS epilogue applies tanh-GELU to the unrounded `acc + bias` with its
  own GELU, so it is not bit-identical to `F.gelu(F.linear(...))`: `high` tier only. It saves the
  separate pass over the MLP intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, fused_tier, run_op
from flux_runtime.kernels.gelu import gelu_tanh


def split_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None, sizes: tuple[int, ...]) -> tuple[Tensor, ...]:
    """One `F.linear` per consecutive row block of `weight` (what diffusers' separate modules compute)."""
    weights = weight.split(sizes, dim=0)
    biases = bias.split(sizes, dim=0) if bias is not None else (None,) * len(sizes)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))


def split_linear_merged(x: Tensor, weight: Tensor, bias: Tensor | None, sizes: tuple[int, ...]) -> tuple[Tensor, ...]:
    """One `F.linear` over all rows; the blocks are column views of its output (unit last stride)."""
    if x.device.type != "cuda":
        raise UnsupportedInput(f"split_linear: the merged GEMM is only verified on CUDA, got {x.device.type}")
    if sum(sizes) != weight.shape[0]:
        raise UnsupportedInput(f"split_linear: sizes {sizes} do not cover {weight.shape[0]} rows")
    return F.linear(x, weight, bias).split(sizes, dim=-1)


_SPLIT_LINEAR = FusedOp("split_linear", fused=split_linear_merged, reference=split_linear_reference)


def split_linear(x: Tensor, weight: Tensor, bias: Tensor | None, sizes: tuple[int, ...]) -> tuple[Tensor, ...]:
    """Project `x` through consecutive row blocks of `weight`; merged into one GEMM where verified exact."""
    if fused_tier() == "off":
        return split_linear_reference(x, weight, bias, sizes)
    return run_op(_SPLIT_LINEAR, x, weight, bias, tuple(sizes))


def linear_gelu_reference(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
    """`gelu_tanh(F.linear(x, weight, bias))`: the GEMM rounds to the model dtype, then the activation.

    With `out` (e.g. a column slice of a preallocated buffer), the activation is written there.
    """
    return gelu_tanh(F.linear(x, weight, bias), out=out)


def linear_gelu_cublaslt(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
    """GEMM with cuBLASLt's bias + tanh-GELU epilogue (one rounding, after the activation)."""
    if x.device.type != "cuda":
        raise UnsupportedInput(f"linear_gelu: the GELU epilogue needs CUDA, got {x.device.type}")
    if bias is None:
        raise UnsupportedInput("linear_gelu: the GELU_BIAS epilogue needs a bias")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or bias.dtype != x.dtype:
        raise UnsupportedInput(f"linear_gelu: expected bf16/fp16 x, weight, bias; got {x.dtype}, {weight.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    y = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True).view(*x.shape[:-1], weight.shape[0])
    return y if out is None else out.copy_(y)


_LINEAR_GELU = FusedOp("linear_gelu", fused=linear_gelu_cublaslt, reference=linear_gelu_reference, tier="high")


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
    """tanh-GELU of a projection, into `out` if given; the cuBLASLt epilogue runs only in the `high` tier."""
    if fused_tier() != "high":
        return linear_gelu_reference(x, weight, bias, out)
    if out is None:
        return run_op(_LINEAR_GELU, x, weight, bias)
    return run_op(_LINEAR_GELU, x, weight, bias, out)
