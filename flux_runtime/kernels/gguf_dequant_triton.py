"""Fused dequantization of GGML blocks: one Triton kernel reads the uint8 blocks once and writes the weight in
the compute dtype, bit-identical to `gguf_dequant.dequantize(raw, qtype).to(dtype)` (a `lossless` kernel).

The reference takes many small torch ops per weight (bit unpacking, fp16 temporaries, then the cast); a GGUF
projection reads its weight on every forward, so that chain runs for each projection at each step.

How the kernel keeps the reference's bits:

- Every block's fp16 scales are read as fp16 and widened to fp32 exactly. Each elementwise step of the
  reference (`d * sub_scale`, `scale * q`, `- low`, `+ m`) is one fp16 op in torch: computed in fp32 and rounded
  to fp16 once. The kernel computes the same step in fp32 and rounds it to fp16 (`triton_utils.round_to`)
  before the next step reads it, so no two steps can fuse into an FMA (and launches pass
  `enable_fp_fusion=False` too). A product of an fp16 scale and an 8-bit code is exact in fp32, so its one
  rounding is the reference's; a difference or sum is rounded to fp32 first, as torch's fp32 opmath does.
- The final fp16 value is then cast to the output dtype inside the kernel, as the caller's `.to(dtype)` does
  (exact to fp32; round-to-nearest-even to bf16).

A program dequantizes `blocks` whole blocks: a (blocks, S, L) tile where a block's values fall into S groups of
L values that share one sub-block scale (S = 1 for the 32-value types). The bit layout of each type is the
reference's (`gguf_dequant`), read here per value: value j of a block takes its code from the byte and bit
position the reference's unpacking gives it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.gguf_dequant import GgmlType, dequantize
from flux_runtime.kernels.launch import EXACT, check_launchable
from flux_runtime.kernels.triton_utils import jit, round_to, tl, to_storage, triton

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# per type: (S, L) of the tile (sub-block scale groups x values in each) and the type's code in the kernel
LAYOUT: dict[str, tuple[int, int]] = {
    "Q8_0": (1, 32),
    "Q4_0": (1, 32),
    "Q4_1": (1, 32),
    "Q5_0": (1, 32),
    "Q5_1": (1, 32),
    "Q2_K": (16, 16),
    "Q3_K": (16, 16),
    "Q4_K": (8, 32),
    "Q5_K": (8, 32),
    "Q6_K": (16, 16),
}
# byte offsets of the fp16 fields of each block (scales d, minima m or dmin): where special values go in tests
# and in the first-use probe
HALF_FIELDS: dict[str, tuple[int, ...]] = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
# blocks per program: about 2048 values a program on the GPU
BLOCKS_PER_PROGRAM = {32: 64, 256: 8}


# --------------------------------------------------------------------------------------------------
# device helpers: fields of the block at `base` ((blocks, 1, 1) uint8 pointers), as int32 or fp32


@jit
def _byte(base, off):
    """The byte at `off` of each block, as int32 (0..255)."""
    return tl.load(base + off).to(tl.int32)


@jit
def _half(base, off):
    """The little-endian fp16 at `off` of each block, widened to fp32 (exact; subnormals, inf and NaN kept)."""
    lo = tl.load(base + off).to(tl.uint16)
    hi = tl.load(base + off + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _h(x, GPU: tl.constexpr):
    """fp32 `x` rounded to fp16 (nearest even), as fp32: the end of one torch fp16 op."""
    return round_to(x, tl.float16, GPU)


@jit
def _nibble(base, start, j, G: tl.constexpr):
    """4-bit code of value j: runs of G bytes from `start` give their low nibbles, then their high ones."""
    byte = _byte(base, start + (j // (2 * G)) * G + j % G)
    return (byte >> (4 * ((j // G) % 2))) & 0x0F


@jit
def _crumb(base, start, j, G: tl.constexpr):
    """2-bit code of value j: runs of G bytes from `start` give bits 0-1, 2-3, 4-5, then 6-7."""
    byte = _byte(base, start + (j // (4 * G)) * G + j % G)
    return (byte >> (2 * ((j // G) % 4))) & 0x03


@jit
def _bit(base, start, j, G: tl.constexpr):
    """1-bit plane of value j: runs of G bytes from `start` give bit 0 of each byte, then bit 1, ... bit 7."""
    byte = _byte(base, start + (j // (8 * G)) * G + j % G)
    return (byte >> ((j // G) % 8)) & 0x01


@jit
def _fifth_bit(base, start, j):
    """Q5_0/Q5_1: bit j of the little-endian 32-bit word at `start`."""
    return (_byte(base, start + j // 8) >> (j % 8)) & 0x01


@jit
def _k_scale_min(base, s):
    """Q4_K/Q5_K: sub-block s's 6-bit scale and minimum from the 12 packed bytes at offset 4."""
    t = s % 4
    lo_s = _byte(base, 4 + t)
    lo_m = _byte(base, 8 + t)
    hi = _byte(base, 12 + t)
    sc = tl.where(s < 4, lo_s & 0x3F, (hi & 0x0F) | ((lo_s >> 2) & 0x30))
    mn = tl.where(s < 4, lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30))
    return sc, mn


