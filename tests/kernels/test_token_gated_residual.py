"""Fused per-token gated residual `x + gate * (a + b)` (FLUX.3), one stream or text and content joined.

Elementwise, so the interpreter is held to `torch.equal` against the eager reference itself on the CPU,
and the compiled kernel to the same on the GPU at FLUX.3's shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.token_gated_residual import (
    joint_token_gated_residual_reference,
    joint_token_gated_residual_triton,
    token_gated_residual_reference,
    token_gated_residual_triton,
)
from tests.kernels.helpers import (
    DTYPES,
    FLUX3_SITES,
    FLUX3_WIDTH,
    activations,
    gpu,
    interpreter,
    row_id,
    token_modulation,
)

# (B, L_txt, L, D): FLUX.3's width, with and without text, and an odd width (a masked column block)
CPU_SHAPES = [(1, 0, 5, FLUX3_WIDTH), (1, 3, 6, FLUX3_WIDTH), (2, 2, 3, 1000)]


def gates(b: int, n: int, d: int, dtype: torch.dtype, device: str) -> Tensor:
    """The gate chunk (B, L, D) of a per-token (B, L, 3D) modulation, row stride 3D."""
    return token_modulation(b, n, d, dtype, device)[2]


def inputs(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str) -> list[Tensor]:
    """[x_txt, gate_txt,] x, gate, attn, mlp: the updates over the joint [txt | x] sequence."""
    b, n_txt, n, d = shape
    x, gate = activations((b, n, d), dtype, device), gates(b, n, d, dtype, device)
    a, mlp = (activations((b, n_txt + n, d), dtype, device) for _ in range(2))
    txt = [activations((b, n_txt, d), dtype, device), gates(b, n_txt, d, dtype, device)] if n_txt else []
    return [*txt, x, gate, a, mlp]


def check(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, **kw: int) -> None:
    args = inputs(shape, dtype, device)
    if shape[1]:
        out_txt, out = joint_token_gated_residual_triton(*args, **kw)
        ref_txt, ref = joint_token_gated_residual_reference(*args)
        assert out_txt.is_contiguous() and torch.equal(out_txt, ref_txt)
    else:
        out = token_gated_residual_triton(*args, **kw)
        ref = token_gated_residual_reference(*args)
    assert out.is_contiguous() and torch.equal(out, ref)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=row_id)
def test_token_gated_residual_interpreter_bit_exact(
    shape: tuple[int, int, int, int], dtype: torch.dtype
) -> None:
    # 4 rows per program: programs straddle the text/content boundary; 512 columns: masked columns at D 1000
    check(shape, dtype, "cpu", block_l=4, block_d=512)


@interpreter
def test_sum_is_rounded_before_the_gate() -> None:
    """`a + b` is rounded to bf16 before the gate multiplies it (as eager stores it): skipping that
    rounding changes bits, and the kernel does not skip it."""
    x, gate, a, b = inputs((1, 0, 16, FLUX3_WIDTH), torch.bfloat16, "cpu")
    unrounded = (x.float() + (gate.float() * (a.float() + b.float())).bfloat16().float()).bfloat16()
    out = token_gated_residual_triton(x, gate, a, b)
    assert torch.equal(out, token_gated_residual_reference(x, gate, a, b))
    assert not torch.equal(out, unrounded)


@interpreter
def test_token_gated_residual_guards_name_the_problem() -> None:
    x_txt, g_txt, x, gate, a, b = inputs((1, 2, 3, 64), torch.bfloat16, "cpu")
    with pytest.raises(UnsupportedInput, match=r"a must be \(1, 3, 64\)"):
        token_gated_residual_triton(x, gate, a, b)
    with pytest.raises(UnsupportedInput, match=r"gate must be \(1, 3, 64\)"):
        joint_token_gated_residual_triton(x_txt, g_txt, x, gate[:, :1], a, b)
    with pytest.raises(UnsupportedInput, match="one dtype"):
        joint_token_gated_residual_triton(x_txt, g_txt.half(), x, gate, a, b)
    with pytest.raises(UnsupportedInput, match="does not match"):
        joint_token_gated_residual_triton(x_txt[..., :32], g_txt, x, gate, a, b)
    with pytest.raises(UnsupportedInput, match="unit last stride"):
        b_strided = torch.zeros(1, 5, 128, dtype=torch.bfloat16)[..., ::2]  # every other channel
        joint_token_gated_residual_triton(x_txt, g_txt, x, gate, a, b_strided)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX3_SITES, ids=row_id)
def test_token_gated_residual_gpu_bit_exact(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    check(shape, dtype, "cuda")
