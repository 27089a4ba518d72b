"""Shared device pieces of the fused Triton kernels: optional import, exact rounding helpers, tiles (the
launchers' input guards are in `launch`).

Exactness rules that every kernel here relies on:

- Each eager op rounds once to the storage dtype. `round_to` reproduces that rounding on an fp32
  value and hands back fp32, so the next op sees exactly what eager would have loaded.
- On the GPU `round_to` is the hardware `cvt.rn` conversion (round to nearest even). The Triton
  interpreter (CPU CI, `TRITON_INTERPRET=1`) truncates instead, so
  there the same rounding is done with integer bit operations, which are exact RNE for finite values.
- No FMA contraction across ops that eager ran separately: every launch passes
  `enable_fp_fusion=False`, and the code does not rely on it either: where a product feeds an add,
  the product goes through `mul_rn` (an opaque `mul.rn.f32` on the GPU) or is rounded to the storage
  dtype first, which blocks contraction. FMAs that aten's own SASS has are written as `tl.fma`.
- `rsqrtf` is CUDA's `rsqrt.approx.f32` (MUFU.RSQ with its subnormal rescale), called as inline PTX so
  the libdevice flush-to-zero setting Triton uses cannot change it.

Every kernel takes a `GPU: tl.constexpr` flag (False under the interpreter) that selects between the
hardware instruction and its interpreter equivalent at compile time.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # Triton is Linux-only; the references still work everywhere.
    triton = None
    tl = None
    HAS_TRITON = False

# Read once at import, like Triton itself does when it decorates the kernels.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Passed to every kernel as its `GPU` constexpr.
ON_GPU = not INTERPRET

F = TypeVar("F", bound=Callable[..., Any])


def jit(fn: F) -> F:
    """`triton.jit` when Triton is importable; otherwise the plain function, which is never launched."""
    return triton.jit(fn) if HAS_TRITON else fn


# --------------------------------------------------------------------------------------------------
# device helpers


@jit
def round_to(x, DTYPE: tl.constexpr, GPU: tl.constexpr):
    """Round fp32 `x` to the nearest-even `DTYPE` (bf16 or fp16) value and return it as fp32."""
    if GPU:
        y = x.to(DTYPE, fp_downcast_rounding="rtne").to(tl.float32)
    elif DTYPE.is_bf16():
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        # fp16: normal range rounds the mantissa to 10 bits; below 2^-14 the grid is 2^-24, which
        # an fp32 add of 0.5 (ulp 2^-24) rounds to, ties to even; past 65504 the result is inf.
        bits = x.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        mag = bits & 0x7FFFFFFF
        a = mag.to(tl.float32, bitcast=True)
        normal = ((mag + 0xFFF + ((mag >> 13) & 1)) & 0xFFFFE000).to(tl.float32, bitcast=True)
        normal = tl.where(normal > 65504.0, float("inf"), normal)
        sub = (a + 0.5) - 0.5
        r = tl.where(a < 6.103515625e-05, sub, normal)
        r = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        y = tl.where(x != x, x, r)
    return y


@jit
def to_storage(x, DTYPE: tl.constexpr, GPU: tl.constexpr):
    """Round fp32 `x` to nearest-even `DTYPE` and return a `DTYPE` tensor (for stores)."""
    if GPU:
        y = x.to(DTYPE, fp_downcast_rounding="rtne")
    elif DTYPE.is_bf16():
        # the interpreter's fp32 -> bf16 cast also mangles subnormals: move the top 16 bits instead
        bits = round_to(x, DTYPE, GPU).to(tl.uint32, bitcast=True)
        bits = tl.where(x != x, 0x7FC00000, bits)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = round_to(x, DTYPE, GPU).to(DTYPE)  # exactly representable, so the cast is exact
    return y


@jit
def upcast(x, GPU: tl.constexpr):
    """bf16/fp16 `x` as fp32 (exact). The interpreter's bf16 -> fp32 cast loses subnormals."""
    if GPU:
        y = x.to(tl.float32)
    elif x.dtype.is_bf16():
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@jit
def mul_rn(a, b, GPU: tl.constexpr):
    """fp32 product rounded on its own: never contracted into an FMA with a following add."""
    if GPU:
        p = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        p = a * b
    return p


@jit
def rsqrtf(x, GPU: tl.constexpr):
    """CUDA `rsqrtf` as aten calls it (`rsqrt.approx.f32`); `1/sqrt` in the interpreter."""
    if GPU:
        y = tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        y = tl.math.rsqrt(x)
    return y


@jit
def e4m3_row_scale(amax):
    """A row's dynamic e4m3 scale from its absmax (fp32, any shape), as `fp8.quantize_reference` makes it:
    `max(amax, 1e-12) * fl32(1 / 448)` (a multiply: aten scales a CUDA tensor by a Python scalar with its
    reciprocal), and the scale's correctly rounded reciprocal."""
    s = tl.maximum(amax, 1e-12) * 0.002232142857142857
    return s, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@jit
