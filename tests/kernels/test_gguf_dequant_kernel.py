"""The fused GGUF dequantization kernel: `torch.equal` to the torch reference then the cast, for every type and
output dtype, at FLUX's projection widths, with special fp16 scales; its guards, dispatch and `GgufLinear`.

On the CPU the kernel runs under the Triton interpreter on a few rows of each real width (a row's block count
is what the indexing depends on); the GPU tests run the compiled kernel at the full projection shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import Tensor

from flux_runtime.kernels import dispatch, gguf_dequant, gguf_dequant_triton
from flux_runtime.kernels.dispatch import (
    UnsupportedInput,
    fused_ops_report,
    reset_fused_ops_report,
    use_fused,
)
from flux_runtime.kernels.gguf_dequant_triton import (
    HALF_FIELDS,
    LAYOUT,
    OUT_DTYPES,
    dequantize_as,
    dequantize_reference,
    dequantize_triton,
    probe_blocks,
    special_values_check,
)
from flux_runtime.models.dit.layers import GgufLinear
from tests.gguf_fixtures import _K_SCALES, QUANT_NAMES, encode, random_blocks
from tests.kernels.helpers import gpu, interpreter, row_id, same

# the interpreter computes in numpy, which warns on the inf/NaN scales of the special-value blocks
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)

# FLUX.1-dev's projections (out, in): attention, qkv, MLP in/out, single blocks' linear1/linear2, modulation
FLUX1_SHAPES = [(3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (21504, 3072), (3072, 15360)]
FLUX1_SHAPES += [(18432, 3072)]
WIDTHS = sorted({cols for _, cols in FLUX1_SHAPES} | {6144})  # FLUX.2-dev's hidden width too
# the other input widths of FLUX.2's projections: klein 4B's MLP down (9216), klein 9B's hidden, MLP down and
# linear2 (4096, 12288, 16384), dev's MLP down and linear2 (18432, 24576)
FLUX2_WIDTHS = (4096, 9216, 16384, 18432, 24576)
# FLUX.2-dev's largest projections: the single blocks' linear1 (q, k, v and the SwiGLU pair) and linear2
FLUX2_DEV_SHAPES = [(55296, 6144), (6144, 24576)]
CPU_REASON = "inputs on cpu; the kernel runs on cuda"


@pytest.fixture(autouse=True)
def fresh_record() -> Iterator[None]:
    reset_fused_ops_report(forget_signatures=True)
    yield
    reset_fused_ops_report(forget_signatures=True)


def blocks(name: str, rows: int, cols: int, seed: int = 0) -> Tensor:
    """(rows, bytes) uint8 blocks of `name`: quantized normal values (32-value types) or random K-quant blocks
    with weight-sized scales, as the GGUF tests build them."""
    if name.endswith("_K"):
        data = random_blocks(name, rows, cols, seed, scale=0.05)
    else:
        values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
        data = encode(name, values, seed)
    return torch.from_numpy(np.ascontiguousarray(data))


def assert_matches(raw: Tensor, qtype: gguf_dequant.GgmlType, dtype: torch.dtype, **kw: int) -> Tensor:
    """The kernel's output is the reference's (`torch.equal`, or NaN where it is NaN); returns it."""
    out = dequantize_triton(raw, qtype, dtype, **kw)
    ref = dequantize_reference(raw, qtype, dtype)
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype and out.is_contiguous()
    if bool(ref.isnan().any()):
        bad = ~same(out, ref)
        assert not bool(bad.any()), f"{int(bad.sum())} of {ref.numel()} values differ"
    else:
        assert torch.equal(out, ref)
    return out


@interpreter
@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("name", QUANT_NAMES)
def test_every_type_and_dtype_at_flux_widths(name: str, cols: int) -> None:
    """A few rows of each real width: the programs' blocks straddle rows as they do at full size."""
    qtype = gguf_dequant.BY_NAME[name]
    raw = blocks(name, 3 if cols < 12288 else 2, cols, seed=cols)
    for dtype in OUT_DTYPES:
        assert_matches(raw, qtype, dtype)


@interpreter
@pytest.mark.parametrize("name", QUANT_NAMES)
def test_every_type_at_flux2_widths(name: str) -> None:
    """One row of each of FLUX.2's other widths, bf16 (the dtype FLUX.2 runs in)."""
    qtype = gguf_dequant.BY_NAME[name]
    for cols in FLUX2_WIDTHS:
        assert_matches(blocks(name, 1, cols, seed=cols), qtype, torch.bfloat16)


