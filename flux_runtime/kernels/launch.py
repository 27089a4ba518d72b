"""The host side of the fused kernels' launches: input guards, outputs, grids.

Every guard raises `UnsupportedInput` naming the op and the problem, so `dispatch` runs the reference instead
and reports why. The device side (rounding helpers, tiles) is `triton_utils`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.triton_utils import HAS_TRITON, INTERPRET, ON_GPU, tl, triton

HALF_DTYPES = (torch.bfloat16, torch.float16)
# What every exact kernel's launch passes: its `GPU` constexpr (the hardware instructions, or their interpreter
# equivalents) and no FMA contraction across the ops that eager rounds apart (`triton_utils`' exactness rules).
EXACT: dict[str, Any] = {"GPU": ON_GPU, "enable_fp_fusion": False}


def triton_dtype(dtype: torch.dtype) -> Any:
    """The Triton element type of a bf16/fp16 torch dtype."""
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def check_launchable(op: str, *tensors: Tensor) -> None:
    """Triton present, all tensors on one CUDA device (CPU tensors only under the interpreter)."""
    if not HAS_TRITON:
        raise UnsupportedInput(f"{op}: Triton is not importable")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise UnsupportedInput(f"{op}: inputs on several devices {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not (INTERPRET and device.type == "cpu"):
        raise UnsupportedInput(f"{op}: needs CUDA tensors, got device {device.type}")
    if device.type == "cuda" and torch.version.hip is not None:
        raise UnsupportedInput(f"{op}: the kernels use NVIDIA PTX; ROCm is not supported")


def check_half(op: str, **tensors: Tensor) -> torch.dtype:
    """All named tensors share one dtype, bf16 or fp16; returns it."""
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        got = ", ".join(f"{name} {t.dtype}" for name, t in tensors.items())
        raise UnsupportedInput(f"{op}: expected one dtype for all inputs, got {got}")
    dtype = dtypes.pop()
    if dtype not in HALF_DTYPES:
        raise UnsupportedInput(f"{op}: expected bf16/fp16 tensors, got {dtype}")
    return dtype


def check_inputs(op: str, *others: Tensor, **tensors: Tensor) -> torch.dtype:
    """`check_launchable` of all the tensors and `check_half` of the named ones: returns their dtype."""
    check_launchable(op, *tensors.values(), *others)
    return check_half(op, **tensors)


def optional_stream(op: str, **tensors: Tensor | None) -> dict[str, Tensor]:
    """The tensors of an optional stream (the text stream of a joint op): all given, returned by name, or all
    None, an empty dict."""
    given = {name: t for name, t in tensors.items() if t is not None}
    if given and len(given) != len(tensors):
        names = list(tensors)
        each = "both" if len(names) == 2 else "all"
        listed = f"{', '.join(names[:-1])} and {names[-1]}"
        raise UnsupportedInput(f"{op}: {listed} must {each} be given or {each} be None")
    return given


def check_joins(op: str, name: str, t: Tensor, other_name: str, other: Tensor) -> int:
    """`t` joins `other` along dim 1 (a text stream before the image's): the same shape but for that dim.
    Returns its length there."""
    if t.ndim != other.ndim or t.shape[0] != other.shape[0] or t.shape[2:] != other.shape[2:]:
        raise UnsupportedInput(
            f"{op}: {name} {tuple(t.shape)} does not match {other_name} {tuple(other.shape)}"
        )
    return t.shape[1]


def check_shape(op: str, name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    """`t.shape == shape`."""
    if tuple(t.shape) != shape:
        raise UnsupportedInput(f"{op}: {name} must be {shape}, got {tuple(t.shape)}")


def check_unit_stride(op: str, name: str, t: Tensor) -> None:
    """The last dim is dense (stride 1); other strides are passed to the kernel."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise UnsupportedInput(f"{op}: {name} needs a unit last stride, got strides {t.stride()}")


def check_int32_offsets(op: str, name: str, t: Tensor) -> None:
    """Every element offset of `t` fits the kernels' int32 index arithmetic."""
    span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    if span >= 2**31:
        raise UnsupportedInput(f"{op}: {name} spans {span} elements; the kernel indexes with int32")


def check_strided(op: str, shape: tuple[int, ...] | None = None, **tensors: Tensor) -> None:
    """Each named tensor (`shape`, where given) is read through its strides: a unit last stride, and every
    element offset fits int32."""
    for name, t in tensors.items():
        if shape is not None:
            check_shape(op, name, t, shape)
        check_unit_stride(op, name, t)
        check_int32_offsets(op, name, t)


def check_bld(op: str, name: str, t: Tensor) -> tuple[int, int, int]:
    """`t` is a non-empty (B, L, D) tensor read through its strides (`check_strided`); returns (B, L, D)."""
    if t.ndim != 3 or t.numel() == 0:
        raise UnsupportedInput(f"{op}: {name} must be a non-empty (B, L, D) tensor, got {tuple(t.shape)}")
    check_strided(op, **{name: t})
    b, length, d = t.shape
    return b, length, d


def check_aten_vectorized(op: str, name: str, t: Tensor) -> None:
    """aten's vectorised norm kernel (the one replicated) needs a 4-element-aligned buffer.

    A non-contiguous input is copied by aten first (a fresh, aligned buffer); a contiguous one is used
    in place, and if its data pointer is misaligned aten runs a different kernel with other numerics.
    """
    if t.is_contiguous() and t.data_ptr() % (4 * t.element_size()) != 0:
        raise UnsupportedInput(f"{op}: {name} is not 4-element aligned, so aten takes its unvectorised path")


def empty_out(op: str, shape: tuple[int, ...], like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A new contiguous output on `like`'s device, of its dtype unless `dtype` is given, indexable with int32."""
    out = torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)
    check_int32_offsets(op, "out", out)
    return out


def row_tiles(b: int, length: int, n: int, block_l: int, block_n: int) -> tuple[int, int, int]:
    """The grid of `row_tile` and `batch_row_tile` over (B, L, N): (cdiv(L, block_l), cdiv(N, block_n), B)."""
    return triton.cdiv(length, block_l), triton.cdiv(n, block_n), b


def check_out(op: str, out: Tensor, shape: tuple[int, ...]) -> None:
    """A preallocated output: the result's shape, a unit last stride (other strides are passed on)."""
    check_shape(op, "out", out, shape)
    check_unit_stride(op, "out", out)


def check_into(op: str, x: Tensor, out: Tensor | None, shape: tuple[int, ...]) -> None:
    """Guards of an op that reads non-empty bf16/fp16 `x` and writes `shape` into a new tensor or `out`
    (`check_out`, and no memory shared with `x`)."""
    check_inputs(op, **({"x": x} if out is None else {"x": x, "out": out}))
    if x.numel() == 0:
        raise UnsupportedInput(f"{op}: empty input {tuple(x.shape)}")
    if out is not None:
        check_out(op, out, shape)
        check_no_overlap(op, x, out)


def check_no_overlap(op: str, x: Tensor, out: Tensor) -> None:
    """`out` shares no memory with `x` (the reference computes first and copies; the kernel streams)."""

    def span(t: Tensor) -> tuple[int, int]:
        start = t.data_ptr()
        extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
        return start, start + extent * t.element_size()

    if x.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
        return
    (a0, a1), (b0, b1) = span(x), span(out)
    if a0 < b1 and b0 < a1:
        raise UnsupportedInput(f"{op}: out overlaps the input's memory")


def as_rows(op: str, name: str, t: Tensor) -> Tensor:
    """`t` (..., N) as a (B, L, N) view with unit last stride, for row-strided kernels."""
    check_unit_stride(op, name, t)
    if t.ndim <= 3:
        return t.reshape((1,) * (3 - t.ndim) + tuple(t.shape))
    try:
        return t.view(-1, *t.shape[-2:])
    except RuntimeError:
        raise UnsupportedInput(
            f"{op}: {name}'s leading dims {tuple(t.shape[:-2])} cannot be merged (strides {t.stride()})"
        ) from None


def rows_pair(op: str, x: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
    """`x` and `out` as (B, L, N) views (`as_rows`), each indexable with int32."""
    x3, out3 = as_rows(op, "x", x), as_rows(op, "out", out)
    check_int32_offsets(op, "x", x3)
    check_int32_offsets(op, "out", out3)
    return x3, out3


def launch_rows(
    kernel: Any, x3: Tensor, out3: Tensor, n: int, block_l: int, block_n: int, **consts: Any
) -> None:
    """Launch a row-tiled elementwise kernel `(x_ptr, out_ptr, L, N, stride_xb, stride_xl, stride_ob, stride_ol,
    ..., BLOCK_L, BLOCK_N, GPU)` over (B, L, N) `out3` (`row_tile`); `consts` its other constexprs and options."""
    b, length, _ = out3.shape
    kernel[row_tiles(b, length, n, block_l, block_n)](
        x3, out3, length, n, x3.stride(0), x3.stride(1), out3.stride(0), out3.stride(1),
        BLOCK_L=block_l, BLOCK_N=block_n, **EXACT, **consts,
    )  # fmt: skip
