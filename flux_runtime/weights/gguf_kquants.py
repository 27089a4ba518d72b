"""Quantizing to the GGML K-quants Q6_K, Q5_K, Q4_K, Q3_K and Q2_K (the `gguf` package only dequantizes them).

The blocks are the format's, laid out exactly as `kernels.gguf_dequant` (and every other reader) decodes
them: a super-block of 256 values with fp16 super-scales and 4-bit (Q2_K), 6-bit (Q3_K, Q4_K, Q5_K) or 8-bit
(Q6_K) sub-block scales. The choice of scales is deliberately simple, simpler than llama.cpp's `llama-quantize`, which
searches scales that minimise a weighted squared error:

- Q4_K / Q5_K (8 sub-blocks of 32, `x ≈ d*sc*q - dmin*m`, q in 0..15 or 0..31): each sub-block's minimum
  (never above 0) is rounded *up* to a multiple of `dmin`, its range then rounded up to a multiple of `d`, so
  the sub-block's values all fall inside the codes' span and no value is clipped.
- Q2_K (16 sub-blocks of 16, 4-bit sub-block scales and minima, q in 0..3): as Q4_K.
- Q6_K (16 sub-blocks of 16, `x ≈ d*sc*(q - 32)`, q - 32 in -32..31) and Q3_K (16 of 16, `x ≈ d*(sc - 32)*q`,
  q in -4..3): each sub-block's scale is its largest |x| / 31 (Q3_K: / 3, leaving code -4 unused), rounded
  up to a multiple of `d`.

Each code is then the nearest one under the scales exactly as a reader computes them (fp16 products), so the
error of a value is at most half a step of its sub-block, and a step is at most (1 + 1/g)^2 (two-sided types)
or (1 + 1/g) (symmetric ones) times the span / (levels - 1) of the widest sub-block in its super-block, g the
sub-scale grid (63, 127, 31, 15), plus the fp16 roundings a reader makes (and, for blocks of values below
~1e-4, fp16's subnormal scales); `tests/gguf/test_gguf_kquants.py` checks this.
"""

from __future__ import annotations

import torch
from torch import Tensor

QK_K = 256
K_TYPES = ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")
# bytes per super-block
TYPE_SIZE = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _fp16_at_least(x: Tensor) -> Tensor:
    """The smallest fp16 value >= each of `x` (fp32, >= 0, finite in fp16): a super-scale never rounds down,
    so the sub-block scales built on it never need a code past the largest."""
    h = x.to(torch.float16)
    low = h.float() < x
    bumped = (h.view(torch.int16) + 1).view(torch.float16)  # the next fp16 up, for positive values
    return torch.where(low, bumped, h)


def _ceil_div(x: Tensor, step: Tensor, top: int) -> Tensor:
    """ceil(x / step) clamped to 0..top, 0 where step is 0 (x is then 0 too)."""
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.ceil(x / safe).clamp(0, top)
    return torch.where(step > 0, q, torch.zeros_like(q))


def _codes(x: Tensor, scale: Tensor, offset: Tensor, top: int) -> Tensor:
    """The nearest code q in 0..top of each value for `q * scale - offset` (0 where the scale is 0)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x + offset) / safe).clamp(0, top)
    return torch.where(scale > 0, q, torch.zeros_like(q)).to(torch.uint8)


def _fp16_bytes(h: Tensor) -> Tensor:
    """fp16 values (n,) as their two little-endian bytes (n, 2)."""
    return h.contiguous().view(torch.uint8).reshape(-1, 2)


def _pack_k_scales(sc: Tensor, mn: Tensor) -> Tensor:
    """Eight 6-bit scales and minima (n, 8) into the K-quants' 12 bytes: the low 6 bits of the first four of
    each in bytes 0-3 / 4-7 (the top 2 bits of the last four above them), the low 4 bits of the last four in
    bytes 8-11 (scales low nibble, minima high)."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    lo_s = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    lo_m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return torch.cat([lo_s, lo_m, hi], dim=1)


def _pack_nibbles(q: Tensor, group: int) -> Tensor:
    """4-bit codes (n, k * 2 * group): each run of 2 * group codes as `group` bytes, the first half in the low
    nibbles, the second in the high ones."""
    n = q.shape[0]
    pairs = q.reshape(n, -1, 2, group)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, -1)


