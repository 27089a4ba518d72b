"""Fused LayerNorm + modulate and deferred residual + LayerNorm + modulate.

On the GPU the kernels must equal the eager chain (`torch.equal`). On the CPU, aten's own LayerNorm
reduces in another order than its CUDA kernel, so the interpreter is checked bit-exactly against
`layer_norm_replay` (aten's CUDA algorithm in plain fp32 torch ops) and within one ulp against the CPU
reference; `test_layer_norm_replay_matches_aten_gpu` closes the loop by checking the replay on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.gated_residual import gated_residual_reference
from flux_runtime.kernels.layer_norm_modulate import (
    VARIANTS,
    _fold_lanes,
    layer_norm_modulate_reference,
    layer_norm_modulate_triton,
    residual_layer_norm_modulate_reference,
    residual_layer_norm_modulate_triton,
)
from flux_runtime.kernels.modulate import modulate_reference
from flux_runtime.kernels.triton_utils import jit, tl
from tests.kernels.aten_replay import _shuffle_down_tree, _welford_combine, layer_norm_replay
from tests.kernels.helpers import (
    DTYPES,
    FLUX_ROWS,
    ODD_ROWS,
    activations,
    gpu,
    interpreter,
    modulated_rows,
    modulation,
    row_id,
)

EPS = 1e-6
# (B, L, D): both FLUX widths (every aten thread full) and the odd width (trailing threads short)
CPU_ROWS = [(1, 2, 3072), (1, 2, 6144), (2, 3, 1000)]


def replayed(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return modulate_reference(layer_norm_replay(x, EPS), shift, scale)


def residual_inputs(shape: tuple[int, int, int], dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """(residual, gate, update, shift, scale) at a (B, L, D) site: gate, shift and scale (B, D) chunks of one
    modulation."""
    b, _, d = shape
    shift, scale, gate = modulation(b, d, dtype, device)[:3]
    return activations(shape, dtype, device) * 4, gate, activations(shape, dtype, device), shift, scale


def assert_residual_replayed(
    residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
    variant: str, rows_per_program: int,
) -> None:  # fmt: skip
    """The residual kernel's r equals the gated residual's, its y aten's LayerNorm of r (replayed), modulated."""
    r, y = residual_layer_norm_modulate_triton(
        residual, gate, update, shift, scale, EPS, variant=variant, rows_per_program=rows_per_program
    )
    r_ref = gated_residual_reference(residual, gate, update)
    assert torch.equal(r, r_ref)
    assert torch.equal(y, replayed(r_ref, shift, scale))


@interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_ROWS, ids=row_id)
def test_layer_norm_modulate_interpreter_replays_aten(
    shape: tuple[int, int, int], dtype: torch.dtype, variant: str
) -> None:
    x, shift, scale = modulated_rows(shape, dtype, "cpu")
    out = layer_norm_modulate_triton(x, shift, scale, EPS, variant=variant, rows_per_program=4)
    assert torch.equal(out, replayed(x, shift, scale))


@interpreter
@pytest.mark.parametrize("rows_per_program", [1, 2])
def test_layer_norm_modulate_v2_rows_per_program(rows_per_program: int) -> None:
    """v2 with one and two rows per program (its GPU defaults), a batch of 2 and a partial last program."""
    x, shift, scale = modulated_rows((2, 3, 3072), torch.bfloat16, "cpu")
    out = layer_norm_modulate_triton(x, shift, scale, EPS, variant="v2", rows_per_program=rows_per_program)
    assert torch.equal(out, replayed(x, shift, scale))


