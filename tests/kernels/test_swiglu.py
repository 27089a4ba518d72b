"""Fused SwiGLU over FLUX.2's `[gate | up]` projections, plain or into an `out=` slice.

On the GPU the kernel calls libdevice's `__nv_expf` and an IEEE division, as aten's SiLU functor, and
must be bit-exact for all 65,536 inputs of each dtype and at every FLUX.2 shape. The interpreter
has numpy's `exp` instead, so on the CPU the SiLU may differ from aten's CPU kernel by one ulp; the
rest of the kernel (the two halves, strides, masks, the second rounding, `out=`) is checked exactly
against the kernel's own SiLU table.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels import swiglu
from flux_runtime.kernels.dispatch import (
    UnsupportedInput,
    fused_ops_report,
    reset_fused_ops_report,
    use_fused,
)
from flux_runtime.kernels.gelu import all_half_values
from flux_runtime.kernels.swiglu import silu_exhaustive_check, swiglu_reference, swiglu_triton
from tests.kernels.helpers import BATCHES, DTYPES, TXT_TOKENS, gpu, interpreter, row_id, same, ulp_distance
from tests.kernels.test_gelu import assert_exhaustive

# the interpreter computes in numpy, which warns on the inf/NaN inputs of the exhaustive sweep
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)

# hidden size -> SwiGLU width M (mlp_ratio 3): FLUX.2 [dev], [klein] 4B, [klein] 9B
FLUX2_WIDTHS = {6144: 18432, 3072: 9216, 4096: 12288}
TOKENS = (TXT_TOKENS, 4096, TXT_TOKENS + 4096)  # double-block text / image MLP, single-block joint
# (B, L, D, M): every FLUX.2 MLP site at 1024x1024, batch 1 and 2
FLUX2_SITES = [(b, n, d, m) for d, m in FLUX2_WIDTHS.items() for n in TOKENS for b in BATCHES]


def single_block_mlp(b: int, n: int, d: int, m: int, dtype: torch.dtype, device: str) -> Tensor:
    """`[gate | up]` as the single block sees it: a column slice of the packed (B, L, 3D + 2M) output."""
    packed = (torch.randn(b, n, 3 * d + 2 * m, device=device) * 3).to(dtype)
    return packed[..., 3 * d :]


def silu_table(dtype: torch.dtype) -> Tensor:
    """The kernel's own r(silu(x)) for every 16-bit input, indexed by the bit pattern + 2^15."""
    values = all_half_values(dtype, "cpu")
    return swiglu_triton(torch.cat([values, torch.ones_like(values)]), block_m=8192)


def expected_from_table(x: Tensor, table: Tensor) -> Tensor:
    """r(table[gate] * up): eager's second op on the kernel's SiLU values."""
    m = x.shape[-1] // 2
    gate_bits = x[..., :m].contiguous().view(torch.int16).long() + 2**15
    return (table[gate_bits].float() * x[..., m:].float()).to(x.dtype)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_interpreter_within_one_ulp_of_cpu_aten(dtype: torch.dtype) -> None:
    x = all_half_values(dtype, "cpu")
    table = silu_table(dtype)
    ref = F.silu(x.float()).to(dtype)  # aten's fp32 opmath, one rounding
    bad = ~same(table, ref)
    assert int(bad.sum()) <= 16, f"{int(bad.sum())} inputs differ"
    assert bool((ulp_distance(table[bad], ref[bad]) <= 1).all())


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_interpreter_contiguous_and_packed_views(dtype: torch.dtype) -> None:
    """Double-block input (contiguous (B, L, 2M)) and single-block input (column slice of the packed
    projection); 3 rows and M = 300 leave partial row and column blocks."""
    table = silu_table(dtype)
    x = (torch.randn(2, 3, 600) * 3).to(dtype)
    assert torch.equal(swiglu_triton(x, block_l=2, block_m=128), expected_from_table(x, table))
    x = single_block_mlp(2, 3, 64, 300, dtype, "cpu")
    out = swiglu_triton(x, block_l=2, block_m=128)
    assert out.shape == (2, 3, 300) and out.is_contiguous()
    assert torch.equal(out, expected_from_table(x, table))


