"""Dequantization of GGML blocks (GGUF checkpoints), the PyTorch reference.

A GGUF weight of shape (rows, cols) is stored as `rows` runs of `cols / block` blocks of `type_size`
bytes; each block packs fp16 scales (and minima) with 2 to 8 bit codes. `dequantize(raw, qtype, shape)`
turns the uint8 rows back into values.

Parity: diffusers' torch dequantization (the loader its `GGUFLinear` calls before every matmul) computes
in float16: every scale is read as fp16 and each elementwise step (`d * q`, `+ m`, `- dm`, the K-quants'
`d * sub_scale`) is a separate fp16 op with its own rounding; the caller then casts the fp16 weight to
the compute dtype. The functions below take the same steps on the same dtypes in the same order, so the
result is bit-identical to it (not to llama.cpp's fp32 dequantization, from which fp16 rounding differs
by up to half an fp16 ulp). The fused Triton kernel (`gguf_dequant_triton`) reproduces these fp16 roundings
and the cast.

The type numbers and block sizes are those of the GGUF format (ggml's `ggml_type`); the `gguf` package
is not imported here (this package imports nothing optional).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

QK_K = 256  # values in a K-quant super-block


@dataclass(frozen=True)
class GgmlType:
    """One GGML tensor type: its number in the file, name, values per block and bytes per block."""

    id: int
    name: str
    block: int
    type_size: int


# the float types a GGUF file may store a tensor in as is (no blocks): GGML's id and name, and the torch dtype
_PLAIN = ((0, "F32", torch.float32), (1, "F16", torch.float16), (30, "BF16", torch.bfloat16))
PLAIN_TYPES = {i: GgmlType(i, name, 1, dtype.itemsize) for i, name, dtype in _PLAIN}
PLAIN_DTYPES = {i: dtype for i, _, dtype in _PLAIN}

# the block-quantized types this runtime dequantizes (FLUX GGUF files use these)
QUANT_TYPES = {
    t.id: t
    for t in (
        GgmlType(2, "Q4_0", 32, 18),
        GgmlType(3, "Q4_1", 32, 20),
        GgmlType(6, "Q5_0", 32, 22),
        GgmlType(7, "Q5_1", 32, 24),
        GgmlType(8, "Q8_0", 32, 34),
        GgmlType(10, "Q2_K", QK_K, 84),
        GgmlType(11, "Q3_K", QK_K, 110),
        GgmlType(12, "Q4_K", QK_K, 144),
        GgmlType(13, "Q5_K", QK_K, 176),
        GgmlType(14, "Q6_K", QK_K, 210),
    )
}
BY_NAME = {t.name: t for t in (*PLAIN_TYPES.values(), *QUANT_TYPES.values())}


def _parts(blocks: Tensor, *sizes: int) -> tuple[Tensor, ...]:
    """Split each block (a row of bytes) into fields of `sizes` bytes and the remainder."""
    rest = blocks.shape[1] - sum(sizes)
    return tuple(blocks.split([*sizes, rest], dim=1))


def _fp16(field: Tensor) -> Tensor:
    """A 2-byte field of each block read as its fp16 value, (n, 1)."""
    return field.contiguous().view(torch.float16)


def _shifts(like: Tensor, step: int) -> Tensor:
    """The bit shifts 0, step, ... below 8 as uint8 on `like`'s device: made by `arange`, a kernel, not
    copied from the host (a host copy is not allowed while a CUDA graph is being captured)."""
    return torch.arange(0, 8, step, device=like.device, dtype=torch.uint8)


def _nibbles(qs: Tensor, group: int) -> Tensor:
    """4-bit codes: each run of `group` bytes gives its low nibbles, then its high ones; (n, -1, group) uint8."""
    n = qs.shape[0]
    x = qs.reshape(n, -1, 1, group) >> _shifts(qs, 4).reshape(1, 1, 2, 1)
    return (x & 0x0F).reshape(n, -1, group)


def _crumbs(qs: Tensor, group: int) -> Tensor:
    """2-bit codes: each run of `group` bytes gives bits 0-1, 2-3, 4-5, 6-7 in turn; (n, -1, group) uint8."""
    n = qs.shape[0]
    x = qs.reshape(n, -1, 1, group) >> _shifts(qs, 2).reshape(1, 1, 4, 1)
    return (x & 0x03).reshape(n, -1, group)


def _bits(mask: Tensor, group: int) -> Tensor:
    """1-bit planes: each run of `group` bytes gives bit 0 of every byte, then bit 1, ... bit 7; uint8."""
    n = mask.shape[0]
    x = mask.reshape(n, -1, 1, group) >> _shifts(mask, 1).reshape(1, 1, 8, 1)
    return (x & 0x01).reshape(n, -1, group)


def _high_bits32(qh: Tensor) -> Tensor:
    """Q5_0/Q5_1: the 32 fifth bits of a block, little-endian in 4 bytes, as (n, 32) uint8 of 0/1."""
    b = qh.to(torch.int32)
    word = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
    shifts = torch.arange(32, device=qh.device, dtype=torch.int32)
    return ((word[:, None] >> shifts[None, :]) & 1).to(torch.uint8)


def _k_scales(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K: the 8 six-bit sub-block scales and minima packed in 12 bytes; each (n, 8) uint8."""
    n = packed.shape[0]
    rows = packed.reshape(n, 3, 4)
    lo_s, lo_m, hi = rows[:, 0], rows[:, 1], rows[:, 2]
    scales = torch.cat([lo_s & 0x3F, (hi & 0x0F) | ((lo_s >> 2) & 0x30)], dim=-1)
    mins = torch.cat([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], dim=-1)
    return scales, mins


