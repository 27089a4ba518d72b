"""Fused adaLN modulate against its reference: bit-exact on the GPU and in the interpreter."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.modulate import modulate_reference, modulate_triton
from tests.kernels.helpers import DTYPES, FLUX_ROWS, gpu, interpreter, modulated_rows, row_id

# few rows for the 2-core CI; blocks small enough to exercise row and column masking
CPU_ROWS = [(1, 3, 3072), (2, 2, 6144), (2, 5, 1000)]


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_ROWS, ids=row_id)
def test_modulate_interpreter_bit_exact(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    y, shift, scale = modulated_rows(shape, dtype, "cpu")
    out = modulate_triton(y, shift, scale, block_l=2, block_d=512)
    assert torch.equal(out, modulate_reference(y, shift, scale))


@interpreter
def test_modulate_strided_input_and_rounding_cases() -> None:
    """A token-strided `y` view, and values where each of the three roundings decides the result."""
    b, n, d = 2, 4, 256
    base, shift, scale = modulated_rows((b, 2 * n, d), torch.bfloat16, "cpu")
    y = base[:, ::2]  # stride (2nd, 2d, 1)
    scale[:, :8] = torch.tensor([2**-9, -(2**-9), 3 * 2**-9, 1.0, -1.0, 0.0, 255.0, -0.0])
    out = modulate_triton(y, shift, scale, block_l=4, block_d=128)
    ref = modulate_reference(y, shift, scale)
    assert torch.equal(out, ref)
    # the fused result is not merely close: a single fp32 rounding would differ somewhere
    one_rounding = (y.float() * (1 + scale.float()[:, None]) + shift.float()[:, None]).bfloat16()
    assert not torch.equal(one_rounding, ref)


@interpreter
def test_modulate_guards_name_the_problem() -> None:
    y = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    shift = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="bf16/fp16"):
        modulate_triton(y.float(), shift.float(), shift.float())
    with pytest.raises(UnsupportedInput, match="one dtype"):
        modulate_triton(y, shift.half(), shift)
    with pytest.raises(UnsupportedInput, match=r"shift must be \(1, 64\)"):
        modulate_triton(y, shift[:, :32], shift)
    with pytest.raises(UnsupportedInput, match="unit last stride"):
        modulate_triton(y.transpose(1, 2).contiguous().transpose(1, 2), shift, shift)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_ROWS, ids=row_id)
def test_modulate_gpu_bit_exact(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    y, shift, scale = modulated_rows(shape, dtype, "cuda")
    assert torch.equal(modulate_triton(y, shift, scale), modulate_reference(y, shift, scale))