def _pack_bit_planes(bits: Tensor, group: int) -> Tensor:
    """One bit per code (n, 8 * group): plane p (codes p*group .. (p+1)*group) in bit p of `group` bytes."""
    n = bits.shape[0]
    planes = bits.reshape(n, 8, group).to(torch.int32)
    shifts = torch.arange(8, dtype=torch.int32).reshape(1, 8, 1)
    return (planes << shifts).sum(dim=1).to(torch.uint8)


def _min_scale_blocks(x: Tensor, levels: int) -> tuple[Tensor, ...]:
    """Q4_K / Q5_K scales of super-blocks `x` (n, 256): fp16 d, dmin (n,), 6-bit sc, m (n, 8), and the
    per-sub-block fp16 scale and offset (n, 8, 1) the codes are chosen under."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    low = (-sub.amin(dim=2)).clamp(min=0)  # the offset each sub-block needs, >= 0
    dmin = _fp16_at_least(low.amax(dim=1) / 63)
    m = _ceil_div(low, dmin.float()[:, None], 63)
    offset = (dmin[:, None] * m.to(torch.float16)).float()  # as a reader computes it (fp16 product)
    span = (sub.amax(dim=2) + offset).clamp(min=0)
    d = _fp16_at_least(span.amax(dim=1) / (63 * (levels - 1)))
    sc = _ceil_div(span / (levels - 1), d.float()[:, None], 63)
    scale = (d[:, None] * sc.to(torch.float16)).float()
    return d, dmin, sc, m, scale[:, :, None], offset[:, :, None]


def quantize_q4_k(x: Tensor) -> Tensor:
    """Super-blocks (n, 256) fp32 as Q4_K blocks (n, 144) uint8: d, dmin, scales, 128 bytes of nibbles."""
    n = x.shape[0]
    d, dmin, sc, m, scale, offset = _min_scale_blocks(x, 16)
    q = _codes(x.reshape(n, 8, 32), scale, offset, 15).reshape(n, QK_K)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), _pack_k_scales(sc, m), _pack_nibbles(q, 32)], dim=1)


def quantize_q5_k(x: Tensor) -> Tensor:
    """Super-blocks (n, 256) fp32 as Q5_K blocks (n, 176): d, dmin, scales, 32 bytes of fifth bits, nibbles."""
    n = x.shape[0]
    d, dmin, sc, m, scale, offset = _min_scale_blocks(x, 32)
    q = _codes(x.reshape(n, 8, 32), scale, offset, 31).reshape(n, QK_K)
    parts = [_fp16_bytes(d), _fp16_bytes(dmin), _pack_k_scales(sc, m)]
    parts += [_pack_bit_planes(q >> 4, 32), _pack_nibbles(q & 0x0F, 32)]
    return torch.cat(parts, dim=1)


def quantize_q6_k(x: Tensor) -> Tensor:
    """Super-blocks (n, 256) fp32 as Q6_K blocks (n, 210): 128 bytes of low nibbles, 64 of high 2 bits, 16
    int8 sub-block scales, fp16 d."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    need = sub.abs().amax(dim=2) / 31  # codes -31..31 cover every value
    d = _fp16_at_least(need.amax(dim=1) / 127)
    sc = _ceil_div(need, d.float()[:, None], 127)
    scale = (d[:, None] * sc.to(torch.float16)).float()[:, :, None]
    q = _codes(sub, scale, 32 * scale, 63).reshape(n, 2, 4, 32)  # value order: half, quarter, position
    # low nibbles: in each half, quarters 0 and 1 in the low nibbles of 64 bytes, quarters 2 and 3 in the high
    low = q & 0x0F
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(n, 128)
    # high 2 bits: in each half, quarter c in bits 2c, 2c + 1 of 32 bytes
    high = (q >> 4).to(torch.int32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(1, 1, 4, 1)
    qh = (high << shifts).sum(dim=2).to(torch.uint8).reshape(n, 64)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql, qh, scales, _fp16_bytes(d)], dim=1)


