"""Fused tanh-GELU: exhaustive over all 65,536 inputs of each 16-bit dtype.

On the GPU the kernel calls libdevice's `__nv_tanhf`, the function nvcc links into aten's GELU, and
must be bit-exact for every input. The interpreter emulates `__nv_tanhf` with exact `exp2` and
division in place of `ex2.approx` / `rcp.approx`, so on the CPU a few inputs may differ where
`1 + tanh` cancels (x near -5) or sits on a rounding boundary; the test bounds how many and by how much.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.gelu import (
    all_half_values,
    all_values_difference,
    exhaustive_check,
    gelu_tanh,
    gelu_tanh_reference,
    gelu_tanh_triton,
)
from tests.kernels.helpers import BATCHES, DTYPES, SEQ_LENS, TXT_TOKENS, gpu, interpreter, row_id, same

# the interpreter computes in numpy, which warns on the inf/NaN inputs of the exhaustive sweep
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)

FF_INNER = 12288  # FLUX.1 MLP hidden size (4 x 3072)
# (tokens, FF_INNER): double-block FF (txt or img tokens) and single-block MLP (joint tokens)
GELU_ROWS = [(b * n, FF_INNER) for n in SEQ_LENS for b in BATCHES] + [(3, 1001)]


def assert_exhaustive(
    dtype: torch.dtype, fused: Callable[[Tensor], Tensor], reference: Callable[[Tensor], Tensor],
    self_check: Callable[[Tensor], str | None],
) -> None:  # fmt: skip
    """On the GPU: a unary op's `fused` path equals its `reference` on all 65,536 inputs of `dtype` (NaNs alike),
    and the dispatch's first-use check `self_check` finds the same."""
    x = all_half_values(dtype, "cuda")
    difference = all_values_difference(x, fused(x), reference(x))
    assert difference is None, difference
    assert self_check(x) is None


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_interpreter_exhaustive(dtype: torch.dtype) -> None:
    x = all_half_values(dtype, "cpu")
    out = gelu_tanh_triton(x, block=8192)
    ref = F.gelu(x.float(), approximate="tanh").to(dtype)  # aten's fp32 opmath, one rounding
    bad = ~same(out, ref)
    assert int(bad.sum()) <= 64, f"{int(bad.sum())} inputs differ"
    # where they differ, it is by a few fp32 ulps of tanh (scaled by 0.5 * |x|) plus one output ulp
    xb, ob, rb = x[bad].float(), out[bad].float(), ref[bad].float()
    ulp = torch.finfo(dtype).eps * rb.abs().clamp(min=torch.finfo(dtype).tiny)
    assert bool(((ob - rb).abs() <= xb.abs() * 2**-21 + ulp).all())


@interpreter
def test_gelu_interpreter_any_shape_is_the_elementwise_map() -> None:
    """A 2-D input with a masked last block maps each element exactly as the 1-D sweep does."""
    table = gelu_tanh_triton(all_half_values(torch.bfloat16, "cpu"), block=8192)
    x = (torch.randn(3, 1001) * 3).bfloat16()
    out = gelu_tanh_triton(x, block=1024)
    assert torch.equal(out, table[x.view(torch.int16).long() + 2**15])


@interpreter
def test_gelu_interpreter_strided_input_into_out_slice() -> None:
    """FLUX.1 single block: the MLP columns of the packed linear1 output in, the right columns
    of the (B, L, D + M) `[attn | mlp]` buffer out; the left columns are untouched."""
    table = gelu_tanh_triton(all_half_values(torch.bfloat16, "cpu"), block=8192)
    d, m = 64, 1001
    packed = (torch.randn(2, 3, 3 * d + m) * 3).bfloat16()
    mlp = packed[..., 3 * d :]
    h = torch.full((2, 3, d + m), 7.0, dtype=torch.bfloat16)
    out = gelu_tanh_triton(mlp, h[..., d:], block_l=2, block_n=256)
    assert out.data_ptr() == h[..., d:].data_ptr()
    assert torch.equal(h[..., d:], table[mlp.contiguous().view(torch.int16).long() + 2**15])
    assert bool((h[..., :d] == 7.0).all())
    fresh = gelu_tanh_triton(mlp, block_l=2, block_n=256)  # strided input, new contiguous output
    assert fresh.is_contiguous() and torch.equal(fresh, h[..., d:])


@interpreter
def test_gelu_guards_name_the_problem() -> None:
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="unit last stride"):
        gelu_tanh_triton(x.t())
    with pytest.raises(UnsupportedInput, match="bf16/fp16"):
        gelu_tanh_triton(x.float())
    with pytest.raises(UnsupportedInput, match=r"out must be \(4, 8\)"):
        gelu_tanh_triton(x, torch.empty(4, 9, dtype=torch.bfloat16))
    with pytest.raises(UnsupportedInput, match="overlaps"):
        gelu_tanh_triton(x, x)


def test_gelu_reference_out_is_written_and_returned() -> None:
    x = torch.randn(2, 3, 8).bfloat16()
    h = torch.zeros(2, 3, 10, dtype=torch.bfloat16)
    out = gelu_tanh(x, h[..., 2:])  # tier off: the reference
    assert out.data_ptr() == h[..., 2:].data_ptr()
    assert torch.equal(h[..., 2:], F.gelu(x, approximate="tanh"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_gpu_exhaustive_bit_exact(dtype: torch.dtype) -> None:
    assert_exhaustive(dtype, gelu_tanh_triton, gelu_tanh_reference, exhaustive_check)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GELU_ROWS, ids=row_id)
def test_gelu_gpu_flux_shapes(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    assert torch.equal(gelu_tanh_triton(x), gelu_tanh_reference(x))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [b * n for n in (TXT_TOKENS + 1024, TXT_TOKENS + 4096) for b in BATCHES])
def test_gelu_gpu_single_block_into_out_slice(tokens: int, dtype: torch.dtype) -> None:
    """FLUX.1 single block: packed linear1 columns in, the `[attn | mlp]` buffer's MLP slice out."""
    d = 3072
    packed = (torch.randn(1, tokens, 3 * d + FF_INNER, device="cuda") * 3).to(dtype)
    mlp = packed[..., 3 * d :]
    h = torch.full((1, tokens, d + FF_INNER), float("nan"), device="cuda", dtype=dtype)
    gelu_tanh_triton(mlp, h[..., d:])
    assert torch.equal(h[..., d:], gelu_tanh_reference(mlp))
    assert torch.equal(gelu_tanh_triton(mlp), gelu_tanh_reference(mlp))