@interpreter
@pytest.mark.parametrize("name", QUANT_NAMES)
def test_special_fp16_scales(name: str) -> None:
    """Zero, -0, subnormal, largest/smallest, negative, infinite and NaN scales and minima, each meeting the
    others: the reference's zeros keep their sign, its infinities and NaNs land in the same places."""
    qtype = gguf_dequant.BY_NAME[name]
    raw = probe_blocks(qtype, 48, "cpu", seed=3).reshape(2, -1)
    for dtype in OUT_DTYPES:
        out = assert_matches(raw, qtype, dtype)
        ref = dequantize_reference(raw, qtype, dtype)
        finite = ref.isfinite()
        assert torch.equal(out[finite].view(torch.uint8), ref[finite].view(torch.uint8))  # -0.0 vs 0.0 too
        assert bool(ref.isinf().any()) and bool(ref.isnan().any()) and bool((ref == 0).any())
    assert special_values_check(raw, qtype, torch.bfloat16) is None


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_half_fields_are_the_blocks_scales(name: str) -> None:
    """Every listed fp16 field reaches every value of its block: a NaN there makes the reference's whole block
    NaN (so the special values are put where the scales are); the K-quants' agree with the fixtures' table."""
    qtype = gguf_dequant.BY_NAME[name]
    if name in _K_SCALES:
        assert HALF_FIELDS[name] == _K_SCALES[name]
    nan = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    for off in HALF_FIELDS[name]:
        raw = blocks(name, 1, qtype.block, seed=1)
        raw[0, off : off + 2] = nan
        assert bool(gguf_dequant.dequantize(raw, qtype).isnan().all())
    assert set(LAYOUT) == set(HALF_FIELDS) == {t.name for t in gguf_dequant.QUANT_TYPES.values()}


@interpreter
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q5_0", "Q3_K", "Q6_K"])
def test_odd_row_counts_and_leading_dims(name: str) -> None:
    """1 and 5 rows, one row as a 1-D tensor, a 3-D stack, and programs of one, a few (the last one partial) or
    more than two rows' blocks."""
    qtype = gguf_dequant.BY_NAME[name]
    for rows, per in [(1, None), (5, 8), (2, 256)]:  # 256: more than two rows' blocks in one program
        raw = blocks(name, rows, 3072, seed=rows)
        assert_matches(raw, qtype, torch.bfloat16, **({} if per is None else {"blocks": per}))
    assert_matches(blocks(name, 3, 2 * qtype.block, seed=3), qtype, torch.bfloat16, blocks=1)
    raw = blocks(name, 6, 3072, seed=6)
    assert assert_matches(raw[0], qtype, torch.float16).shape == (3072,)
    assert assert_matches(raw.reshape(2, 3, -1), qtype, torch.float32).shape == (2, 3, 3072)


@interpreter
def test_guards_name_the_problem() -> None:
    q8 = gguf_dequant.BY_NAME["Q8_0"]
    raw = blocks("Q8_0", 4, 64)
    with pytest.raises(UnsupportedInput, match="uint8 rows of whole 34-byte blocks"):
        dequantize_triton(raw[:, :-1].contiguous(), q8, torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="uint8 rows"):
        dequantize_triton(raw.view(torch.int8), q8, torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="contiguous"):
        dequantize_triton(torch.cat([raw, raw], dim=1)[:, :68], q8, torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="output dtype"):
        dequantize_triton(raw, q8, torch.float64)
    with pytest.raises(UnsupportedInput, match="empty"):
        dequantize_triton(raw[:0], q8, torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="no kernel for GGML type F16"):
        dequantize_triton(raw, gguf_dequant.BY_NAME["F16"], torch.bfloat16)


