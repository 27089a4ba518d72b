"""The e4m3 attention-input producers (`heads_fp8`): q/k from QK-norm + RoPE, the joint v, per-head descales.

On the GPU each producer must equal its eager chain (`torch.equal` on the codes' bits and on the descales). On
the CPU aten's RMSNorm reduces differently from its CUDA kernel (see `test_qk_norm_rope`), so the interpreter's
q/k are checked against the lossless kernel's own output (the interpreter's, itself checked against aten's CUDA
algorithm there) quantized by `quantize_heads_reference`: what is new here, the scales and codes, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels.attention_quant import Fp8Heads, is_head_major_storage, quantize_heads_reference
from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.kernels.heads_fp8 import (
    heads_fp8,
    heads_fp8_reference,
    heads_fp8_triton,
    qk_norm_rope_fp8,
    qk_norm_rope_fp8_reference,
    qk_norm_rope_fp8_triton,
)
from flux_runtime.kernels.qk_norm_rope import qk_norm_rope_triton
from tests.kernels.helpers import DTYPES, FLUX_QK, gpu, interpreter, row_id
from tests.kernels.test_qk_norm_rope import EPS, inputs

# (B, L_txt, L_img, H): double block, single block (no text), odd head count (a masked head block)
CPU_QK = [(1, 3, 6, 24), (1, 0, 9, 4), (2, 3, 5, 3)]
TILES = {"tokens_per_program": 4, "heads_per_program": 2}  # several token and head blocks at CPU sizes


def assert_same(out: Fp8Heads, ref: Fp8Heads) -> None:
    """The same e4m3 bits, the same descales, the same storage."""
    assert out.data.dtype == ref.data.dtype == torch.float8_e4m3fn
    assert torch.equal(out.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert out.data.stride() == ref.data.stride()
    assert out.descale.shape == ref.descale.shape and torch.equal(out.descale, ref.descale)


def qkv_views(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str) -> tuple[Tensor, Tensor]:
    """The v slices (B, L, H, 128) of a text and an image QKV projection output (strided views), per-head
    magnitudes as after a GEMM, one head all zeros (its scale stays finite)."""
    b, n_txt, n_img, h = shape

    def view(n: int) -> Tensor:
        x = torch.randn(b, n, 3, h, 128, device=device) * (torch.rand(b, 1, 1, h, 1, device=device) * 8 + 0.1)
        x[:, :, 2, -1] = 0
        return x.to(dtype)[:, :, 2]

    return view(n_txt), view(n_img)


@interpreter
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_QK, ids=row_id)
def test_qk_norm_rope_fp8_interpreter(
    shape: tuple[int, int, int, int], dtype: torch.dtype, head_major: bool
) -> None:
    args = inputs(shape, dtype, "cpu", packed=True)
    out = qk_norm_rope_fp8_triton(*args, EPS, head_major, **TILES)
    normed = qk_norm_rope_triton(*args, EPS, head_major)
    assert_same(out, quantize_heads_reference(normed, head_major=head_major))
    assert is_head_major_storage(out.data) == (head_major and shape[3] > 1)


@interpreter
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("shape", CPU_QK, ids=row_id)
def test_heads_fp8_interpreter(shape: tuple[int, int, int, int], head_major: bool) -> None:
    x_txt, x_img = qkv_views(shape, torch.bfloat16, "cpu")
    txt = x_txt if shape[1] else None
    out = heads_fp8_triton(txt, x_img, head_major, **TILES)
    assert_same(out, heads_fp8_reference(txt, x_img, head_major))
    assert bool(out.descale[:, -1].gt(0).all())  # the zero head


def test_cpu_runs_the_reference() -> None:
    """Off the GPU the dispatcher runs the eager chain (the kernels are CUDA's), whatever the tier."""
    args = inputs((1, 2, 3, 2), torch.bfloat16, "cpu")
    x_txt, x_img = qkv_views((1, 2, 3, 2), torch.bfloat16, "cpu")
    with use_fused("high"):
        assert_same(qk_norm_rope_fp8(*args, EPS), qk_norm_rope_fp8_reference(*args, EPS))
        assert_same(heads_fp8(x_txt, x_img), heads_fp8_reference(x_txt, x_img))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_QK, ids=row_id)
def test_qk_norm_rope_fp8_gpu_bit_exact(
    shape: tuple[int, int, int, int], dtype: torch.dtype, head_major: bool
) -> None:
    args = inputs(shape, dtype, "cuda", packed=True)
    assert_same(
        qk_norm_rope_fp8_triton(*args, EPS, head_major), qk_norm_rope_fp8_reference(*args, EPS, head_major)
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("shape", FLUX_QK, ids=row_id)
def test_heads_fp8_gpu_bit_exact(shape: tuple[int, int, int, int], head_major: bool) -> None:
    x_txt, x_img = qkv_views(shape, torch.bfloat16, "cuda")
    txt = x_txt if shape[1] else None
    assert_same(heads_fp8_triton(txt, x_img, head_major), heads_fp8_reference(txt, x_img, head_major))


@gpu
@pytest.mark.gpu
def test_producers_verified_by_dispatch_gpu() -> None:
    """Under `high` both ops run fused after their first-call verification, with no mismatch recorded."""
    reset_fused_ops_report(forget_signatures=True)
    args = inputs((1, 512, 1024, 24), torch.bfloat16, "cuda", packed=True)
    x_txt, x_img = qkv_views((1, 512, 1024, 24), torch.bfloat16, "cuda")
    with use_fused("high"):
        for _ in range(2):
            qk_norm_rope_fp8(*args, EPS)
            heads_fp8(x_txt, x_img)
    report = fused_ops_report()
    assert not report.mismatches and not report.fallbacks
    assert report.fused_calls == {"qk_norm_rope_fp8": 2, "heads_fp8": 2}
