"""The single block's `[attention | activation]` e4m3 producer (per-row scales) against the eager chain.

CPU (interpreter): small heads and widths, SDPA's strided head layout, a column slice of `linear1`'s output,
column blocks narrower than both halves, a zero row; the activation compared through the kernels' own 16-bit
values (the interpreter's tanh/exp may differ from aten's CPU ones by an ulp). GPU: every FLUX.1 / FLUX.2
single-block width at the real sequence lengths, bf16 and fp16, `torch.equal` to
`attention_act_quantize_reference`, and through the dispatch.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels import fp8
from flux_runtime.kernels.dispatch import (
    UnsupportedInput,
    fused_ops_report,
    reset_fused_ops_report,
    use_fused,
)
from flux_runtime.kernels.gelu import gelu_tanh_triton
from flux_runtime.kernels.swiglu import swiglu_triton
from tests.kernels.helpers import (
    DTYPES,
    IMAGE_TOKENS,
    TXT_TOKENS,
    assert_same,
    gpu,
    interpreter,
    row_id,
)

aa = importlib.import_module(
    "flux_runtime.kernels.attention_act_fp8"
)  # the package exports its op by that name

# (D, M, activation) of every single block: FLUX.1, klein 4B, klein 9B, FLUX.2 [dev]
SITES = [(3072, 12288, "gelu_tanh"), (3072, 9216, "swiglu"), (4096, 12288, "swiglu"), (6144, 18432, "swiglu")]


def heads(b: int, n: int, h: int, hd: int, dtype: torch.dtype, device: str) -> Tensor:
    """(B, L, H, Dh) as SDPA hands its output back: (B, H, L, Dh) memory, permuted."""
    return (torch.randn(b, h, n, hd, device=device) * 2).to(dtype).permute(0, 2, 1, 3)


def pre_activation(b: int, n: int, d: int, m: int, act: str, dtype: torch.dtype, device: str) -> Tensor:
    """The MLP part of a `linear1` output (B, L, 3D + K): a column slice with the whole row's stride."""
    k = 2 * m if act == "swiglu" else m
    full = (torch.randn(b, n, 3 * d + k, device=device) * 3).to(dtype)
    return full[..., 3 * d :]


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", aa.ATTENTION_ACTS)
def test_both_halves_share_each_rows_scale(act, dtype):
    o, x = heads(2, 5, 3, 32, dtype, "cpu"), pre_activation(2, 5, 96, 80, act, dtype, "cpu")
    o[1, 2] = 0
    x[1, 2] = 0  # a row of zeros: the smallest amax, a finite scale
    o[0, 1, 0, 3] = 40  # one row whose absmax sits in the attention half
    got = aa.attention_act_quantize_triton(o, x, act, block=64)  # blocks narrower than either half
    assert got.data.shape == (2, 5, 96 + 80) and got.scale.shape == (2, 5, 1)
    value = gelu_tanh_triton(x) if act == "gelu_tanh" else swiglu_triton(x)
    assert_same(got, fp8.quantize_reference(torch.cat([o.flatten(2), value], dim=-1)))


@interpreter
def test_the_reference_is_the_eager_buffer_then_quantize():
    """What the block did before: write both halves into one 16-bit buffer, then quantize it."""
    o, x = (
        heads(1, 4, 2, 32, torch.bfloat16, "cpu"),
        pre_activation(1, 4, 64, 48, "swiglu", torch.bfloat16, "cpu"),
    )
    h = torch.empty(1, 4, 64 + 48, dtype=torch.bfloat16)
    h[..., :64].unflatten(-1, (2, 32)).copy_(o)
    gate, up = x.chunk(2, dim=-1)
    h[..., 64:] = torch.nn.functional.silu(gate) * up
    assert_same(aa.attention_act_quantize_reference(o, x, "swiglu"), fp8.quantize_reference(h))


@interpreter
def test_guards_name_the_problem():
    o, x = (
        heads(1, 4, 2, 32, torch.bfloat16, "cpu"),
        pre_activation(1, 4, 64, 48, "gelu_tanh", torch.bfloat16, "cpu"),
    )
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        aa.attention_act_quantize_triton(o, x, "relu")
    with pytest.raises(UnsupportedInput, match="one dtype"):
        aa.attention_act_quantize_triton(o.half(), x, "gelu_tanh")
    with pytest.raises(UnsupportedInput, match=r"o \(B, L, H, Dh\)"):
        aa.attention_act_quantize_triton(o.flatten(2), x, "gelu_tanh")
    with pytest.raises(UnsupportedInput, match="contiguous"):
        aa.attention_act_quantize_triton(o, x.transpose(1, 2).contiguous().transpose(1, 2), "gelu_tanh")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [TXT_TOKENS + t for t in IMAGE_TOKENS.values()])
@pytest.mark.parametrize("site", SITES, ids=row_id)
def test_gpu_single_block_sites(site, n, dtype):
    d, m, act = site
    o, x = heads(1, n, d // 128, 128, dtype, "cuda"), pre_activation(1, n, d, m, act, dtype, "cuda")
    want = aa.attention_act_quantize_reference(o, x, act)
    assert_same(aa.attention_act_quantize_triton(o, x, act), want)


@gpu
@pytest.mark.gpu
def test_gpu_batch_of_two_and_the_dispatch():
    reset_fused_ops_report(forget_signatures=True)
    o = heads(2, TXT_TOKENS + 4096, 24, 128, torch.bfloat16, "cuda")
    x = pre_activation(2, TXT_TOKENS + 4096, 3072, 12288, "gelu_tanh", torch.bfloat16, "cuda")
    with use_fused("lossless"):
        got = aa.attention_act_fp8(o, x, "gelu_tanh")
    assert_same(got, aa.attention_act_quantize_reference(o, x, "gelu_tanh"))
    report = fused_ops_report()
    assert report.fused_calls.get("attention_act_fp8") == 1
    assert not report.mismatches and not report.fallbacks
