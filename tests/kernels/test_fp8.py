"""FP8 producers: each e4m3 output equals "the eager op, then `quantize_reference`" bit for bit.

CPU (interpreter): the e4m3 rounding over every 16-bit input and several scales, strided inputs and
`out=` slices, per-row and static scales, LayerNorm + modulate and its deferred-residual form exactly
against the reference chain; GELU / SwiGLU against the kernels' own 16-bit values (the interpreter's
tanh/exp may differ from aten's CPU ones by an ulp). GPU: every producer against the reference chain at
every FLUX.1 / FLUX.2 site, static and dynamic scales, bf16 and fp16, and through the dispatch.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels import fp8, gelu
from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.kernels.gelu import all_half_values, gelu_tanh_triton
from flux_runtime.kernels.swiglu import swiglu_triton
from flux_runtime.kernels.triton_utils import e4m3_consts, e4m3_hardware, set_e4m3_hardware
from tests.kernels.helpers import (
    BATCHES,
    DTYPES,
    FLUX_ROWS,
    TXT_TOKENS,
    activations,
    assert_same,
    bits,
    gelu_rows,
    gpu,
    interpreter,
    modulation,
    row_id,
)

lnm = importlib.import_module("flux_runtime.kernels.layer_norm_modulate")

pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)


def static(value: float, device) -> tuple[Tensor, Tensor]:
    s = torch.tensor(value, device=device)
    return s, s.reciprocal()


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.01, 3.7, 1e-5])
def test_every_16_bit_value_rounds_as_torch(dtype, scale):
    x = all_half_values(dtype, "cpu").reshape(16, 4096)
    assert_same(
        fp8.act_quantize_triton(x, "identity", *static(scale, "cpu")),
        fp8.quantize_reference(x, *static(scale, "cpu")),
    )


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dynamic_rows_strided_input_and_zero_rows(dtype):
    x = activations((2, 9, 3 * 160), dtype, "cpu")[..., 160:320]  # a strided column slice
    x[0, 3] = 0
    got = fp8.act_quantize_triton(x, "identity", None, None, block_n=64)
    assert got.scale.shape == (2, 9, 1)
    assert_same(got, fp8.quantize_reference(x))


@interpreter
def test_out_slice_is_written_in_place():
    x = activations((1, 5, 64), torch.bfloat16, "cpu")
    h = torch.zeros(1, 5, 96, dtype=fp8.E4M3)
    s, inv = static(0.02, "cpu")
    fp8.act_quantize_triton(x, "identity", s, inv, h[..., 32:], block_n=32)
    assert torch.equal(bits(h[..., 32:]), bits(fp8.quantize_reference(x, s, inv).data))
    assert not bits(h[..., :32]).any()
    with pytest.raises(fp8.UnsupportedInput, match="static"):
        fp8.act_quantize_triton(x, "identity", None, None, h[..., 32:])


@interpreter
@pytest.mark.parametrize("act", ["gelu_tanh", "swiglu"])
@pytest.mark.parametrize("scale", [None, 0.05], ids=["dynamic", "static"])
def test_activation_then_quantize(act, scale):
    width = 2 * 96 if act == "swiglu" else 96
    x = (torch.randn(2, 7, width) * 3).to(torch.bfloat16)
    q = static(scale, "cpu") if scale else (None, None)
    value = gelu_tanh_triton(x) if act == "gelu_tanh" else swiglu_triton(x)
    assert_same(fp8.act_quantize_triton(x, act, *q, block_n=64), fp8.quantize_reference(value, *q))


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_rows_in_blocks_take_the_max_shortcut(dtype, monkeypatch):
    """Dynamic tanh-GELU rows swept in column blocks: rows through the max shortcut and through the fallback
    sweep give the reference's codes and scales. A forged bound below every GELU value changes exactly the
    small-maximum rows' scales, so the shortcut is taken and the bound decides it; with the shortcut off the
    bound is not read; `set_act_block` sends default calls through the blocks."""
    x = gelu_rows(2, 6, 96, 80, dtype, "cpu")
    want = fp8.quantize_reference(gelu_tanh_triton(x))
    assert_same(fp8.act_quantize_triton(x, "gelu_tanh", None, None, block_n=32), want)
    assert_same(fp8.act_quantize_triton(x, "gelu_tanh", None, None), want)  # the default block
    monkeypatch.setitem(gelu._GELU_BOUNDS, (torch.device("cpu"), dtype), -1.0)
    forged = fp8.act_quantize_triton(x, "gelu_tanh", None, None, block_n=32)
    wrong = (forged.scale != want.scale).flatten().tolist()
    assert wrong == [False, True, True, False, True, False] * 2  # the row kinds of `gelu_rows`, per batch
    assert bool((forged.scale <= want.scale).all())
    assert_same(fp8.act_quantize_triton(x, "gelu_tanh", None, None, block_n=32, gelu_shortcut=False), want)
    assert (
        fp8.ACT_BLOCK_DEFAULTS["gelu_tanh"] is not None
    )  # default calls go through the blocks: the forged bound
    assert_same(fp8.act_quantize_triton(x, "gelu_tanh", None, None), forged)
    with fp8.act_block("gelu_tanh", None):  # whole rows in registers: no second sweep, no bound read
        assert_same(fp8.act_quantize_triton(x, "gelu_tanh", None, None), want)
    assert_same(fp8.act_quantize_triton(x, "gelu_tanh", None, None), forged)  # the block is back


@interpreter
def test_swiglu_rows_in_blocks_and_whole_agree():
    """SwiGLU's dynamic rows in column blocks (`set_act_block`) and whole: the same codes and scales."""
    x = (torch.randn(2, 5, 2 * 80) * 3).to(torch.bfloat16)
    want = fp8.quantize_reference(swiglu_triton(x))
    with fp8.act_block("swiglu", 32):
        assert fp8._ACT_BLOCK["swiglu"] == 32
        assert_same(fp8.act_quantize_triton(x, "swiglu", None, None), want)
    assert fp8._ACT_BLOCK["swiglu"] == fp8.ACT_BLOCK_DEFAULTS["swiglu"]
    assert_same(fp8.act_quantize_triton(x, "swiglu", None, None), want)  # the default block
    with fp8.act_block("swiglu", None):  # whole rows in registers
        assert_same(fp8.act_quantize_triton(x, "swiglu", None, None), want)
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        fp8.set_act_block("relu", 32)
    with pytest.raises(ValueError, match="unknown activation 'relu'"), fp8.act_block("relu", 32):
        pass