@interpreter
def test_swiglu_interpreter_writes_only_the_out_slice() -> None:
    """Into the right column slice of a (B, L, D + M) buffer; the left columns are untouched."""
    table = silu_table(torch.bfloat16)
    d, m = 64, 300
    x = single_block_mlp(2, 3, d, m, torch.bfloat16, "cpu")
    h = torch.full((2, 3, d + m), 7.0, dtype=torch.bfloat16)
    out = swiglu_triton(x, h[..., d:], block_l=2, block_m=128)
    assert out.data_ptr() == h[..., d:].data_ptr()
    assert torch.equal(h[..., d:], expected_from_table(x, table))
    assert bool((h[..., :d] == 7.0).all())


@interpreter
def test_swiglu_interpreter_any_leading_shape() -> None:
    table = silu_table(torch.bfloat16)
    for shape in [(10,), (3, 10), (2, 2, 3, 10)]:
        x = (torch.randn(shape) * 3).bfloat16()
        out = swiglu_triton(x, block_l=2, block_m=4)
        assert out.shape == (*shape[:-1], 5)
        assert torch.equal(out, expected_from_table(x, table)), shape


@interpreter
def test_swiglu_guards_name_the_problem() -> None:
    x = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="even last dim"):
        swiglu_triton(x[..., :7])
    with pytest.raises(UnsupportedInput, match="bf16/fp16"):
        swiglu_triton(x.float())
    with pytest.raises(UnsupportedInput, match="unit last stride"):
        swiglu_triton(x.transpose(0, 2))
    with pytest.raises(UnsupportedInput, match=r"out must be \(2, 3, 4\)"):
        swiglu_triton(x, torch.empty(2, 3, 8, dtype=torch.bfloat16))
    with pytest.raises(UnsupportedInput, match="one dtype"):
        swiglu_triton(x, torch.empty(2, 3, 4, dtype=torch.float16))
    with pytest.raises(UnsupportedInput, match="overlaps"):
        swiglu_triton(x, x[..., 2:6])
    with pytest.raises(UnsupportedInput, match="cannot be merged"):
        swiglu_triton(torch.zeros(4, 3, 2, 8, dtype=torch.bfloat16).transpose(0, 1))
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(x[..., :7])


def test_swiglu_reference_out_is_written_and_returned() -> None:
    x = torch.randn(2, 3, 8).bfloat16()
    h = torch.zeros(2, 3, 10, dtype=torch.bfloat16)
    out = swiglu_reference(x, h[..., 6:])
    assert out.data_ptr() == h[..., 6:].data_ptr()
    assert torch.equal(h[..., 6:], F.silu(x[..., :4]) * x[..., 4:])
    assert torch.equal(swiglu(x, h[..., 6:]), swiglu_reference(x))  # tier off: the reference


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_gpu_exhaustive_bit_exact(dtype: torch.dtype) -> None:
    def silu(x: Tensor) -> Tensor:  # the kernel's SiLU: `[gate | 1]` in one row
        return swiglu_triton(torch.cat([x, torch.ones_like(x)]))

    assert_exhaustive(dtype, silu, F.silu, silu_exhaustive_check)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("site", FLUX2_SITES, ids=row_id)
def test_swiglu_gpu_flux2_shapes(site: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    b, n, d, m = site
    x = (torch.randn(b, n, 2 * m, device="cuda") * 3).to(dtype)  # double block: contiguous
    assert torch.equal(swiglu_triton(x), swiglu_reference(x))
    x = single_block_mlp(b, n, d, m, dtype, "cuda")  # single block: packed linear1 output
    assert torch.equal(swiglu_triton(x), swiglu_reference(x))
    h = torch.full((b, n, d + m), float("nan"), device="cuda", dtype=dtype)
    swiglu_triton(x, h[..., d:])
    assert torch.equal(h[..., d:], swiglu_reference(x))


@gpu
@pytest.mark.gpu
def test_swiglu_runs_fused_and_verified_with_out() -> None:
    b, n, d, m = 1, 64, 3072, 9216
    x = single_block_mlp(b, n, d, m, torch.bfloat16, "cuda")
    h = torch.zeros(b, n, d + m, device="cuda", dtype=torch.bfloat16)
    reset_fused_ops_report(forget_signatures=True)
    with use_fused("lossless"):
        for _ in range(2):
            swiglu(x, h[..., d:])
    report = fused_ops_report()
    assert report.fused_calls == {"swiglu": 2} and not report.mismatches and not report.fallbacks
    assert torch.equal(h[..., d:], swiglu_reference(x))
