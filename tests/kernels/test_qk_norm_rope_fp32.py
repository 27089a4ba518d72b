"""Fused fp32 QK RMSNorm + RoPE of q and k (FLUX.3's attention), one cast back.

On the GPU the kernel must equal the eager chain (`torch.equal`) at FLUX.3's shapes. On the CPU, aten's
RMSNorm reduces differently from its CUDA kernel, so the interpreter is checked bit-exactly against
`rms_norm_replay` (aten's CUDA algorithm, here on the fp32 upcast with the fp32 weight) followed by the
reference RoPE and cast; `test_fp32_rms_norm_replay_matches_aten_gpu` checks that replay on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.qk_norm_rope import rope_reference
from flux_runtime.kernels.qk_norm_rope_fp32 import qk_norm_rope_fp32_reference, qk_norm_rope_fp32_triton
from tests.kernels.aten_replay import rms_norm_replay
from tests.kernels.helpers import (
    DTYPES,
    FLUX3_HEADS,
    FLUX3_SEQ_LENS,
    gpu,
    interpreter,
    rope_tables,
    row_id,
    ulp_distance,
)

EPS = 1e-6
# (B, L, H): FLUX.3's 24 heads; a batch of 2 with an odd head count (masked heads, masked tokens)
CPU_QK = [(1, 5, FLUX3_HEADS), (2, 3, 3)]

Args = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def inputs(b: int, n: int, h: int, dtype: torch.dtype, device: str, packed: bool) -> Args:
    """(q, k, weight_q, weight_k, cos, sin): `packed` gives q/k slices of one (B, L, 3 * H * 128) projection,
    otherwise each is its own projection output, as FLUX.3's separate q/k/v GEMMs give."""
    scale = torch.rand(b, n, 1, h, 1, device=device) * 8 + 0.1  # per-head magnitudes, as after a GEMM
    if packed:
        qkv = (torch.randn(b, n, 3, h, 128, device=device) * scale).to(dtype)
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        q, k = ((torch.randn(b, n, 1, h, 128, device=device) * scale)[:, :, 0].to(dtype) for _ in range(2))
    w_q, w_k = (torch.rand(128, device=device) * 2 for _ in range(2))  # fp32, as the model keeps them
    cos, sin = rope_tables(n, device)
    return q, k, w_q, w_k, cos, sin


def replayed(
    q: Tensor, k: Tensor, w_q: Tensor, w_k: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    return tuple(
        rope_reference(rms_norm_replay(x.float(), w, EPS), cos, sin).to(x.dtype)
        for x, w in ((q, w_q), (k, w_k))
    )  # type: ignore[return-value]


@interpreter
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_QK, ids=row_id)
def test_qk_norm_rope_fp32_interpreter_replays_aten(
    shape: tuple[int, int, int], dtype: torch.dtype, packed: bool
) -> None:
    args = inputs(*shape, dtype, "cpu", packed)
    # 16 heads, 4 tokens per program: masked heads (H 3, 24) and tokens (L 3, 5) in the last programs
    q, k = qk_norm_rope_fp32_triton(*args, EPS, heads_per_program=16, tokens_per_program=4)
    assert q.shape == k.shape == args[0].shape
    assert q.permute(0, 2, 1, 3).is_contiguous() and k.permute(0, 2, 1, 3).is_contiguous()  # head-major
    assert q.dtype == k.dtype == dtype
    ref_q, ref_k = replayed(*args)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


def stored_head_major(t: Tensor) -> bool:
    """Whether (B, L, H, D) `t` is a view of (B, H, L, D) contiguous storage."""
    return t.permute(0, 2, 1, 3).is_contiguous()


@interpreter
@pytest.mark.parametrize("major", [(True, True), (False, False), (False, True)], ids=["qk", "none", "k"])
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_qk_norm_rope_fp32_writes_the_layout_asked_for(packed: bool, major: tuple[bool, bool]) -> None:
    """q and k each stored head-major or (B, L, H, 128) contiguous as asked (`set_head_major`'s "kv" keeps q as
    before), with the reference's strides and the same values in any layout; masked heads and tokens."""
    args = inputs(2, 7, 5, torch.bfloat16, "cpu", packed)
    q, k = qk_norm_rope_fp32_triton(*args, EPS, *major, heads_per_program=2, tokens_per_program=4)
    ref_q, ref_k = qk_norm_rope_fp32_reference(*args, EPS, *major)
    for out, ref, head_major in ((q, ref_q, major[0]), (k, ref_k, major[1])):
        assert stored_head_major(out) == head_major and out.is_contiguous() == (not head_major)
        assert out.stride() == ref.stride()
    rep_q, rep_k = replayed(*args)
    assert torch.equal(q, rep_q) and torch.equal(k, rep_k)
    other_q, other_k = qk_norm_rope_fp32_triton(*args, EPS, *(not m for m in major))
    assert torch.equal(q, other_q) and torch.equal(k, other_k)


def test_fp32_reference_layout_keeps_the_values() -> None:
    """The reference casts back into head-major storage directly: the same bits as its contiguous result."""
    args = inputs(2, 7, 5, torch.bfloat16, "cpu", packed=True)
    head, token = (
        qk_norm_rope_fp32_reference(*args, EPS),
        qk_norm_rope_fp32_reference(*args, EPS, False, False),
    )
    for h, t in zip(head, token, strict=True):
        assert stored_head_major(h) and t.is_contiguous() and torch.equal(h, t)