def test_e4m3_conversion_setting_is_restored_and_off_without_a_gpu():
    """`e4m3_hardware` sets the producers' e4m3 conversion for its body only; the interpreter (and any CPU
    tensor) always takes the integer path, whose codes the CPU tests compare with the eager cast."""
    cpu = torch.device("cpu")
    assert e4m3_consts(cpu) == {"HW_E4M3": False}
    before = set_e4m3_hardware(True)
    try:
        with e4m3_hardware(False):
            assert set_e4m3_hardware(False) is False
        assert set_e4m3_hardware(True) is True
    finally:
        set_e4m3_hardware(before)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inv", [1.0, 3.7, 0.0123], ids=["inv1", "inv3.7", "inv0.0123"])
def test_gpu_e4m3_hardware_conversion_matches_the_integer_one_on_every_input(dtype, inv):
    """Every 16-bit input (NaN, infinities, values past ±448, subnormals, ties), times a static inverse scale, in
    e4m3 through the GPU's conversion instruction and through the integer path: the same codes as each other
    and as the eager clamp and cast; with dynamic row scales too."""
    x = all_half_values(dtype, "cuda").view(256, 256)
    inv_t = torch.tensor(inv, device="cuda")
    scale = torch.tensor(1 / inv, device="cuda")
    assert e4m3_consts(x.device) == {"HW_E4M3": True}  # an sm_89+ GPU: the FP8 tests run on one
    for quant in ((scale, inv_t), (None, None)):
        got = {}
        for hw in (True, False):
            with e4m3_hardware(hw):
                got[hw] = fp8.act_quantize_triton(
                    x.nan_to_num(0.0) if quant[0] is None else x, "identity", *quant
                )
        want = fp8.quantize_reference(x.nan_to_num(0.0) if quant[0] is None else x, *quant)
        assert_same(got[True], want)
        assert_same(got[False], want)


