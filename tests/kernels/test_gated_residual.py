"""Fused gated residual against its reference: bit-exact on the GPU and in the interpreter."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.gated_residual import gated_residual_reference, gated_residual_triton
from tests.kernels.helpers import DTYPES, FLUX_ROWS, activations, gpu, interpreter, modulation, row_id

CPU_ROWS = [(1, 3, 3072), (2, 2, 6144), (2, 5, 1000)]


def inputs(shape: tuple[int, int, int], dtype: torch.dtype, device: str) -> tuple[Tensor, Tensor, Tensor]:
    """(residual, gate, update) at a (B, L, D) site; the gate (B, D) one chunk of a modulation."""
    b, _, d = shape
    gate = modulation(b, d, dtype, device)[2]
    return activations(shape, dtype, device) * 8, gate, activations(shape, dtype, device)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_ROWS, ids=row_id)
def test_gated_residual_interpreter_bit_exact(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    residual, gate, update = inputs(shape, dtype, "cpu")
    out = gated_residual_triton(residual, gate, update, block_l=2, block_d=512)
    ref = gated_residual_reference(residual, gate, update)
    assert torch.equal(out, ref)
    # two roundings, not one: an fp32 fused multiply-add would not match
    assert not torch.equal((residual.float() + gate.float()[:, None] * update.float()).to(dtype), ref)


@interpreter
def test_gated_residual_token_slices() -> None:
    """The final layer hands in image-token slices of the joint stream: batch stride != L * D."""
    b, n_txt, n_img, d = 2, 3, 4, 512
    joint_res = activations((b, n_txt + n_img, d), torch.bfloat16, "cpu")
    joint_upd = activations((b, n_txt + n_img, d), torch.bfloat16, "cpu")
    gate = modulation(b, d, torch.bfloat16, "cpu", chunks=3)[2]
    res, upd = joint_res[:, n_txt:], joint_upd[:, n_txt:]
    out = gated_residual_triton(res, gate, upd, block_l=2, block_d=256)
    assert torch.equal(out, gated_residual_reference(res, gate, upd))


@interpreter
def test_gated_residual_guards_name_the_problem() -> None:
    r = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    g = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInput, match=r"update must be \(1, 4, 64\)"):
        gated_residual_triton(r, g, r[:, :2])
    with pytest.raises(UnsupportedInput, match="one dtype"):
        gated_residual_triton(r, g, r.half())
    with pytest.raises(UnsupportedInput, match="non-empty"):
        gated_residual_triton(r[:, :0], g, r[:, :0])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_ROWS, ids=row_id)
def test_gated_residual_gpu_bit_exact(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    residual, gate, update = inputs(shape, dtype, "cuda")
    out = gated_residual_triton(residual, gate, update)
    assert torch.equal(out, gated_residual_reference(residual, gate, update))


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_subnormal_values(dtype: torch.dtype) -> None:
    """Results in the subnormal range round like aten's (the interpreter's own casts lose them)."""
    tiny = torch.finfo(dtype).tiny
    residual = (torch.randn(1, 2, 512) * tiny).to(dtype)
    update = (torch.randn(1, 2, 512) * tiny).to(dtype)
    gate = torch.randn(1, 512).to(dtype)
    ref = gated_residual_reference(residual, gate, update)
    assert int(((ref != 0) & (ref.abs() < tiny)).sum()) > 100
    assert torch.equal(gated_residual_triton(residual, gate, update, block_d=256), ref)