@jit
def _dequant_block(base, s, j, QTYPE: tl.constexpr, GPU: tl.constexpr):
    """fp16 values (as fp32) of value j (sub-block s) of each block at `base`, the reference's steps in order."""
    if QTYPE == 8:  # Q8_0: d, 32 int8
        q = tl.load(base + 2 + j).to(tl.int8, bitcast=True).to(tl.float32)
        v = _h(_half(base, 0) * q, GPU)
    elif QTYPE == 2:  # Q4_0: d, 16 bytes of nibbles; codes - 8
        q = (_nibble(base, 2, j, 16) - 8).to(tl.float32)
        v = _h(_half(base, 0) * q, GPU)
    elif QTYPE == 3:  # Q4_1: d, m, 16 bytes of nibbles
        q = _nibble(base, 4, j, 16).to(tl.float32)
        v = _h(_h(_half(base, 0) * q, GPU) + _half(base, 2), GPU)
    elif QTYPE == 6:  # Q5_0: d, 4 bytes of fifth bits, 16 bytes of nibbles; codes - 16
        q = ((_nibble(base, 6, j, 16) | (_fifth_bit(base, 2, j) << 4)) - 16).to(tl.float32)
        v = _h(_half(base, 0) * q, GPU)
    elif QTYPE == 7:  # Q5_1: d, m, 4 bytes of fifth bits, 16 bytes of nibbles
        q = (_nibble(base, 8, j, 16) | (_fifth_bit(base, 4, j) << 4)).to(tl.float32)
        v = _h(_h(_half(base, 0) * q, GPU) + _half(base, 2), GPU)
    elif QTYPE == 10:  # Q2_K: 16 scale/min bytes, 64 bytes of crumbs, d, dmin
        sc = _byte(base, s)
        scale = _h(_half(base, 80) * (sc & 0x0F).to(tl.float32), GPU)
        low = _h(_half(base, 82) * (sc >> 4).to(tl.float32), GPU)
        q = _crumb(base, 16, j, 32).to(tl.float32)
        v = _h(_h(scale * q, GPU) - low, GPU)
    elif QTYPE == 11:  # Q3_K: 32 bytes of high-bit planes, 64 bytes of crumbs, 12 bytes of 6-bit scales, d
        low4 = (_byte(base, 96 + s % 8) >> (4 * (s // 8))) & 0x0F
        high2 = (_byte(base, 104 + s % 4) >> (2 * (s // 4))) & 0x03
        scale = _h(_half(base, 108) * ((low4 | (high2 << 4)) - 32).to(tl.float32), GPU)
        q = (_crumb(base, 32, j, 32) - 4 * (_bit(base, 0, j, 32) ^ 1)).to(tl.float32)
        v = _h(scale * q, GPU)
    elif QTYPE == 12:  # Q4_K: d, dmin, 12 packed bytes, 128 bytes of nibbles
        sc, mn = _k_scale_min(base, s)
        scale = _h(_half(base, 0) * sc.to(tl.float32), GPU)
        low = _h(_half(base, 2) * mn.to(tl.float32), GPU)
        q = _nibble(base, 16, j, 32).to(tl.float32)
        v = _h(_h(scale * q, GPU) - low, GPU)
    elif QTYPE == 13:  # Q5_K: d, dmin, 12 packed bytes, 32 bytes of fifth-bit planes, 128 bytes of nibbles
        sc, mn = _k_scale_min(base, s)
        scale = _h(_half(base, 0) * sc.to(tl.float32), GPU)
        low = _h(_half(base, 2) * mn.to(tl.float32), GPU)
        q = (_nibble(base, 48, j, 32) | (_bit(base, 16, j, 32) << 4)).to(tl.float32)
        v = _h(_h(scale * q, GPU) - low, GPU)
    else:  # Q6_K (14): 128 bytes of nibbles, 64 bytes of crumbs, 16 int8 scales, d; codes - 32
        sc = tl.load(base + 192 + s).to(tl.int8, bitcast=True).to(tl.float32)
        scale = _h(_half(base, 208) * sc, GPU)
        q = ((_nibble(base, 0, j, 64) | (_crumb(base, 128, j, 32) << 4)) - 32).to(tl.float32)
        v = _h(scale * q, GPU)
    return v


@jit
def _gguf_dequant_kernel(
    raw_ptr,  # (n_blocks, TYPE_SIZE) uint8, contiguous
    out_ptr,  # (n_blocks, S * L) fp16/bf16/fp32, contiguous
    n_blocks,
    QTYPE: tl.constexpr,  # the GGML type number
    TYPE_SIZE: tl.constexpr,
    S: tl.constexpr,
    L: tl.constexpr,
    BLOCKS: tl.constexpr,  # blocks per program
    F32_OUT: tl.constexpr,  # the output is fp32: the fp16 values are stored as they are
    GPU: tl.constexpr,
):
    # grid: (cdiv(n_blocks, BLOCKS),)
    DTYPE = out_ptr.dtype.element_ty
    blk = (tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS))[:, None, None]
    s = tl.arange(0, S)[None, :, None]
    j = s * L + tl.arange(0, L)[None, None, :]  # value index within the block, (1, S, L)
    base = (
        raw_ptr + tl.minimum(blk, n_blocks - 1) * TYPE_SIZE
    )  # the last program's spare rows re-read a block
    v = _dequant_block(base, s, j, QTYPE, GPU)
    mask = (blk < n_blocks) & (j >= 0)
    if F32_OUT:
        tl.store(out_ptr + blk * (S * L) + j, v, mask=mask)
    else:
        tl.store(out_ptr + blk * (S * L) + j, to_storage(v, DTYPE, GPU), mask=mask)


# --------------------------------------------------------------------------------------------------
# host side


def dequantize_triton(
    raw: Tensor, qtype: GgmlType, dtype: torch.dtype, *, blocks: int | None = None
) -> Tensor:
    """Fused `dequantize_reference`: `raw` (..., bytes per row) contiguous uint8 blocks of `qtype` to a new
    contiguous (..., values per row) tensor of `dtype` (fp16, bf16 or fp32). `blocks`: blocks per program
    (default `BLOCKS_PER_PROGRAM`; a power of two)."""
    op = "gguf_dequant"
    check_launchable(op, raw)
    if qtype.name not in LAYOUT:
        raise UnsupportedInput(f"{op}: no kernel for GGML type {qtype.name}")
    if dtype not in OUT_DTYPES:
        raise UnsupportedInput(f"{op}: output dtype must be fp16, bf16 or fp32, got {dtype}")
    if raw.dtype != torch.uint8 or raw.ndim == 0 or raw.shape[-1] % qtype.type_size:
        raise UnsupportedInput(
            f"{op}: {qtype.name} data must be uint8 rows of whole {qtype.type_size}-byte blocks"
        )
    if not raw.is_contiguous():
        raise UnsupportedInput(f"{op}: the blocks must be contiguous, got strides {raw.stride()}")
    if raw.numel() == 0:
        raise UnsupportedInput(f"{op}: empty input {tuple(raw.shape)}")
    s, length = LAYOUT[qtype.name]
    n_blocks = raw.numel() // qtype.type_size
    out = torch.empty(
        (*raw.shape[:-1], raw.shape[-1] // qtype.type_size * qtype.block), dtype=dtype, device=raw.device
    )
    per = blocks or BLOCKS_PER_PROGRAM[qtype.block]
    _gguf_dequant_kernel[(triton.cdiv(n_blocks, per),)](
        raw,
        out,
        n_blocks,
        QTYPE=qtype.id,
        TYPE_SIZE=qtype.type_size,
        S=s,
        L=length,
        BLOCKS=per,
        F32_OUT=dtype == torch.float32,
        **EXACT,
    )
    return out


def dequantize_reference(raw: Tensor, qtype: GgmlType, dtype: torch.dtype) -> Tensor:
    """`dequantize(raw, qtype).to(dtype)`: diffusers' fp16 dequantization, then the cast to the compute dtype."""
    return dequantize(raw, qtype).to(dtype)


# the special fp16 scale values every first-use check feeds both paths: zeros, subnormals, the extremes,
# negatives, infinities and NaN, beside ordinary ones
SPECIAL_HALVES = (0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-14 - 2.0**-24, 65504.0, -65504.0, 1.0, -0.5)
SPECIAL_HALVES += (float("inf"), float("-inf"), float("nan"), 1e-3, 7.5e-5, 0.0421, -3.0e-4)


def probe_blocks(qtype: GgmlType, n: int, device: torch.device | str, seed: int = 0) -> Tensor:
    """`n` blocks of `qtype` (one row of uint8) with random codes and sub-block scales, whose fp16 fields cycle
    through `SPECIAL_HALVES` (each field offset from the others, so each value meets the others)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, qtype.type_size), generator=gen, dtype=torch.uint8)
    specials = torch.tensor(SPECIAL_HALVES, dtype=torch.float16).view(torch.uint8).reshape(-1, 2)
    for k, off in enumerate(HALF_FIELDS[qtype.name]):
        pick = (torch.arange(n) * (k + 1) + k * 5) % specials.shape[0]
        blocks[:, off : off + 2] = specials[pick]
    return blocks.reshape(1, -1).to(device)


def special_values_check(raw: Tensor, qtype: GgmlType, dtype: torch.dtype) -> str | None:
    """The first-use self check: both paths on `probe_blocks` of `qtype` on `raw`'s device (a checkpoint's own
    scales rarely hold zeros, subnormals, infinities or NaN); None if they agree, NaNs alike, else the problem."""
    probe = probe_blocks(qtype, 4 * len(SPECIAL_HALVES), raw.device)
    fused, ref = dequantize_triton(probe, qtype, dtype), dequantize_reference(probe, qtype, dtype)
    same = (fused == ref) | (fused.isnan() & ref.isnan())
    if bool(same.all()):
        return None
    return f"{int((~same).sum())} of {ref.numel()} values of blocks with special fp16 scales differ"


_GGUF_DEQUANT = FusedOp(
    "gguf_dequant",
    fused=dequantize_triton,
    reference=dequantize_reference,
    self_check=special_values_check,
)


def dequantize_as(raw: Tensor, qtype: GgmlType, dtype: torch.dtype) -> Tensor:
    """The weight in `dtype` of GGML blocks `raw` (see `dequantize_reference`); fused when `dispatch` allows."""
    return run_op(_GGUF_DEQUANT, raw, qtype, dtype)
