"""`kernels.linear`: the bits of `F.linear` with a weight that requires grad (diffusers' case) for frozen weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flux_runtime.kernels.linear import linear


def _views(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 64, 384, generator=g).to(dtype)
    return {
        "transposed": base.transpose(1, 2),  # (2, 384, 64), as the packed latents and VAE tokens are
        "expanded": torch.randn(1, 80, 64, generator=g).to(dtype).expand(2, -1, -1),
        "row slice": torch.randn(1, 20, 64, generator=g).to(dtype)[:, 3:10],
        "contiguous": torch.randn(2, 96, 64, generator=g).to(dtype),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@torch.no_grad()
def test_frozen_weights_give_the_bits_of_trainable_ones(dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 64, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if with_bias else None
    trainable_w = w.clone().requires_grad_(True)
    trainable_b = None if b is None else b.clone().requires_grad_(True)
    for name, x in _views(dtype).items():
        want = F.linear(x, trainable_w, trainable_b)
        got = linear(x, w, b)
        assert got.shape == want.shape and torch.equal(got, want), name