def _pack_crumbs(q: Tensor) -> Tensor:
    """2-bit codes (n, 256) as 64 bytes: in each half (128 codes), quarter c in bits 2c, 2c + 1 of 32 bytes."""
    n = q.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(1, 1, 4, 1)
    return (q.reshape(n, 2, 4, 32).to(torch.int32) << shifts).sum(dim=2).to(torch.uint8).reshape(n, 64)


def quantize_q2_k(x: Tensor) -> Tensor:
    """Super-blocks (n, 256) fp32 as Q2_K blocks (n, 84): 16 bytes of 4-bit scale (low) and minimum (high)
    nibbles, 64 bytes of 2-bit codes, fp16 d, dmin. 16 sub-blocks of 16, `x ≈ d*sc*q - dmin*m`, q in 0..3."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    low = (-sub.amin(dim=2)).clamp(min=0)
    dmin = _fp16_at_least(low.amax(dim=1) / 15)
    m = _ceil_div(low, dmin.float()[:, None], 15)
    offset = (dmin[:, None] * m.to(torch.float16)).float()
    span = (sub.amax(dim=2) + offset).clamp(min=0)
    d = _fp16_at_least(span.amax(dim=1) / (15 * 3))
    sc = _ceil_div(span / 3, d.float()[:, None], 15)
    scale = (d[:, None] * sc.to(torch.float16)).float()
    q = _codes(sub, scale[:, :, None], offset[:, :, None], 3).reshape(n, QK_K)
    scales = (sc.to(torch.uint8) | (m.to(torch.uint8) << 4)).reshape(n, 16)
    return torch.cat([scales, _pack_crumbs(q), _fp16_bytes(d), _fp16_bytes(dmin)], dim=1)


def quantize_q3_k(x: Tensor) -> Tensor:
    """Super-blocks (n, 256) fp32 as Q3_K blocks (n, 110): 32 bytes of high-bit planes, 64 of 2-bit codes, 12
    of 6-bit scales, fp16 d. 16 sub-blocks of 16, `x ≈ d*(sc - 32)*q`, q in -4..3 (only -3..3 used here: a
    sub-block's scale is its largest |x| / 3, so nothing is clipped)."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    need = sub.abs().amax(dim=2) / 3
    d = _fp16_at_least(need.amax(dim=1) / 31)
    sc = _ceil_div(need, d.float()[:, None], 31)
    scale = (d[:, None] * sc.to(torch.float16)).float()[:, :, None]
    q = _codes(sub, scale, 4 * scale, 7).reshape(n, QK_K)  # q + 4, in 0..7
    # the low 2 bits as Q2_K's codes; the third bit set means "do not subtract 4"
    hmask = _pack_bit_planes(q >> 2, 32)
    stored = (sc + 32).to(torch.uint8)  # 6-bit, offset by 32
    lo, hi = stored & 0x0F, stored >> 4
    packed_lo = lo[:, :8] | (lo[:, 8:] << 4)
    packed_hi = hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:16] << 6)
    return torch.cat([hmask, _pack_crumbs(q & 0x03), packed_lo, packed_hi, _fp16_bytes(d)], dim=1)


_QUANTIZE = {
    "Q2_K": quantize_q2_k,
    "Q3_K": quantize_q3_k,
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
}


def quantize_k(values: Tensor, name: str, rows_per_chunk: int = 256) -> Tensor:
    """A 2-D fp32 tensor (rows, cols), cols a multiple of 256, as uint8 (rows, cols / 256 * block bytes) of
    the K-quant `name`; a few rows at a time, so that the temporaries stay small."""
    rows, cols = values.shape
    if cols % QK_K:
        raise ValueError(f"{name} rows hold whole blocks of {QK_K} values; this tensor's rows have {cols}")
    out = torch.empty(rows, cols // QK_K * TYPE_SIZE[name], dtype=torch.uint8)
    for start in range(0, rows, rows_per_chunk):
        chunk = values[start : start + rows_per_chunk].float()
        blocks = _QUANTIZE[name](chunk.reshape(-1, QK_K))
        out[start : start + chunk.shape[0]] = blocks.reshape(chunk.shape[0], -1)
    return out
