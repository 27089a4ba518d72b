"""Fused QK RMSNorm + RoPE + joint text/image layout.

On the GPU the kernel must equal the eager chain (`torch.equal`). On the CPU, aten's RMSNorm reduces
differently from its CUDA kernel, so the interpreter is checked bit-exactly against `rms_norm_replay`
(aten's CUDA algorithm in fp32 torch ops) followed by the reference RoPE, and within one ulp of the
CPU reference; `test_rms_norm_replay_matches_aten_gpu` checks the replay itself on CUDA.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import UnsupportedInput, use_fused
from flux_runtime.kernels.qk_norm_rope import (
    HEAD_MAJOR_DEFAULT,
    VARIANTS,
    _lane_tree_sum,
    empty_heads,
    head_major_layout,
    is_head_major,
    qk_norm_rope_reference,
    qk_norm_rope_triton,
    rope_reference,
    set_head_major,
)
from flux_runtime.kernels.triton_utils import jit, tl
from tests.kernels.aten_replay import _shuffle_down_tree, rms_norm_replay
from tests.kernels.helpers import (
    DTYPES,
    FLUX_QK,
    assert_within_one_ulp,
    gpu,
    interpreter,
    rope_tables,
    row_id,
)

QK = importlib.import_module("flux_runtime.kernels.qk_norm_rope")  # the package's name is the op
EPS = 1e-6
# (B, L_txt, L_img, H): double block, single block (no text), odd head count with a masked head block
CPU_QK = [(1, 2, 3, 24), (1, 0, 3, 48), (2, 3, 2, 3)]


def head_states(
    b: int, n: int, h: int, dtype: torch.dtype, device: str, packed: bool, head_major: bool = False
) -> Tensor:
    """(B, L, H, 128) projections; `packed` gives a q-slice view of a fused (B, L, 3, H, 128) output,
    `head_major` a view of (B, H, L, 128) storage (an input already laid out for SDPA)."""
    if packed:
        x = torch.randn(b, n, 3, h, 128, device=device)[:, :, 0]
    else:
        x = torch.randn(b, n, h, 128, device=device)
    scale = torch.rand(b, n, h, 1, device=device) * 8 + 0.1  # per-head magnitudes, as after a GEMM
    x = (x * scale).to(dtype)
    return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) if head_major else x


QKArgs = tuple[Tensor | None, Tensor, Tensor | None, Tensor, Tensor, Tensor]


def inputs(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str,
    packed: bool = False,
    head_major: bool = False,
) -> QKArgs:
    """(x_txt, x_img, weight_txt, weight_img, cos, sin) for one attention call."""
    b, n_txt, n_img, h = shape
    x_img = head_states(b, n_img, h, dtype, device, packed, head_major)
    w_img = (torch.rand(128, device=device) * 2).to(dtype)
    x_txt = head_states(b, n_txt, h, dtype, device, packed, head_major) if n_txt else None
    w_txt = (torch.rand(128, device=device) * 2).to(dtype) if n_txt else None
    cos, sin = rope_tables(n_txt + n_img, device)
    return x_txt, x_img, w_txt, w_img, cos, sin


def replayed(
    x_txt: Tensor | None, x_img: Tensor, w_txt: Tensor | None, w_img: Tensor, cos: Tensor, sin: Tensor
) -> Tensor:
    x = rms_norm_replay(x_img, w_img, EPS)
    if x_txt is not None and w_txt is not None:
        x = torch.cat([rms_norm_replay(x_txt, w_txt, EPS), x], dim=1)
    return rope_reference(x, cos, sin)


@interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_QK, ids=row_id)
def test_qk_norm_rope_interpreter_replays_aten(
    shape: tuple[int, int, int, int], dtype: torch.dtype, variant: str
) -> None:
    args = inputs(shape, dtype, "cpu", packed=shape[0] == 2)
    # 16 heads, 4 tokens per program: masked heads (H 3, 24) and tokens (L 5) in the last programs
    out = qk_norm_rope_triton(*args, EPS, variant=variant, heads_per_program=16, tokens_per_program=4)
    assert out.shape == (shape[0], shape[1] + shape[2], shape[3], 128)
    assert out.permute(0, 2, 1, 3).is_contiguous()  # stored head-major: (B, H, L, 128) contiguous
    assert torch.equal(out, replayed(*args))


@interpreter
def test_qk_norm_rope_v2_gpu_tiling() -> None:
    """v2 with its GPU tile (8 tokens x 8 heads): text and image tokens in one program, batch 2."""
    args = inputs((2, 5, 6, 8), torch.bfloat16, "cpu", packed=True)
    out = qk_norm_rope_triton(*args, EPS, variant="v2", heads_per_program=8, tokens_per_program=8)
    assert torch.equal(out, replayed(*args))


def stored_head_major(t: Tensor) -> bool:
    """Whether (B, L, H, D) `t` is a view of (B, H, L, D) contiguous storage."""
    return t.permute(0, 2, 1, 3).is_contiguous()


@interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("layout", ["contiguous", "packed", "head-major-in"])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 0, 7, 3)], ids=row_id)
def test_qk_norm_rope_writes_the_layout_asked_for(
    shape: tuple[int, int, int, int], layout: str, head_major: bool, variant: str
) -> None:
    """Both variants write through the output's strides: head-major storage behind the (B, L, H, 128) view, or
    (B, L, H, 128) contiguous (the layout before), with the reference's strides and the same values either way,
    from contiguous, packed (strided) or head-major inputs; masked heads (H 5, 3) and tokens (L 7)."""
    args = inputs(
        shape, torch.bfloat16, "cpu", packed=layout == "packed", head_major=layout == "head-major-in"
    )
    tiles = dict(variant=variant, heads_per_program=2, tokens_per_program=4)
    out = qk_norm_rope_triton(*args, EPS, head_major, **tiles)
    ref = qk_norm_rope_reference(*args, EPS, head_major)
    assert stored_head_major(out) == head_major and out.is_contiguous() == (not head_major)
    assert out.stride() == ref.stride()
    assert torch.equal(out, replayed(*args))
    assert torch.equal(out, qk_norm_rope_triton(*args, EPS, not head_major, **tiles))


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 0, 7, 3)], ids=row_id)
def test_reference_layout_keeps_the_values(shape: tuple[int, int, int, int]) -> None:
    """The reference (what the CPU and the `off` tier run) casts back into the head-major storage directly:
    the same bits as its contiguous result; the op returns what the reference returns off the GPU."""
    args = inputs(shape, torch.bfloat16, "cpu", packed=True)
    head = qk_norm_rope_reference(*args, EPS, True)
    token = qk_norm_rope_reference(*args, EPS, False)
    assert stored_head_major(head) and token.is_contiguous()
    assert torch.equal(head, token)
    with use_fused("lossless"):  # the CPU runs the reference
        assert QK.qk_norm_rope(*args, EPS, True).stride() == head.stride()
        assert QK.qk_norm_rope(*args, EPS, False).stride() == token.stride()
    assert QK.qk_norm_rope(*args, EPS).stride() == head.stride()  # the default is head-major


def test_head_major_setting() -> None:
    """`set_head_major` / `head_major_layout` set which of q, k, v the models store head-major; k and v by
    default (`HEAD_MAJOR_DEFAULT`)."""

    def roles() -> list[bool]:
        return [is_head_major(r) for r in "qkv"]

    assert roles() == [False, True, True]
    with head_major_layout(True):
        assert roles() == [True, True, True]
    with head_major_layout(False):
        assert roles() == [False, False, False]
        with head_major_layout("kv"):
            assert roles() == [False, True, True]
        assert roles() == [False, False, False]
    assert roles() == [False, True, True]
    set_head_major("q")
    try:
        assert roles() == [True, False, False]
    finally:
        set_head_major(HEAD_MAJOR_DEFAULT)
    assert roles() == [False, True, True]
    with pytest.raises(ValueError, match="roles other than"):
        set_head_major("qx")
    with pytest.raises(ValueError, match="unknown role"):
        is_head_major("o")
    heads = empty_heads(2, 5, 3, 128, dtype=torch.bfloat16, device=torch.device("cpu"), head_major=True)
    assert heads.shape == (2, 5, 3, 128) and stored_head_major(heads)
    assert empty_heads(
        2, 5, 3, 128, dtype=torch.bfloat16, device=torch.device("cpu"), head_major=False
    ).is_contiguous()


@jit
def _tree_sum_kernel(total_ptr, out_ptr, TOKS: tl.constexpr, HB: tl.constexpr):
    """Run v2's lane tree on lane totals (TOKS, HB, 32) and write the (TOKS, HB) sums."""
    rows = tl.arange(0, TOKS)[:, None] * HB + tl.arange(0, HB)[None, :]
    total = tl.load(total_ptr + rows[:, :, None] * 32 + tl.arange(0, 32)[None, None, :])
    tl.store(out_ptr + rows, _lane_tree_sum(total, TOKS, HB))