def test_off_and_cpu_run_the_reference_with_the_reason_recorded() -> None:
    qtype = gguf_dequant.BY_NAME["Q4_K"]
    raw = blocks("Q4_K", 2, 512)
    expected = gguf_dequant.dequantize(raw, qtype).to(torch.bfloat16)
    assert torch.equal(dequantize_as(raw, qtype, torch.bfloat16), expected)
    assert fused_ops_report().fallbacks == {}  # tier off: nothing recorded
    with use_fused("lossless"):
        assert torch.equal(dequantize_as(raw, qtype, torch.bfloat16), expected)
    assert fused_ops_report().fallbacks == {("gguf_dequant", CPU_REASON): 1}


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatched op allowed on CPU tensors, so the interpreter runs it through the gate."""
    op = gguf_dequant_triton._GGUF_DEQUANT
    monkeypatch.setattr(gguf_dequant_triton, "_GGUF_DEQUANT", replace(op, devices=("cpu",)))


def gguf_linear(name: str, out_features: int, in_features: int, dtype: torch.dtype) -> GgufLinear:
    layer = GgufLinear(in_features, out_features, True, gguf_dequant.BY_NAME[name], dtype)
    layer.qweight.copy_(blocks(name, out_features, in_features, seed=5))
    torch.nn.init.normal_(layer.bias)
    return layer


@interpreter
@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("tier", ["lossless", "high"])
def test_gguf_linear_weight_runs_the_kernel_verified_once(tier: dispatch.Tier) -> None:
    layer = gguf_linear("Q5_K", 4, 512, torch.bfloat16)
    expected = gguf_dequant.dequantize(layer.qweight, layer.ggml_type).to(torch.bfloat16)
    x = torch.randn(2, 512).bfloat16()
    with use_fused(tier):
        for _ in range(3):
            assert torch.equal(layer.weight, expected)
        out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, expected, layer.bias))
    report = fused_ops_report()
    assert report.fused_calls == {"gguf_dequant": 4} and not report.mismatches
    assert report.verified_signatures == 1 and ("gguf_dequant", CPU_REASON) not in report.fallbacks
    with use_fused("off"):
        assert torch.equal(layer.weight, expected)
    assert fused_ops_report().fused_calls == {"gguf_dequant": 4}  # off: the reference, unrecorded


@interpreter
@pytest.mark.usefixtures("on_cpu")
def test_a_kernel_that_differs_is_caught_on_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate compares the kernel to the reference: one flipped bit makes it keep the reference."""

    def off_by_one_bit(raw: Tensor, qtype: gguf_dequant.GgmlType, dtype: torch.dtype) -> Tensor:
        out = dequantize_triton(raw, qtype, dtype)
        out.view(torch.int16)[0, 0] ^= 1
        return out

    op = gguf_dequant_triton._GGUF_DEQUANT
    monkeypatch.setattr(gguf_dequant_triton, "_GGUF_DEQUANT", replace(op, fused=off_by_one_bit))
    layer = gguf_linear("Q8_0", 3, 64, torch.float16)
    with use_fused("lossless"):
        w = layer.weight
    assert torch.equal(w, gguf_dequant.dequantize(layer.qweight, layer.ggml_type))
    report = fused_ops_report()
    assert len(report.mismatches) == 1 and "1 of 192 elements differ" in report.mismatches[0]


@interpreter
@pytest.mark.slow
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_full_size_projection(name: str) -> None:
    """One whole (3072, 3072) projection, in large programs (the interpreter's cost is per program)."""
    qtype = gguf_dequant.BY_NAME[name]
    raw = blocks(name, 3072, 3072, seed=2)
    assert_matches(raw, qtype, torch.bfloat16, blocks=8192 if qtype.block == 32 else 1024)


# --------------------------------------------------------------------------------------------------
# GPU: the compiled kernel at the full projection shapes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", FLUX1_SHAPES + FLUX2_DEV_SHAPES, ids=row_id)
@pytest.mark.parametrize("name", QUANT_NAMES)
def test_gpu_flux_projections(name: str, shape: tuple[int, int]) -> None:
    """Random codes and sub-block scales, each block's fp16 fields drawn from N(0, 0.02) (drawn on the GPU: the
    numpy quantizer is slow at these sizes)."""
    qtype = gguf_dequant.BY_NAME[name]
    gen = torch.Generator(device="cuda").manual_seed(shape[0])
    n = shape[0] * shape[1] // qtype.block
    raw = torch.randint(0, 256, (n, qtype.type_size), generator=gen, device="cuda").to(torch.uint8)
    for off in HALF_FIELDS[name]:
        scale = (torch.randn(n, 1, generator=gen, device="cuda") * 0.02).half()
        raw[:, off : off + 2] = scale.view(torch.uint8)
    for dtype in OUT_DTYPES:
        assert_matches(raw.reshape(shape[0], -1), qtype, dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", QUANT_NAMES)
def test_gpu_special_fp16_scales(name: str) -> None:
    qtype = gguf_dequant.BY_NAME[name]
    raw = probe_blocks(qtype, 4096, "cuda", seed=4).reshape(16, -1)
    for dtype in OUT_DTYPES:
        out = assert_matches(raw, qtype, dtype)
        ref = dequantize_reference(raw, qtype, dtype)
        finite = ref.isfinite()
        assert torch.equal(out[finite].view(torch.uint8), ref[finite].view(torch.uint8))
        assert special_values_check(raw, qtype, dtype) is None


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_gguf_linear_is_fused_verified_and_capturable(dtype: torch.dtype) -> None:
    """Lossless tier on CUDA: verified on the first read, fused after, inside a CUDA graph too."""
    layer = gguf_linear("Q4_K", 3072, 3072, dtype).cuda()
    expected = gguf_dequant.dequantize(layer.qweight, layer.ggml_type).to(dtype)
    x = torch.randn(8, 3072, device="cuda").to(dtype)
    graph = torch.cuda.CUDAGraph()
    with use_fused("lossless"):
        assert torch.equal(layer.weight, expected)  # verified here
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.nn.functional.linear(x, expected, layer.bias))
    report = fused_ops_report()
    assert report.fused_calls == {"gguf_dequant": 2} and report.fallbacks == {} and not report.mismatches
