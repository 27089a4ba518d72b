"""split_linear (merged row-block GEMM, lossless when verified) and linear_gelu (cuBLASLt epilogue, high)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flux_runtime.kernels import (
    fused_ops_report,
    linear_gelu,
    reset_fused_ops_report,
    split_linear,
    use_fused,
)
from flux_runtime.kernels.gelu import gelu_tanh_reference
from flux_runtime.kernels.linear import linear_gelu_cublaslt, split_linear_merged, split_linear_reference


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


def test_linear_gelu_reference_outside_high_tier():
    w, b = _weights(32, (96,), torch.float32)
    x = torch.randn(3, 5, 32)
    for tier in ("off", "lossless"):
        with use_fused(tier):
            assert torch.equal(linear_gelu(x, w, b), gelu_tanh_reference(F.linear(x, w, b)))


def test_merged_and_epilogue_refuse_the_cpu():
    from flux_runtime.kernels.dispatch import UnsupportedInput

    w, b = _weights(8, (8, 8), torch.bfloat16)
    x = torch.randn(1, 2, 8).to(torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="only verified on CUDA"):
        split_linear_merged(x, w, b, (8, 8))
    with pytest.raises(UnsupportedInput, match="needs CUDA"):
        linear_gelu_cublaslt(x, w, b)


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


@pytest.mark.gpu
def test_gelu_epilogue_error_is_small_against_float64():
    w, b = _weights(3072, (12288,), torch.bfloat16, "cuda")
    x = torch.randn(1, 4096, 3072, device="cuda").to(torch.bfloat16)
    fused = linear_gelu_cublaslt(x, w, b).double()
    eager = gelu_tanh_reference(F.linear(x, w, b)).double()
    exact = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
    err = lambda y: ((y - exact).norm() / exact.norm()).item()  # noqa: E731
    # the epilogue skips one bf16 rounding, so it should be no worse than eager
    assert err(fused) <= 1.5 * err(eager) and err(fused) < 1e-2
