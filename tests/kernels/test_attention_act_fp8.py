"""The single block's `[attention | activation]` e4m3 producer (per-row scales) against the eager chain.

CPU (interpreter): small heads and widths, SDPA's strided head layout, a column slice of `linear1`'s output,
column blocks narrower than both halves, a zero row; the activation compared through the kernels' own 16-bit
values (the interpreter's tanh/exp may differ from aten's CPU ones by an ulp). tanh-GELU's max shortcut: rows
whose largest input decides the absmax and rows that fall back to the GELU sweep (small maxima, all negative,
either side of the threshold), the bound's check on the kernels' GELU and on forged tables, and the shortcut off
against on. GPU: every FLUX.1 / FLUX.2 single-block width at the real sequence lengths, bf16 and fp16,
`torch.equal` to `attention_act_quantize_reference`, the GELU shortcut's rows at FLUX.1's width, and through the
dispatch.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels import fp8, gelu
from flux_runtime.kernels.dispatch import (
    UnsupportedInput,
    fused_ops_report,
    reset_fused_ops_report,
    use_fused,
)
from flux_runtime.kernels.gelu import all_half_values, gelu_tanh_reference, gelu_tanh_triton
from flux_runtime.kernels.swiglu import swiglu_triton
from tests.kernels.helpers import (
    DTYPES,
    IMAGE_TOKENS,
    TXT_TOKENS,
    assert_same,
    bits,
    gelu_rows,
    gpu,
    interpreter,
    pre_activation,
    row_id,
)

aa = importlib.import_module(
    "flux_runtime.kernels.attention_act_fp8"
)  # the package exports its op by that name

# (D, M, activation) of every single block: FLUX.1, klein 4B, klein 9B, FLUX.2 [dev]
SITES = [(3072, 12288, "gelu_tanh"), (3072, 9216, "swiglu"), (4096, 12288, "swiglu"), (6144, 18432, "swiglu")]

# the interpreter computes in numpy, which warns on the inf/NaN inputs of the GELU bound's exhaustive sweep
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)


def heads(b: int, n: int, h: int, hd: int, dtype: torch.dtype, device: str) -> Tensor:
    """(B, L, H, Dh) as SDPA hands its output back: (B, H, L, Dh) memory, permuted."""
    return (torch.randn(b, h, n, hd, device=device) * 2).to(dtype).permute(0, 2, 1, 3)


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
@pytest.mark.parametrize("block", [64, None], ids=["block64", "one-block"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_max_shortcut_rows(dtype, block):
    """Rows through the shortcut and through the fallback sweep, each the reference's codes and scale."""
    o, x = heads(2, 6, 3, 32, dtype, "cpu"), gelu_rows(2, 6, 96, 80, dtype, "cpu")
    o.mul_(2**-8)  # the GELU half decides each row's scale ...
    o[1, 0, 2, 5] = 30  # ... except in one row
    got = aa.attention_act_quantize_triton(o, x, "gelu_tanh", block=block)
    assert_same(got, fp8.quantize_reference(torch.cat([o.flatten(2), gelu_tanh_triton(x)], dim=-1)))


