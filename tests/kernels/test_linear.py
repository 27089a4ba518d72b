"""split_linear: the merged row-block GEMM, lossless where verified bit-identical to per-block GEMMs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flux_runtime.kernels import (
    fused_ops_report,
    reset_fused_ops_report,
    split_linear,
    use_fused,
)
from flux_runtime.kernels.linear import split_linear_merged, split_linear_reference


def _weights(n_in: int, sizes: tuple[int, ...], dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(sum(sizes), n_in, generator=g) / n_in**0.5).to(device=device, dtype=dtype)
    b = torch.randn(sum(sizes), generator=g).to(device=device, dtype=dtype)
    return w, b


@pytest.mark.parametrize("tier", ["off", "lossless", "high"])
def test_split_linear_on_cpu_is_the_per_block_reference(tier):
    sizes = (64, 64, 64, 256)
    w, b = _weights(64, sizes, torch.bfloat16)
    x = torch.randn(2, 9, 64).to(torch.bfloat16)
    reset_fused_ops_report()
    with use_fused(tier):
        got = split_linear(x, w, b, sizes)
    want = [F.linear(x, wi, bi) for wi, bi in zip(w.split(sizes), b.split(sizes), strict=True)]
    assert len(got) == 4 and all(torch.equal(g_, w_) for g_, w_ in zip(got, want, strict=True))
    if tier != "off":
        assert ("split_linear", "inputs on cpu; the kernel runs on cuda") in fused_ops_report().fallbacks


def test_merged_gemm_refuses_the_cpu():
    from flux_runtime.kernels.dispatch import UnsupportedInput

    w, b = _weights(8, (8, 8), torch.bfloat16)
    x = torch.randn(1, 2, 8).to(torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="only verified on CUDA"):
        split_linear_merged(x, w, b, (8, 8))


# FLUX.1 shapes: (tokens, width, row blocks)
GPU_CASES = [
    (4096, 3072, (3072, 3072, 3072)),
    (512, 3072, (3072, 3072, 3072)),
    (4608, 3072, (3072, 3072, 3072)),
    (1024 + 512, 3072, (3072, 3072, 3072)),
    (2 * 4608, 3072, (3072, 3072, 3072)),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "k", "sizes"), GPU_CASES)
def test_merged_gemm_is_bit_identical_on_gpu(m, k, sizes):
    w, b = _weights(k, sizes, torch.bfloat16, "cuda")
    x = torch.randn(1, m, k, device="cuda").to(torch.bfloat16)
    merged = split_linear_merged(x, w, b, sizes)
    ref = split_linear_reference(x, w, b, sizes)
    assert all(torch.equal(a, r) for a, r in zip(merged, ref, strict=True))
