"""FLUX.3's FP8 producers: the per-token LayerNorm + modulate with an e4m3 output, SwiGLU at FLUX.3's width.

Each e4m3 output must be the 16-bit op followed by `quantize_reference`, bit for bit, with the same scales.
CPU (interpreter): at FLUX.3's width (3072), one stream and the joint `[txt | content]` form, static and
per-token scales, bf16 and fp16, against `layer_norm_replay` (aten's CUDA LayerNorm in torch ops, as the
16-bit kernel's own CPU tests use) then `quantize_reference`, and against the 16-bit kernel then
`quantize_reference`. GPU: against the eager chain at every FLUX.3 site, and through the dispatch.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels import fp8
from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.kernels.swiglu import swiglu_triton
from tests.kernels.helpers import DTYPES, FLUX3_ROWS, FLUX3_SITES, FLUX3_WIDTH, gpu, interpreter, row_id
from tests.kernels.test_fp8 import assert_same, bits, static
from tests.kernels.test_token_layer_norm_modulate import Args, inputs, replayed

tlnm = importlib.import_module("flux_runtime.kernels.token_layer_norm_modulate")

EPS = 1e-6
FLUX3_MLP = int(FLUX3_WIDTH * 3.0)  # SwiGLU width of FLUX.3 Klein (mlp_in writes [gate | up], 2 x 9216)
SCALES = [None, 0.01, 0.05]  # per token; static ones that clamp some of the values (0.01) and none (0.05)
SCALE_IDS = ["per-token", "static-clamping", "static"]


def quant(scale: float | None, device: str) -> tuple[Tensor | None, Tensor | None]:
    return static(scale, device) if scale is not None else (None, None)


# (B, L_txt, L, D), dtype, scale: the joint form at FLUX.3's width in every mode; one stream; an odd width
CPU_CASES = [((1, 2, 3, FLUX3_WIDTH), dtype, scale) for dtype in DTYPES for scale in SCALES] + [
    ((1, 0, 3, FLUX3_WIDTH), torch.bfloat16, None),
    ((1, 1, 2, 1000), torch.float16, 0.05),
]


@interpreter
@pytest.mark.parametrize(
    ("shape", "dtype", "scale"), CPU_CASES, ids=[f"{row_id(c[0])}-{c[1]}-{c[2]}" for c in CPU_CASES]
)
def test_fp8_output_is_the_16_bit_value_quantized(shape, dtype, scale):
    args = inputs(shape, dtype, "cpu")
    q = quant(scale, "cpu")
    # 4 rows per program: a program straddles the text/content boundary, surplus rows in the last one
    got = tlnm.token_layer_norm_modulate_fp8_triton(*args, EPS, *q, rows_per_program=4)
    b, n_txt, n, d = shape
    assert got.data.shape == (b, n_txt + n, d) and got.data.dtype == fp8.E4M3 and got.data.is_contiguous()
    assert got.scale.shape == ((b, n_txt + n, 1) if scale is None else ())
    assert_same(got, fp8.quantize_reference(replayed(*args), *q))


@interpreter
def test_default_tiling_and_a_row_of_zeros():
    """One row per program (the default); a token whose modulated value is all zeros gets the 1e-12 floor."""
    x_txt, sh_t, sc_t, x, shift, scale = inputs((1, 2, 2, FLUX3_WIDTH), torch.bfloat16, "cpu")
    shift[0, 1] = 0
    scale[0, 1] = -1  # (1 + scale) = 0: the row is exactly 0
    args = (x_txt, sh_t, sc_t, x, shift, scale)
    got = tlnm.token_layer_norm_modulate_fp8_triton(*args, EPS, None, None)
    assert_same(got, fp8.quantize_reference(replayed(*args)))
    # the same bits as the 16-bit kernel's output quantized
    assert_same(got, fp8.quantize_reference(tlnm.token_layer_norm_modulate_triton(*args, EPS)))
    assert float(got.scale[0, 3]) == pytest.approx(1e-12 / 448) and not bits(got.data[0, 3]).any()


@interpreter
def test_fp8_guards_name_the_problem():
    args = inputs((1, 2, 3, 64), torch.bfloat16, "cpu")
    s, inv = static(0.02, "cpu")
    with pytest.raises(ValueError, match="both scale and inv_scale"):
        tlnm.token_layer_norm_modulate_fp8_triton(*args, EPS, s, None)
    with pytest.raises(fp8.UnsupportedInput, match="one fp32 value"):
        tlnm.token_layer_norm_modulate_fp8_triton(*args, EPS, s.expand(2), inv.expand(2))


@interpreter
@pytest.mark.parametrize("scale", [None, 0.05], ids=["per-token", "static"])
def test_swiglu_fp8_at_flux3_width(scale):
    """mlp_out's input: SwiGLU of FLUX.3's [gate | up] (2 x 9216), quantized as it is formed."""
    x = (torch.randn(1, 3, 2 * FLUX3_MLP) * 3).to(torch.bfloat16)
    q = quant(scale, "cpu")
    # against the 16-bit kernel's values (the interpreter's exp may differ from aten's CPU one by an ulp)
    assert_same(fp8.act_quantize_triton(x, "swiglu", *q), fp8.quantize_reference(swiglu_triton(x), *q))


# --------------------------------------------------------------------------------------------------
# GPU: FLUX.3's sites


def assert_fused_exact(args: Args, scale: float | None, **tiling: int) -> None:
    """The compiled kernel's e4m3 and scales equal the eager chain's (16-bit op, then `quantize_reference`)."""
    q = quant(scale, "cuda")
    assert_same(
        tlnm.token_layer_norm_modulate_fp8_triton(*args, EPS, *q, **tiling),
        tlnm.token_layer_norm_modulate_fp8_reference(*args, EPS, *q),
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("shape", FLUX3_SITES, ids=row_id)
def test_gpu_token_layer_norm_modulate_fp8(shape, scale, dtype):
    assert_fused_exact(inputs(shape, dtype, "cuda"), scale)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_program", [1, 2, 4])
def test_gpu_token_layer_norm_modulate_fp8_tilings(rows_per_program):
    args = inputs((1, 480, 8192, FLUX3_WIDTH), torch.bfloat16, "cuda")
    for scale in (None, 0.05):
        assert_fused_exact(args, scale, rows_per_program=rows_per_program)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [None, 0.05], ids=["per-token", "static"])
@pytest.mark.parametrize("rows", FLUX3_ROWS, ids=row_id)
def test_gpu_swiglu_fp8_at_flux3_sites(rows, scale, dtype):
    b, n = rows
    x = (torch.randn(b, n, 2 * FLUX3_MLP, device="cuda") * 3).to(dtype)
    q = quant(scale, "cuda")
    assert_same(fp8.act_quantize_triton(x, "swiglu", *q), fp8.act_quantize_reference(x, "swiglu", *q))


@gpu
@pytest.mark.gpu
def test_gpu_dispatch_verifies_and_counts_token_layer_norm_modulate_fp8():
    reset_fused_ops_report(forget_signatures=True)
    args = inputs((1, 480, 4096, FLUX3_WIDTH), torch.bfloat16, "cuda")
    with use_fused("lossless"):
        a = tlnm.token_layer_norm_modulate_fp8(*args, EPS)
        b = tlnm.token_layer_norm_modulate_fp8(*args, EPS, *static(0.05, "cuda"))
    assert_same(a, tlnm.token_layer_norm_modulate_fp8_reference(*args, EPS, None, None))
    assert_same(b, tlnm.token_layer_norm_modulate_fp8_reference(*args, EPS, *static(0.05, "cuda")))
    report = fused_ops_report()
    assert report.fused_calls.get("token_layer_norm_modulate_fp8") == 2
    assert not report.mismatches and not report.fallbacks