@interpreter
def test_gelu_max_shortcut_is_taken_and_decided_by_the_bound(monkeypatch):
    """A forged bound below every GELU value sends the small-maximum rows through the shortcut too: their
    scales come out smaller (GELU of the maximum, not the negative input's larger |GELU|), the other rows'
    stay the same. So the kernel does take the shortcut, and the rows that must fall back do."""
    dtype = torch.bfloat16
    o, x = heads(1, 6, 3, 32, dtype, "cpu"), gelu_rows(1, 6, 96, 80, dtype, "cpu")
    o.mul_(2**-8)
    want = aa.attention_act_quantize_triton(o, x, "gelu_tanh", block=64)
    monkeypatch.setitem(gelu._GELU_BOUNDS, (torch.device("cpu"), dtype), -1.0)
    forged = aa.attention_act_quantize_triton(o, x, "gelu_tanh", block=64)
    wrong = (forged.scale != want.scale).flatten().tolist()
    assert wrong == [False, True, True, False, True, False]  # the row kinds of `gelu_rows`
    assert bool((forged.scale <= want.scale).all())
    with gelu.gelu_shortcut(False):  # the benchmarks' switch: no shortcut, so the forged bound is not read
        assert_same(aa.attention_act_quantize_triton(o, x, "gelu_tanh", block=64), want)
    assert gelu._SHORTCUT["gelu"] is True  # restored


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_amax_bound_on_the_kernels_gelu(dtype):
    cpu = torch.device("cpu")
    bound = gelu.gelu_amax_bound(dtype, cpu)
    assert bound is not None and 0.16 < bound < 0.18  # tanh-GELU's minimum is about -0.17, at x = -0.75
    # a 16-bit value, so exact as the kernel's fp32 constant
    assert torch.tensor(bound).to(dtype).item() == bound
    values = all_half_values(dtype, cpu)
    g = gelu_tanh_triton(values).float()
    assert bound == g[(values < 0) & values.isfinite()].abs().max().item()
    assert gelu._GELU_BOUNDS[(cpu, dtype)] == bound  # once per (device, dtype)
    assert gelu.monotone_bound(values, gelu_tanh_reference(values)) is not None  # aten's CPU GELU has it too


@interpreter
def test_monotone_bound_rejects_tables_without_the_property():
    values = all_half_values(torch.bfloat16, "cpu")
    table = gelu_tanh_triton(values)
    assert gelu.monotone_bound(values, table) is not None
    dip = table.clone()
    dip[values == 1.5] = 1.25  # GELU(1.5) below GELU of a smaller input: not non-decreasing
    assert gelu.monotone_bound(values, dip) is None
    sign = table.clone()
    sign[values == 2**-20] = -(2**-30)  # negative at a non-negative input
    assert gelu.monotone_bound(values, sign) is None
    nan = table.clone()
    nan[values == -1.0] = float("nan")  # no bound from a NaN at a finite negative input
    assert gelu.monotone_bound(values, nan) is None


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_max_shortcut_off_and_on_agree(dtype):
    """The same codes and scales with the shortcut off (GELU in both sweeps) and on, also on rows the
    reference's NaN-propagating amax would not match: inf, NaN and an all -inf row."""
    o, x = heads(2, 6, 3, 32, dtype, "cpu"), gelu_rows(2, 6, 96, 80, dtype, "cpu")
    o.mul_(2**-8)
    x[0, 0, 7] = float("inf")
    x[0, 1, 9] = float("nan")
    x[0, 2, 11] = float("-inf")
    x[1, 3] = float("-inf")
    x[1, 4, :40] = float("nan")
    on = aa.attention_act_quantize_triton(o, x, "gelu_tanh", block=64)
    off = aa.attention_act_quantize_triton(o, x, "gelu_tanh", block=64, gelu_shortcut=False)
    assert torch.equal(bits(on.data), bits(off.data))
    assert torch.equal(on.scale, off.scale)


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
    assert_same(aa.attention_act_quantize_triton(o, x, act), want)  # tanh-GELU: the max shortcut's path


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_gelu_max_shortcut(dtype):
    """The bound holds for the device's own GELU (so the shortcut is on), and at FLUX.1's widths the rows
    through the shortcut and through the fallback sweep are the reference's, with the shortcut on and off."""
    bound = gelu.gelu_amax_bound(dtype, torch.device("cuda"))
    assert bound is not None and 0.16 < bound < 0.18
    n = TXT_TOKENS + IMAGE_TOKENS["1024x1024"]
    o, x = heads(1, n, 24, 128, dtype, "cuda"), gelu_rows(1, n, 3072, 12288, dtype, "cuda")
    o.mul_(2**-8)
    want = aa.attention_act_quantize_reference(o, x, "gelu_tanh")
    assert_same(aa.attention_act_quantize_triton(o, x, "gelu_tanh"), want)
    assert_same(aa.attention_act_quantize_triton(o, x, "gelu_tanh", gelu_shortcut=False), want)


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
