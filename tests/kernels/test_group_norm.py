"""The `high` GroupNorm + SiLU kernel: its error against a float64 GroupNorm stays within the eager op's.

Not bit-identical by design (another reduction order; SiLU on the unrounded value), so every test
compares both paths to float64 and bounds the fused one by the reference's own error. GPU tests sweep
the autoencoders' real sites (every width at its resolutions for a 1024² image, NCHW and channels-last,
and the mid-block attention's (B, C, HW) view); the interpreter runs small ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flux_runtime.kernels import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.group_norm import group_norm_silu, group_norm_silu_reference, group_norm_silu_triton
from tests.kernels.helpers import DTYPES, gpu, interpreter

GROUPS, EPS = 32, 1e-6


def inputs(shape, dtype, device, channels_last=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = shape[1]
    # an offset mean and a spread like the decoder's activations
    x = (torch.randn(shape, generator=gen) * 4 + 2).to(device, dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (1 + 0.2 * torch.randn(c, generator=gen)).to(device, dtype)
    b = (0.2 * torch.randn(c, generator=gen)).to(device, dtype)
    return x, w, b


def rel_err(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.double() - exact).norm() / exact.norm()).item()


def exact(x, w, b, silu):
    y = F.group_norm(x.double(), GROUPS, w.double(), b.double(), EPS)
    return F.silu(y) if silu else y


def check(x, w, b, silu):
    out = group_norm_silu_triton(x, w, b, GROUPS, EPS, silu)
    ref = group_norm_silu_reference(x, w, b, GROUPS, EPS, silu)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride() == x.stride()
    e = exact(x, w, b, silu)
    fused, eager = rel_err(out, e), rel_err(ref, e)
    assert fused <= 1.05 * eager, f"fused rel. error {fused:.3g} vs eager {eager:.3g}"
    # and element by element, at most one rounding of the storage dtype away from float64
    ulp = torch.finfo(x.dtype).eps * e.abs().clamp(min=1e-3)
    assert bool(((out.double() - e).abs() <= ulp + 1e-6).all())


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "plain"])
@pytest.mark.parametrize(
    "shape,channels_last",
    [((2, 64, 12, 20), False), ((1, 128, 9, 7), True), ((2, 32, 5, 3), False), ((1, 64, 40), False)],
    ids=["nchw", "channels_last", "narrow", "tokens"],
)
def test_group_norm_interpreter(shape, channels_last, silu, dtype):
    check(*inputs(shape, dtype, "cpu", channels_last), silu)


@interpreter
def test_group_norm_guards():
    x, w, b = inputs((1, 48, 4, 4), torch.bfloat16, "cpu")
    with pytest.raises(UnsupportedInput, match="power-of-two channels"):
        group_norm_silu_triton(x, w, b, 16, EPS, True)
    x, w, b = inputs((1, 64, 4, 4), torch.float32, "cpu")
    with pytest.raises(UnsupportedInput, match="bf16/fp16"):
        group_norm_silu_triton(x, w, b, GROUPS, EPS, True)


# the decoder's sites for a 1024² image: width 512 at 128² and 256², 256 at 512², 128 at 1024²
DECODER_SITES = [(1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 512, 512), (1, 128, 1024, 1024)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [*DECODER_SITES, (2, 512, 64, 96)], ids=str)
def test_group_norm_gpu_sites(shape, channels_last):
    for silu in (True, False):
        check(*inputs(shape, torch.bfloat16, "cuda", channels_last), silu)


@pytest.mark.gpu
@gpu
def test_group_norm_gpu_attention_view():
    x, w, b = inputs((1, 512, 128, 128), torch.bfloat16, "cuda")
    check(x.view(1, 512, 128 * 128), w, b, False)


@pytest.mark.gpu
@gpu
def test_group_norm_dispatch_by_tier():
    """lossless runs the eager op (its bits); high runs the kernel and the report says so."""
    norm = torch.nn.GroupNorm(GROUPS, 256, eps=EPS).to("cuda", torch.bfloat16).requires_grad_(False)
    x, _, _ = inputs((1, 256, 64, 64), torch.bfloat16, "cuda")
    reset_fused_ops_report()
    with use_fused("lossless"):
        assert torch.equal(group_norm_silu(x, norm), F.silu(norm(x)))
    with use_fused("high"):
        out = group_norm_silu(x, norm)
    report = fused_ops_report()
    assert report.fused_calls.get("group_norm_silu") == 1
    assert not torch.equal(out, F.silu(norm(x)))