@interpreter
def test_qk_norm_rope_fp32_gpu_tiling() -> None:
    """The GPU tile (8 tokens x 8 heads), batch 2: the q and k programs of both batches in one launch."""
    args = inputs(2, 11, 10, torch.bfloat16, "cpu", packed=True)
    q, k = qk_norm_rope_fp32_triton(*args, EPS)
    ref_q, ref_k = replayed(*args)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@interpreter
def test_norm_output_is_not_rounded_before_rope() -> None:
    """The FLUX.3 order differs from FLUX.1/2's: rounding the fp32 norm to bf16 before RoPE changes bits."""
    args = inputs(1, 4, FLUX3_HEADS, torch.bfloat16, "cpu", packed=False)
    q, _ = qk_norm_rope_fp32_triton(*args, EPS, heads_per_program=8, tokens_per_program=4)
    q_in, _, w_q, _, cos, sin = args
    rounded_first = rope_reference(rms_norm_replay(q_in.float(), w_q, EPS).to(q_in.dtype), cos, sin)
    assert not torch.equal(q, rounded_first)
    assert torch.equal(q, replayed(*args)[0])


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_fp32_interpreter_within_one_ulp_of_cpu_aten(dtype: torch.dtype) -> None:
    """Against the CPU reference itself (aten's CPU RMSNorm reduces in another order): at most 1 ulp."""
    args = inputs(1, 4, FLUX3_HEADS, dtype, "cpu", packed=False)
    out = qk_norm_rope_fp32_triton(*args, EPS)
    ref = qk_norm_rope_fp32_reference(*args, EPS)
    for o, r in zip(out, ref, strict=True):
        assert int(ulp_distance(o, r).max()) <= 1
        assert (o == r).float().mean() > 0.99


@interpreter
def test_qk_norm_rope_fp32_guards_name_the_problem() -> None:
    q, k, w_q, w_k, cos, sin = inputs(1, 3, 2, torch.bfloat16, "cpu", packed=False)
    with pytest.raises(UnsupportedInput, match="weight_q must be fp32"):
        qk_norm_rope_fp32_triton(q, k, w_q.bfloat16(), w_k, cos, sin, EPS)
    with pytest.raises(UnsupportedInput, match=r"cos must be \(3, 128\)"):
        qk_norm_rope_fp32_triton(q, k, w_q, w_k, cos[:2], sin, EPS)
    with pytest.raises(UnsupportedInput, match="one dtype"):
        qk_norm_rope_fp32_triton(q, k.half(), w_q, w_k, cos, sin, EPS)
    with pytest.raises(UnsupportedInput, match="bf16/fp16"):
        qk_norm_rope_fp32_triton(q.float(), k.float(), w_q, w_k, cos, sin, EPS)
    with pytest.raises(UnsupportedInput, match=r"k must be \(1, 3, 2, 128\)"):
        qk_norm_rope_fp32_triton(q, k[:, :2], w_q, w_k, cos, sin, EPS)
    with pytest.raises(UnsupportedInput, match=r"\(B, L, H, 128\)"):
        qk_norm_rope_fp32_triton(q[..., :64], k[..., :64], w_q, w_k, cos, sin, EPS)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("n", FLUX3_SEQ_LENS)
def test_qk_norm_rope_fp32_gpu_bit_exact(n: int, b: int, dtype: torch.dtype, packed: bool) -> None:
    args = inputs(b, n, FLUX3_HEADS, dtype, "cuda", packed)
    out = qk_norm_rope_fp32_triton(*args, EPS)
    ref = qk_norm_rope_fp32_reference(*args, EPS)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    for o, r in zip(out, ref, strict=True):  # stored head-major, what SDPA reads contiguously
        assert stored_head_major(o) and o.stride() == r.stride()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("major", [(False, False), (False, True)], ids=["none", "k"])
@pytest.mark.parametrize("n", [4096, 8672])
def test_qk_norm_rope_fp32_gpu_other_layouts(n: int, major: tuple[bool, bool]) -> None:
    """The layouts `set_head_major` can ask for besides the default: bit-exact, the reference's strides."""
    args = inputs(1, n, FLUX3_HEADS, torch.bfloat16, "cuda", packed=False)
    out = qk_norm_rope_fp32_triton(*args, EPS, *major)
    ref = qk_norm_rope_fp32_reference(*args, EPS, *major)
    for o, r, head_major in zip(out, ref, major, strict=True):
        assert torch.equal(o, r) and o.stride() == r.stride() and stored_head_major(o) == head_major


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096, 24), (1, 8672, 24), (2, 7, 3)], ids=row_id)
def test_fp32_rms_norm_replay_matches_aten_gpu(shape: tuple[int, int, int]) -> None:
    """The fp32 RMSNorm read from aten (fp32 input, fp32 weight) is what `F.rms_norm` runs on this GPU."""
    q, _, w, _, _, _ = inputs(*shape, torch.bfloat16, "cuda", packed=False)
    x = q.float()
    assert torch.equal(rms_norm_replay(x, w, EPS), F.rms_norm(x, (128,), w, EPS))