def assert_layer_norm_modulate_fp8_exact(
    x: Tensor, gate: Tensor, u: Tensor, shift: Tensor, sc: Tensor, q: tuple[Tensor | None, Tensor | None]
) -> None:
    """Both e4m3 LayerNorm producers, plain (of `x`) and with the deferred residual (of r = x + gate * u), equal
    their references: the codes, the scales and r."""
    assert_same(
        lnm.layer_norm_modulate_fp8_triton(x, shift, sc, 1e-6, *q),
        lnm.layer_norm_modulate_fp8_reference(x, shift, sc, 1e-6, *q),
    )
    (r, a), (rr, ra) = (
        lnm.residual_layer_norm_modulate_fp8_triton(x, gate, u, shift, sc, 1e-6, *q),
        lnm.residual_layer_norm_modulate_fp8_reference(x, gate, u, shift, sc, 1e-6, *q),
    )
    assert torch.equal(r, rr)
    assert_same(a, ra)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [512, 96])
@pytest.mark.parametrize("scale", [None, 0.01], ids=["dynamic", "static"])
def test_layer_norm_modulate_fp8(dtype, d, scale):
    x = activations((2, 5, d), dtype, "cpu")
    shift, sc, gate = modulation(2, d, dtype, "cpu", chunks=3)
    u = activations((2, 5, d), dtype, "cpu")
    q = static(scale, "cpu") if scale else (None, None)
    assert_layer_norm_modulate_fp8_exact(x, gate, u, shift, sc, q)


def test_fp8_linear_on_cpu_matches_the_dequantized_product():
    w = torch.randn(48, 64)
    ws = torch.rand(48) * 0.01 + 0.001
    wq = (w / ws[:, None]).clamp(-448, 448).to(fp8.E4M3)
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    act = fp8.quantize_reference(x)
    y = fp8.fp8_linear(act, wq, ws, None, torch.bfloat16)
    expected = (act.data.float() * act.scale) @ (wq.float() * ws[:, None]).t()
    assert y.shape == (2, 5, 48)
    assert float((y.float() - expected).abs().max()) <= float(expected.abs().max()) * 2**-7


# --------------------------------------------------------------------------------------------------
# GPU: the real shapes

FLUX_MLP = [
    (b, n, m) for m in (12288, 18432, 9216) for n in (TXT_TOKENS, 4096, TXT_TOKENS + 4096) for b in BATCHES
]
SCALES = [None, 0.05]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=["dynamic", "static"])
@pytest.mark.parametrize("shape", FLUX_ROWS, ids=row_id)
def test_gpu_layer_norm_modulate_fp8(shape, dtype, scale):
    b, _n, d = shape
    x, u = activations(shape, dtype, "cuda"), activations(shape, dtype, "cuda")
    shift, sc, gate = modulation(b, d, dtype, "cuda", chunks=3)
    q = static(scale, "cuda") if scale else (None, None)
    assert_layer_norm_modulate_fp8_exact(x, gate, u, shift, sc, q)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=["dynamic", "static"])