@interpreter
def test_lane_tree_sum_replays_aten_tree() -> None:
    """The order of v2's additions is aten's: random lane totals of very different sizes make the
    fp32 sum depend on it (an end-to-end bf16 output rarely shows a last-bit change of rstd)."""
    toks, hb = 4, 8
    total = torch.rand(toks * hb, 32) * 2.0 ** torch.randint(-20, 20, (toks * hb, 32)).float()
    padded = torch.cat([total, torch.zeros(toks * hb, 96)], dim=1)  # aten's idle warps 1-3
    (ref,) = _shuffle_down_tree((padded,), lambda b, a: (b[0] + a[0],))
    out = torch.empty(toks * hb)
    _tree_sum_kernel[(1,)](total, out, TOKS=toks, HB=hb)
    assert torch.equal(out, ref)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_interpreter_within_one_ulp_of_cpu_aten(dtype: torch.dtype) -> None:
    """With the identity rotation (cos 1, sin 0) the output is the RMSNorm: at most 1 ulp from aten's
    CPU kernel, which reduces in another order."""
    x_txt, x_img, w_txt, w_img, cos, _ = inputs((2, 2, 3, 24), dtype, "cpu")
    one, zero = torch.ones_like(cos), torch.zeros_like(cos)
    out = qk_norm_rope_triton(x_txt, x_img, w_txt, w_img, one, zero, EPS, heads_per_program=8)
    ref = qk_norm_rope_reference(x_txt, x_img, w_txt, w_img, one, zero, EPS)
    assert_within_one_ulp(out, ref)