def e4m3_code(v, HW: tl.constexpr):
    """The e4m3fn bit pattern (uint8) of fp32 `v`: clamped to ±448, rounded to nearest even.

    With `HW` (an sm_89+ GPU: `e4m3_consts`) the GPU's own conversion, `cvt.rn.satfinite.e4m3x2.f32`, two values
    an instruction: round to nearest even, finite values beyond ±448 and infinities saturated to ±448, which is
    the clamp followed by the cast. Otherwise integer operations: normal results (|v| >= 2^-6) round the fp32
    mantissa to 3 bits and rebias the exponent (127 → 7); below that the grid is 2^-9, which an fp32 add of 2^14
    (whose ulp is 2^-9) rounds to, ties to even. NaN stays NaN (0x7F; torch's casts do not agree on its sign
    bit, nor does it matter). Both give the same codes; the GPU tests compare each producer's codes with the
    eager clamp and cast, and `bench_fp8.py` times the two.
    """
    if HW:
        code = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        nan = v != v
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        bits = v.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        a = mag.to(tl.float32, bitcast=True)
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
        sub = (((a + 16384.0) - 16384.0) * 512.0).to(tl.uint32)
        code = tl.where(a >= 0.015625, normal, sub)
        code = tl.where(nan, 0x7F, code | sign).to(tl.uint8)
    return code


# `e4m3_code`'s conversion where the GPU has one (`set_e4m3_hardware`; the software path is kept for the A/B).
_E4M3_HARDWARE = [True]


def set_e4m3_hardware(flag: bool) -> bool:
    """Whether the FP8 producers convert to e4m3 with the GPU's instruction (sm_89+) or with integer operations;
    the codes are the same, only the time differs. Returns the previous setting (for a caller to restore)."""
    previous = _E4M3_HARDWARE[0]
    _E4M3_HARDWARE[0] = bool(flag)
    return previous


@contextmanager
def temporarily(setter: Callable[[Any], Any], value: Any) -> Iterator[None]:
    """`setter(value)` for the body, then `setter` of what it returned (the previous setting): the one shape of
    the kernels' A/B switches (`e4m3_hardware`, `fp8.act_block`, `gelu.gelu_shortcut`, `head_major_layout`),
    each a setter that returns the setting it replaced."""
    previous = setter(value)
    try:
        yield
    finally:
        setter(previous)


def e4m3_hardware(flag: bool) -> contextlib.AbstractContextManager[None]:
    """`set_e4m3_hardware(flag)` for the body, the previous setting restored after it."""
    return temporarily(set_e4m3_hardware, flag)


@functools.cache
def _has_e4m3_cvt(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def e4m3_consts(device: torch.device) -> dict[str, bool]:
    """The `HW_E4M3` constexpr of an FP8 producer's launch on `device`: the hardware conversion on an sm_89+
    GPU unless `set_e4m3_hardware(False)`; never under the interpreter."""
    hw = ON_GPU and _E4M3_HARDWARE[0] and device.type == "cuda"
    return {
        "HW_E4M3": bool(
            hw and _has_e4m3_cvt(device.index if device.index is not None else torch.cuda.current_device())
        )
    }


@jit
def row_tile(L, N, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of a (B, L, N) problem on the grid `row_tiles` makes: its batch (int64), its rows
    (BLOCK_L,) and columns (BLOCK_N,) and the (BLOCK_L, BLOCK_N) mask of the ones inside."""
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < L)[:, None] & (cols < N)[None, :]
    return b, rows, cols, mask


@jit
def batch_row_tile(L, D, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """`row_tile` for the kernels that also read one (B, D) row per batch: with the columns' own mask (BLOCK_D,).
    Its program ids are read in grid order (the instruction order these kernels compile to)."""
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = (rows < L)[:, None] & col_ok[None, :]
    return b, rows, cols, col_ok, mask


@jit
def split4(x4):
    """The elements of 4-element lane vectors, in order: `x4` (..., 2, 2) holds a lane's elements 0..3 in its
    last two dims; returns them as four (...) tensors."""
    x02, x13 = tl.split(x4)
    x0, x2 = tl.split(x02)
    x1, x3 = tl.split(x13)
    return x0, x1, x2, x3


@jit
def halves(v, R: tl.constexpr, W: tl.constexpr, K: tl.constexpr):
    """Split lanes `v` (R, W, 2K) into their lower (R, W, K) and upper (R, W, K) halves.

    One step of a CUDA shuffle-down tree with offset K: lane i < K of each group of 2K lanes
    combines its own value (lower) with lane i + K's (upper).
    """
    v = tl.reshape(v, (R, W, 2, K))
    v = tl.permute(v, (0, 1, 3, 2))
    return tl.split(v)