def _q8_0(blocks: Tensor) -> Tensor:
    d, qs = _parts(blocks, 2)
    return _fp16(d) * qs.contiguous().view(torch.int8)


def _q4_0(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    d, qs = _parts(blocks, 2)
    q = _nibbles(qs, 16).reshape(n, -1).to(torch.int8) - 8
    return _fp16(d) * q


def _q4_1(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    d, m, qs = _parts(blocks, 2, 2)
    q = _nibbles(qs, 16).reshape(n, -1)
    return _fp16(d) * q + _fp16(m)


def _q5_codes(qh: Tensor, qs: Tensor) -> Tensor:
    n = qs.shape[0]
    return _nibbles(qs, 16).reshape(n, -1) | (_high_bits32(qh) << 4)


def _q5_0(blocks: Tensor) -> Tensor:
    d, qh, qs = _parts(blocks, 2, 4)
    q = _q5_codes(qh, qs).to(torch.int8) - 16
    return _fp16(d) * q


def _q5_1(blocks: Tensor) -> Tensor:
    d, m, qh, qs = _parts(blocks, 2, 2, 4)
    return _fp16(d) * _q5_codes(qh, qs) + _fp16(m)


def _q2_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    sc, qs, d, dmin = _parts(blocks, QK_K // 16, QK_K // 4, 2)
    scale = (_fp16(d) * (sc & 0x0F)).reshape(n, 16, 1)
    low = (_fp16(dmin) * (sc >> 4)).reshape(n, 16, 1)
    q = _crumbs(qs, 32).reshape(n, 16, 16)
    return (scale * q - low).reshape(n, QK_K)


def _q3_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    hmask, qs, packed, d = _parts(blocks, QK_K // 8, QK_K // 4, 12)
    low4 = (packed[:, :8].reshape(n, 1, 8) >> _shifts(packed, 4).reshape(1, 2, 1)).reshape(n, 16)
    high2 = (packed[:, 8:].reshape(n, 1, 4) >> _shifts(packed, 2).reshape(1, 4, 1)).reshape(n, 16)
    sub = ((low4 & 0x0F) | ((high2 & 0x03) << 4)).to(torch.int8) - 32
    scale = (_fp16(d) * sub).reshape(n, 16, 1)
    low = _crumbs(qs, 32).reshape(n, 16, QK_K // 16)
    minus4 = _bits(hmask, 32).reshape(n, 16, QK_K // 16) ^ 1  # a clear mask bit subtracts 4
    q = low.to(torch.int8) - (minus4 << 2).to(torch.int8)
    return (scale * q).reshape(n, QK_K)


def _q4_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    d, dmin, packed, qs = _parts(blocks, 2, 2, 12)
    sc, mn = _k_scales(packed)
    scale = (_fp16(d) * sc).reshape(n, -1, 1)
    low = (_fp16(dmin) * mn).reshape(n, -1, 1)
    return (scale * _nibbles(qs, 32) - low).reshape(n, QK_K)


def _q5_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    d, dmin, packed, qh, qs = _parts(blocks, 2, 2, 12, QK_K // 8)
    sc, mn = _k_scales(packed)
    scale = (_fp16(d) * sc).reshape(n, -1, 1)
    low = (_fp16(dmin) * mn).reshape(n, -1, 1)
    q = _nibbles(qs, 32) | (_bits(qh, 32) << 4)
    return (scale * q - low).reshape(n, QK_K)


def _q6_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    ql, qh, sc, d = _parts(blocks, QK_K // 2, QK_K // 4, QK_K // 16)
    scale = (_fp16(d) * sc.contiguous().view(torch.int8)).reshape(n, QK_K // 16, 1)
    q = (_nibbles(ql, 64).reshape(n, -1, 32) | (_crumbs(qh, 32) << 4)).to(torch.int8) - 32
    return (scale * q.reshape(n, QK_K // 16, -1)).reshape(n, QK_K)


_DEQUANT: dict[str, Callable[[Tensor], Tensor]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def byte_shape(qtype: GgmlType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The uint8 shape that holds a tensor of `shape` in `qtype` (the last dim a whole number of blocks)."""
    if not shape or shape[-1] % qtype.block:
        raise ValueError(f"shape {shape} is not a whole number of {qtype.name} blocks of {qtype.block}")
    return (*shape[:-1], shape[-1] // qtype.block * qtype.type_size)


def dequantize(raw: Tensor, qtype: GgmlType) -> Tensor:
    """The fp16 values of `raw` (uint8, (..., blocks_per_row * type_size)), shape (..., values_per_row).

    fp16 as diffusers' reference produces them; cast to the compute dtype after (the cast is part of parity).
    """
    n_bytes = raw.shape[-1]
    if raw.dtype != torch.uint8 or n_bytes % qtype.type_size:
        raise ValueError(f"{qtype.name} data must be uint8 rows of whole {qtype.type_size}-byte blocks")
    blocks = raw.reshape(-1, qtype.type_size)
    values = _DEQUANT[qtype.name](blocks)
    return values.reshape(*raw.shape[:-1], n_bytes // qtype.type_size * qtype.block)
