"""The torch reference of GGML dequantization: bit-identical to diffusers', close to the `gguf` package's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flux_runtime.kernels import gguf_dequant
from tests.gguf_fixtures import QUANT_NAMES, diffusers_dequantize, encode, gguf, random_blocks

pytest.importorskip("diffusers")


def _blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    if name in ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K"):
        return random_blocks(name, rows, cols, seed, scale=0.05)
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return encode(name, values, seed)


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_dequantize_is_bit_identical_to_diffusers_and_close_to_gguf(name):
    """Every supported type over 2 x 4 super-blocks of values: `torch.equal` to diffusers' fp16 result, and
    within fp16 rounding of the `gguf` package's fp32 dequantization (a second, independent reading)."""
    raw = torch.from_numpy(_blocks(name, 3, 1024, seed=7))
    qtype = gguf_dequant.BY_NAME[name]
    ours = gguf_dequant.dequantize(raw, qtype)
    ref = diffusers_dequantize(raw, name)
    assert ours.dtype == ref.dtype == torch.float16 and ours.shape == (3, 1024)
    assert torch.equal(ours, ref)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ours.to(dtype), ref.to(dtype))
    numpy_ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]))
    # two fp16 roundings at most (a product, then a sum), each half an ulp of the larger term
    tol = 2 * 2.0**-11 * numpy_ref.abs().amax().item()
    torch.testing.assert_close(ours.float(), numpy_ref.float(), rtol=2e-3, atol=tol)


def test_every_bit_pattern_of_a_q4_0_byte_decodes():
    """All 256 code bytes in every position: the nibble order (low nibbles first) is diffusers'."""
    d = np.array([0.5], dtype=np.float16).view(np.uint8)
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    raw = torch.from_numpy(np.concatenate([np.tile(d, (16, 1)), codes], axis=1))
    ours = gguf_dequant.dequantize(raw, gguf_dequant.BY_NAME["Q4_0"])
    assert torch.equal(ours, diffusers_dequantize(raw, "Q4_0"))


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="whole 34-byte blocks"):
        gguf_dequant.dequantize(torch.zeros(2, 35, dtype=torch.uint8), gguf_dequant.BY_NAME["Q8_0"])
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        gguf_dequant.byte_shape(gguf_dequant.BY_NAME["Q4_K"], (4, 64))