@interpreter
def test_qk_norm_rope_guards_name_the_problem() -> None:
    x_txt, x_img, w_txt, w_img, cos, sin = inputs((1, 2, 3, 2), torch.bfloat16, "cpu")
    with pytest.raises(UnsupportedInput, match="fp32"):
        qk_norm_rope_triton(x_txt, x_img, w_txt, w_img, cos.double(), sin, EPS)
    with pytest.raises(UnsupportedInput, match=r"cos must be \(5, 128\)"):
        qk_norm_rope_triton(x_txt, x_img, w_txt, w_img, cos[:4], sin, EPS)
    with pytest.raises(UnsupportedInput, match="one dtype"):
        qk_norm_rope_triton(x_txt, x_img, w_txt, w_img.float(), cos, sin, EPS)
    with pytest.raises(UnsupportedInput, match=r"\(B, L, H, 128\)"):
        qk_norm_rope_triton(None, x_img[..., :64], None, w_img[:64], cos[:3], sin[:3], EPS)
    with pytest.raises(UnsupportedInput, match="both be given"):
        qk_norm_rope_triton(x_txt, x_img, None, w_img, cos, sin, EPS)
    with pytest.raises(ValueError, match="unknown variant 'v3'"):
        qk_norm_rope_triton(x_txt, x_img, w_txt, w_img, cos, sin, EPS, variant="v3")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("packed", [False, True], ids=["contiguous", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_QK, ids=row_id)
def test_qk_norm_rope_gpu_bit_exact(
    shape: tuple[int, int, int, int], dtype: torch.dtype, packed: bool, variant: str
) -> None:
    args = inputs(shape, dtype, "cuda", packed)
    out = qk_norm_rope_triton(*args, EPS, variant=variant)
    ref = qk_norm_rope_reference(*args, EPS)
    assert torch.equal(out, ref)
    assert stored_head_major(out) and out.stride() == ref.stride()  # what SDPA reads contiguously


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize(
    "shape", [(1, 512, 4096, 24), (2, 0, 4608, 24), (1, 512, 4096, 48), (2, 3, 5, 3)], ids=row_id
)
def test_qk_norm_rope_gpu_layouts(shape: tuple[int, int, int, int], head_major: bool, variant: str) -> None:
    """Both layouts (`set_head_major`'s A/B) at FLUX sites: bit-exact, the reference's strides, equal to each other."""
    args = inputs(shape, torch.bfloat16, "cuda", packed=True)
    out = qk_norm_rope_triton(*args, EPS, head_major, variant=variant)
    ref = qk_norm_rope_reference(*args, EPS, head_major)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    assert stored_head_major(out) == head_major and out.is_contiguous() == (not head_major)
    assert torch.equal(out, qk_norm_rope_triton(*args, EPS, not head_major, variant=variant))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4608, 24), (2, 4544, 48), (2, 7, 3)], ids=row_id)
def test_rms_norm_replay_matches_aten_gpu(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The RMSNorm read from aten is what `F.rms_norm` runs on this GPU."""
    b, n, h = shape
    x = head_states(b, n, h, dtype, "cuda", packed=False)
    w = (torch.rand(128, device="cuda") * 2).to(dtype)
    assert torch.equal(rms_norm_replay(x, w, EPS), F.rms_norm(x, (128,), w, EPS))