@jit
def _fold_kernel(mean_ptr, m2_ptr, count_ptr, out_ptr, ROWS: tl.constexpr, EVEN: tl.constexpr):
    """Run v2's fold on lane states (128, ROWS); write the rows' means, then their m2."""
    offs = tl.arange(0, 128)[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
    mean = tl.load(mean_ptr + offs)
    m2 = tl.load(m2_ptr + offs)
    count = tl.load(count_ptr + offs)
    mean, m2 = _fold_lanes(mean, m2, count, ROWS, EVEN)
    tl.store(out_ptr + tl.arange(0, ROWS), mean)
    tl.store(out_ptr + ROWS + tl.arange(0, ROWS), m2)


@interpreter
@pytest.mark.parametrize("counts", ["equal", "mixed"])
def test_fold_lanes_replays_aten_tree(counts: str) -> None:
    """v2's fold alone equals aten's tree on lane states that expose the operand order: rows of
    subnormal means (halving them rounds, so `fma(a, 0.5, 0.5 * b)` is not symmetric) beside rows of
    normal ones, and, for unequal counts, empty lanes and counts from 0 to 48 (the general combine)."""
    rows = 8
    tiny = torch.finfo(torch.float32).tiny
    mean = torch.randn(rows, 128) * torch.tensor([1.0, tiny / 8]).repeat(rows // 2)[:, None]
    m2 = torch.rand(rows, 128) * torch.where(torch.rand(rows, 128) < 0.5, 3.0, tiny)
    if counts == "equal":
        count = torch.full((rows, 128), 24.0)
    else:
        count = torch.randint(0, 49, (rows, 128)).float()
        mean, m2 = mean * (count > 0), m2 * (count > 0)
    ref_mean, ref_m2, _ = _shuffle_down_tree((mean, m2, count), _welford_combine)
    out = torch.empty(2 * rows)
    lanes_first = [t.T.contiguous() for t in (mean, m2, count)]
    _fold_kernel[(1,)](*lanes_first, out, ROWS=rows, EVEN=counts == "equal")
    assert torch.equal(out[:rows].view(torch.int32), ref_mean.view(torch.int32))
    assert torch.equal(out[rows:].view(torch.int32), ref_m2.view(torch.int32))


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_interpreter_close_to_cpu_aten(dtype: torch.dtype) -> None:
    """Without modulation the output is the LayerNorm itself, close to aten's CPU kernel.

    The two reduce in different orders, so mean and rstd differ in their last fp32 bits: about one
    output ulp, plus rstd * ulp(mean) where x - mean cancels (outputs near zero).
    """
    b, n, d = 2, 2, 3072
    zero = torch.zeros(b, d, dtype=dtype)
    x = activations((b, n, d), dtype, "cpu")
    out = layer_norm_modulate_triton(x, zero, zero, EPS, rows_per_program=4)
    ref = layer_norm_modulate_reference(x, zero, zero, EPS)
    torch.testing.assert_close(out.float(), ref.float(), rtol=torch.finfo(dtype).eps, atol=2**-16)
    assert (out == ref).float().mean() > 0.99


@interpreter
def test_layer_norm_replay_is_not_a_generic_layer_norm() -> None:
    """The replay (and so the kernel) pins one reduction tree: a two-pass fp32 LayerNorm differs."""
    x = (torch.randn(16, 3072) * 0.05 + 37.0).bfloat16()
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    two_pass = ((xf - mean) * torch.rsqrt(((xf - mean) ** 2).mean(-1, keepdim=True) + EPS)).bfloat16()
    assert not torch.equal(layer_norm_replay(x, EPS), two_pass)


@interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_norm_modulate_strided_input(variant: str) -> None:
    """A non-contiguous x is copied by aten before its (vectorised) kernel: same bits here."""
    b, n, d = 2, 3, 512
    shift, scale = modulation(b, d, torch.bfloat16, "cpu")[:2]
    x = activations((b, 2 * n, d), torch.bfloat16, "cpu")[:, 1::2]
    out = layer_norm_modulate_triton(x, shift, scale, EPS, variant=variant, rows_per_program=2)
    assert torch.equal(out, replayed(x, shift, scale))


@interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 3072), (2, 3, 1000)], ids=row_id)
def test_residual_layer_norm_modulate_interpreter(
    shape: tuple[int, int, int], dtype: torch.dtype, variant: str
) -> None:
    residual, gate, update, shift, scale = residual_inputs(shape, dtype, "cpu")
    assert_residual_replayed(residual, gate, update, shift, scale, variant, 4)


@interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_residual_layer_norm_modulate_subnormal_residual(variant: str) -> None:
    """r is written exactly also where it is subnormal; the LayerNorm of such a row is still defined."""
    tiny = torch.finfo(torch.bfloat16).tiny
    residual = (torch.randn(1, 2, 512) * tiny).bfloat16()
    update = (torch.randn(1, 2, 512) * tiny).bfloat16()
    shift, scale, gate = modulation(1, 512, torch.bfloat16, "cpu")[:3]
    assert_residual_replayed(residual, gate, update, shift, scale, variant, 2)


@interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_residual_layer_norm_modulate_token_slices(variant: str) -> None:
    """Final layer: image-token slices of the joint stream (batch stride (L_txt + L_img) * D)."""
    b, n_txt, n_img, d = 2, 2, 3, 1024
    shift, scale, gate = modulation(b, d, torch.bfloat16, "cpu", chunks=3)
    joint_res = activations((b, n_txt + n_img, d), torch.bfloat16, "cpu")
    joint_upd = activations((b, n_txt + n_img, d), torch.bfloat16, "cpu")
    res, upd = joint_res[:, n_txt:], joint_upd[:, n_txt:]
    assert_residual_replayed(res, gate, upd, shift, scale, variant, 2)


@interpreter
def test_layer_norm_modulate_guards_name_the_problem() -> None:
    shift = torch.zeros(1, 3072, dtype=torch.bfloat16)
    x = torch.zeros(1, 2, 3072, dtype=torch.bfloat16)
    misaligned = torch.zeros(2 * 3072 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 3072)
    with pytest.raises(UnsupportedInput, match="unvectorised"):
        layer_norm_modulate_triton(misaligned, shift, shift)
    with pytest.raises(UnsupportedInput, match="multiple of 4"):
        layer_norm_modulate_triton(x[..., :3070], shift[:, :3070], shift[:, :3070])
    wide = torch.zeros(1, 1, 8704, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="maximum fused width 8192"):
        layer_norm_modulate_triton(wide, wide[0], wide[0])
    with pytest.raises(UnsupportedInput, match="bf16/fp16"):
        residual_layer_norm_modulate_triton(x.float(), shift.float(), x.float(), shift.float(), shift.float())
    with pytest.raises(ValueError, match="unknown variant 'v3'"):
        layer_norm_modulate_triton(x, shift, shift, variant="v3")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_ROWS, ids=row_id)
def test_layer_norm_modulate_gpu_bit_exact(
    shape: tuple[int, int, int], dtype: torch.dtype, variant: str
) -> None:
    x, shift, scale = modulated_rows(shape, dtype, "cuda")
    out = layer_norm_modulate_triton(x, shift, scale, EPS, variant=variant)
    assert torch.equal(out, layer_norm_modulate_reference(x, shift, scale, EPS))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_ROWS, ids=row_id)
def test_residual_layer_norm_modulate_gpu_bit_exact(
    shape: tuple[int, int, int], dtype: torch.dtype, variant: str
) -> None:
    residual, gate, update, shift, scale = residual_inputs(shape, dtype, "cuda")
    r, y = residual_layer_norm_modulate_triton(residual, gate, update, shift, scale, EPS, variant=variant)
    r_ref, y_ref = residual_layer_norm_modulate_reference(residual, gate, update, shift, scale, EPS)
    assert torch.equal(r, r_ref)
    assert torch.equal(y, y_ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4096, 3072), (2, 4608, 6144), ODD_ROWS], ids=row_id)
def test_layer_norm_replay_matches_aten_gpu(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The algorithm read from aten is the one torch runs on this GPU.

    If this fails, the kernel's failure is in the reading of aten, not in Triton.
    """
    x = activations(shape, dtype, "cuda")
    assert torch.equal(layer_norm_replay(x, EPS), F.layer_norm(x, (shape[-1],), None, None, EPS))