@pytest.mark.parametrize("act", ["gelu_tanh", "swiglu"])
@pytest.mark.parametrize("shape", FLUX_MLP, ids=row_id)
def test_gpu_activation_fp8(shape, act, scale, dtype):
    b, n, m = shape
    x = (torch.randn(b, n, 2 * m if act == "swiglu" else m, device="cuda") * 3).to(dtype)
    q = static(scale, "cuda") if scale else (None, None)
    assert_same(fp8.act_quantize_triton(x, act, *q), fp8.act_quantize_reference(x, act, *q))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [1024, 2048])
@pytest.mark.parametrize("shape", [s for s in FLUX_MLP if s[2] == 12288], ids=row_id)
def test_gpu_gelu_rows_in_blocks(shape, block, dtype):
    """FLUX.1's MLP rows in column blocks, with the max shortcut (rows through it and through the fallback
    sweep, see `gelu_rows`) and without: the eager GELU's codes and scales."""
    b, n, m = shape
    x = gelu_rows(b, n, 3072, m, dtype, "cuda")
    want = fp8.act_quantize_reference(x, "gelu_tanh", None, None)
    assert_same(fp8.act_quantize_triton(x, "gelu_tanh", None, None, block_n=block), want)
    assert_same(fp8.act_quantize_triton(x, "gelu_tanh", None, None, block_n=block, gelu_shortcut=False), want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [1024, 2048])
@pytest.mark.parametrize("shape", [s for s in FLUX_MLP if s[2] in (9216, 12288)], ids=row_id)
def test_gpu_swiglu_rows_in_blocks(shape, block, dtype):
    """The klein models' SwiGLU rows (9216 and 12288 wide, held whole by default) in column blocks."""
    b, n, m = shape
    x = (torch.randn(b, n, 2 * m, device="cuda") * 3).to(dtype)
    want = fp8.act_quantize_reference(x, "swiglu", None, None)
    assert_same(fp8.act_quantize_triton(x, "swiglu", None, None, block_n=block), want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d, m", [(3072, 12288), (6144, 18432)])
def test_gpu_single_block_buffer(d, m, dtype):
    """Attention heads and the MLP activation quantized into the two column slices of one e4m3 buffer."""
    n = TXT_TOKENS + 4096
    attn = torch.randn(1, n, d // 128, 128, device="cuda").to(dtype).permute(0, 1, 2, 3)
    mlp = (torch.randn(1, n, m, device="cuda") * 3).to(dtype)
    s, inv = static(0.05, "cuda")
    h = torch.empty(1, n, d + m, dtype=fp8.E4M3, device="cuda")
    fp8.act_quantize_triton(attn.reshape(1, n, d), "identity", s, inv, h[..., :d])
    fp8.act_quantize_triton(mlp, "gelu_tanh", s, inv, h[..., d:])
    ref = torch.cat(
        [
            fp8.quantize_reference(attn.reshape(1, n, d), s, inv).data,
            fp8.act_quantize_reference(mlp, "gelu_tanh", s, inv).data,
        ],
        dim=-1,
    )
    assert torch.equal(bits(h), bits(ref))


@gpu
@pytest.mark.gpu
def test_gpu_dispatch_verifies_and_counts_the_fp8_producers():
    reset_fused_ops_report(forget_signatures=True)
    x = activations((1, 4096, 3072), torch.bfloat16, "cuda")
    shift, sc, _ = modulation(1, 3072, torch.bfloat16, "cuda", chunks=3)
    with use_fused("lossless"):
        a = lnm.layer_norm_modulate_fp8(x, shift, sc, 1e-6)
        b = fp8.gelu_tanh_fp8(x)
    assert_same(a, lnm.layer_norm_modulate_fp8_reference(x, shift, sc, 1e-6, None, None))
    assert_same(b, fp8.act_quantize_reference(x, "gelu_tanh", None, None))
    report = fused_ops_report()
    assert (
        report.fused_calls.get("layer_norm_modulate_fp8") == 1
        and report.fused_calls.get("gelu_tanh_fp8") == 1
    )
    assert not report.mismatches and not report.fallbacks
