"""Our K-quant quantizer (Q6_K ... Q2_K): blocks every reader decodes alike, within the stated error bound."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.kernels import gguf_dequant
from flux_runtime.weights.gguf_kquants import quantize_k
from tests.gguf_fixtures import diffusers_dequantize, gguf

pytest.importorskip("diffusers")

# (codes used, values per sub-block, sub-scale grid, two-sided): Q6_K uses codes -31..31 and Q3_K -3..3, so 62 and
# 6 steps across 2 * max|x|; the two-sided types round their minimum up as well as their scale
KINDS = {
    "Q6_K": (63, 16, 127, False),
    "Q5_K": (32, 32, 63, True),
    "Q4_K": (16, 32, 63, True),
    "Q3_K": (7, 16, 31, False),
    "Q2_K": (4, 16, 15, True),
}


def _weights(seed: int) -> torch.Tensor:
    """Weights as a checkpoint has them (std 0.02), with the blocks that test a quantizer's corners: an
    outlier, all positive, all negative, all zero, tiny values (fp16 subnormal scales), one sign per half."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 1024, generator=gen) * 0.02
    x[0, 5] = 0.9
    x[1, :256] = x[1, :256].abs() + 0.01
    x[2, :256] = -x[2, :256].abs()
    x[3, :256] = 0
    x[4, :256] *= 1e-4
    x[5, :128], x[5, 128:256] = x[5, :128].abs(), -x[5, 128:256].abs()
    return x


def _rel_rms(err: torch.Tensor, x: torch.Tensor) -> float:
    return (err.pow(2).mean().sqrt() / x.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("name", list(KINDS))
def test_blocks_decode_alike_and_within_half_a_step(name):
    """Ours `torch.equal` to diffusers' dequantization, the `gguf` package's (fp32) within fp16 rounding; every
    value within half a step of its super-block's widest sub-block (scales rounded up on their grid)."""
    x = _weights(3)
    raw = quantize_k(x, name)
    qtype = gguf_dequant.BY_NAME[name]
    assert raw.dtype == torch.uint8 and raw.shape == (24, 1024 // 256 * qtype.type_size)
    ours = gguf_dequant.dequantize(raw, qtype)
    assert torch.equal(ours, diffusers_dequantize(raw, name))
    theirs = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]))
    tol = 2 * 2.0**-11 * theirs.abs().amax().item()
    torch.testing.assert_close(ours.float(), theirs, rtol=2e-3, atol=tol)

    err = (ours.float() - x).reshape(-1, 256)
    levels, size, grid, two_sided = KINDS[name]
    sub = x.reshape(-1, 256 // size, size)
    if two_sided:
        span = sub.amax(dim=2).clamp(min=0) - sub.amin(dim=2).clamp(max=0)
    else:
        span = 2 * sub.abs().amax(dim=2)
    step = span.amax(dim=1) / (levels - 1) * (1 + 1 / grid) ** (2 if two_sided else 1)
    # the reader's fp16 product and sum; and scales below fp16's normal range (the 1e-4 block), whose products
    # round to multiples of 2^-24: up to 32 codes times half that
    fp16_slack = 2.0**-10 * x.reshape(-1, 256).abs().amax(dim=1) + 32 * 2.0**-25
    bound = 0.5 * step + fp16_slack
    assert (err.abs().amax(dim=1) <= bound).all()
    assert torch.equal(ours[3, :256], torch.zeros(256, dtype=torch.float16))  # a zero block stays zero


def test_error_is_below_the_legacy_types_of_as_many_bits():
    """Gaussian weights: Q4_K (4.5 bits a value) below Q4_0 (4.5), Q5_K (5.5) below Q5_0 (5.5), Q6_K (6.56) below
    half of Q5_0, the legacy types quantized by the `gguf` package."""
    x = torch.randn(128, 2048, generator=torch.Generator().manual_seed(0)) * 0.02

    def legacy(name: str) -> float:
        t = gguf.GGMLQuantizationType[name]
        back = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), t), t)
        return _rel_rms(torch.from_numpy(back) - x, x)

    def ours(name: str) -> float:
        back = gguf_dequant.dequantize(quantize_k(x, name), gguf_dequant.BY_NAME[name]).float()
        return _rel_rms(back - x, x)

    q4_0, q5_0 = legacy("Q4_0"), legacy("Q5_0")
    assert ours("Q4_K") < q4_0 and ours("Q5_K") < q5_0 and ours("Q6_K") < q5_0 / 2
    # fewer bits, more error: Q3_K (3.44 bits) and Q2_K (2.63) between Q4_0's and 5x it
    assert q4_0 < ours("Q3_K") < ours("Q2_K") < 5 * q4_0


def test_rows_must_hold_whole_super_blocks():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        quantize_k(torch.zeros(2, 320), "Q4_K")
