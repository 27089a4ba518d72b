"""Fused per-token LayerNorm + modulate (FLUX.3), one stream or text and content joined.

On the GPU the kernel must equal the eager chain (`torch.equal`) at FLUX.3's shapes. On the CPU, aten's
own LayerNorm reduces in another order than its CUDA kernel, so the interpreter is checked bit-exactly
against `layer_norm_replay` (aten's CUDA algorithm in fp32 torch ops; checked against aten on CUDA by
tests/kernels/test_layer_norm_modulate.py) followed by the reference modulation.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.token_layer_norm_modulate import (
    token_layer_norm_modulate_reference,
    token_layer_norm_modulate_triton,
)
from tests.kernels.aten_replay import layer_norm_replay
from tests.kernels.helpers import (
    DTYPES,
    FLUX3_SITES,
    FLUX3_WIDTH,
    activations,
    assert_within_one_ulp,
    gpu,
    interpreter,
    row_id,
    token_modulation,
)

EPS = 1e-6
# (B, L_txt, L, D): FLUX.3's width with and without a text stream, and an odd width (short aten threads)
CPU_SHAPES = [(1, 0, 3, FLUX3_WIDTH), (1, 2, 3, FLUX3_WIDTH), (1, 2, 3, 1000)]


Args = tuple[Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor, Tensor]


def inputs(shape: tuple[int, int, int, int], dtype: torch.dtype, device: str) -> Args:
    b, n_txt, n, d = shape
    x = activations((b, n, d), dtype, device)
    shift, scale, _ = token_modulation(b, n, d, dtype, device)
    if not n_txt:
        return None, None, None, x, shift, scale
    x_txt = activations((b, n_txt, d), dtype, device)
    shift_txt, scale_txt, _ = token_modulation(b, n_txt, d, dtype, device)
    return x_txt, shift_txt, scale_txt, x, shift, scale


def replayed(*args: Tensor | None) -> Tensor:
    x_txt, shift_txt, scale_txt, x, shift, scale = args

    def one(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        return (1 + scale) * layer_norm_replay(x, EPS) + shift

    y = one(x, shift, scale)
    return y if x_txt is None else torch.cat([one(x_txt, shift_txt, scale_txt), y], dim=1)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=row_id)
def test_token_layer_norm_modulate_interpreter_replays_aten(
    shape: tuple[int, int, int, int], dtype: torch.dtype
) -> None:
    args = inputs(shape, dtype, "cpu")
    # 4 rows per program: a program straddles the text/content boundary, surplus rows in the last one
    out = token_layer_norm_modulate_triton(*args, EPS, rows_per_program=4)
    b, n_txt, n, d = shape
    assert out.shape == (b, n_txt + n, d) and out.is_contiguous()
    assert torch.equal(out, replayed(*args))


@interpreter
def test_token_layer_norm_modulate_default_tiling() -> None:
    args = inputs((2, 3, 2, FLUX3_WIDTH), torch.bfloat16, "cpu")
    out = token_layer_norm_modulate_triton(*args, EPS)
    assert torch.equal(out, replayed(*args))


@interpreter
def test_every_token_uses_its_own_row() -> None:
    """Per-token rows really differ per token: modulating with the first token's row changes the output."""
    x_txt, sh_t, sc_t, x, shift, scale = inputs((1, 2, 3, 512), torch.bfloat16, "cpu")
    out = token_layer_norm_modulate_triton(x_txt, sh_t, sc_t, x, shift, scale, EPS)
    first = token_layer_norm_modulate_triton(
        x_txt, sh_t, sc_t, x, shift[:, :1].expand_as(x), scale[:, :1].expand_as(x), EPS
    )
    assert torch.equal(out[:, :3], first[:, :3]) and not torch.equal(out[:, 3:], first[:, 3:])
    # broadcast rows (token stride 0) are read as the reference broadcasts them
    assert torch.equal(
        first, replayed(x_txt, sh_t, sc_t, x, shift[:, :1].expand_as(x), scale[:, :1].expand_as(x))
    )


@interpreter
def test_strided_input_is_normalised_as_aten_copies_it() -> None:
    """A token-strided x (every other token of a buffer) is normalised as aten does after its copy."""
    _, _, _, x, shift, scale = inputs((1, 0, 6, FLUX3_WIDTH), torch.bfloat16, "cpu")
    xs, sh, sc = x[:, ::2], shift[:, :3], scale[:, :3]
    out = token_layer_norm_modulate_triton(None, None, None, xs, sh, sc, EPS)
    assert torch.equal(out, replayed(None, None, None, xs.contiguous(), sh, sc))


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreter_within_one_ulp_of_cpu_aten(dtype: torch.dtype) -> None:
    """With shift 0 and scale 0 the output is the LayerNorm: at most 1 ulp from aten's CPU kernel, which
    reduces in another order."""
    x_txt, sh_t, _, x, shift, _ = inputs((1, 2, 3, FLUX3_WIDTH), dtype, "cpu")
    zero_t, zero = torch.zeros_like(sh_t), torch.zeros_like(shift)
    args = (x_txt, zero_t, zero_t, x, zero, zero)
    out = token_layer_norm_modulate_triton(*args, EPS)
    ref = token_layer_norm_modulate_reference(*args, EPS)
    assert_within_one_ulp(out, ref)


@interpreter
def test_token_layer_norm_modulate_guards_name_the_problem() -> None:
    x_txt, sh_t, sc_t, x, shift, scale = inputs((1, 2, 3, 64), torch.bfloat16, "cpu")
    with pytest.raises(UnsupportedInput, match="all be given or all be None"):
        token_layer_norm_modulate_triton(x_txt, None, sc_t, x, shift, scale, EPS)
    with pytest.raises(UnsupportedInput, match=r"x shift must be \(1, 3, 64\)"):
        token_layer_norm_modulate_triton(None, None, None, x, shift[:, :1], scale, EPS)
    with pytest.raises(UnsupportedInput, match="one dtype"):
        token_layer_norm_modulate_triton(x_txt, sh_t, sc_t.half(), x, shift, scale, EPS)
    with pytest.raises(UnsupportedInput, match="multiple of 4"):
        token_layer_norm_modulate_triton(None, None, None, x[..., :62], shift[..., :62], scale[..., :62], EPS)
    with pytest.raises(UnsupportedInput, match="does not match"):
        token_layer_norm_modulate_triton(
            x_txt[:, :, :32], sh_t[:, :, :32], sc_t[:, :, :32], x, shift, scale, EPS
        )
    with pytest.raises(UnsupportedInput, match="4-element aligned"):
        buf = torch.zeros(3 * 64 + 1, dtype=torch.bfloat16)
        token_layer_norm_modulate_triton(None, None, None, buf[1:].view(1, 3, 64), shift, scale, EPS)


def assert_fused_exact(args: Args, **tiling: int) -> None:
    """The compiled kernel equals the eager reference (the GPU's own LayerNorm)."""
    out = token_layer_norm_modulate_triton(*args, EPS, **tiling)
    assert torch.equal(out, token_layer_norm_modulate_reference(*args, EPS))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX3_SITES, ids=row_id)
def test_token_layer_norm_modulate_gpu_bit_exact(
    shape: tuple[int, int, int, int], dtype: torch.dtype
) -> None:
    assert_fused_exact(inputs(shape, dtype, "cuda"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_program", [1, 2, 4])
def test_token_layer_norm_modulate_gpu_tilings(rows_per_program: int) -> None:
    assert_fused_exact(
        inputs((1, 480, 4096, FLUX3_WIDTH), torch.bfloat16, "cuda"), rows_per_program=rows_per_program
    )
