"""FP8 (e4m3) attention inputs, the reference: per-head scales, K smoothing, and the attention they stand for.

An FP8 attention kernel (FA3's e4m3 path) reads q, k and v as e4m3 codes plus one fp32 *descale* per
(batch, head): the value it multiplies back is `code * descale[b, h]`. FA3 takes exactly that granularity
(`q_descale`, `k_descale`, `v_descale`: (batch, num_heads_k) fp32, any strides), so a head's scale spans all of
its tokens and all 128 channels; finer (per-block) scales cannot be handed to it.

The quantization of one (B, L, H, D) input, as the producers (`heads_fp8`) compute it:

- `amax[b, h] = max |x[b, :, h, :]|` over the head's tokens and channels (x as stored: bf16/fp16, exact in fp32);
- `scale = max(amax, 1e-12) * fl32(1 / 448)` and `inv = 1 / scale` (fp32, correctly rounded): the FP8 GEMMs'
  per-row rule (`fp8.quantize_reference`), applied per head;
- `code = e4m3(clamp(x * inv, ±448))`, rounded to nearest even; `descale = scale`.

K smoothing subtracts K's per-head mean over tokens (per channel) before quantizing: every score of a query
row changes by the same `q · mean`, which softmax ignores, while the values left to quantize are smaller and
centred (keys share a large common component in DiTs). It is kept here, in fp32, to measure what it buys;
the producers do not apply it.

`fp8_attention_reference` is the attention those inputs stand for (dequantized, fp32 SDPA); with
`fp8_probabilities` it also rounds the unnormalised softmax probabilities to e4m3 before they multiply V,
which is what FA3's FP8 kernel does with P (its row maximum is a running, per key block one; here the
row's global maximum, so this models the effect rather than replaying it).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.fp8 import E4M3, E4M3_MAX, INV_E4M3_MAX, MIN_AMAX
from flux_runtime.kernels.qk_norm_rope import empty_heads


class Fp8Heads(NamedTuple):
    """An attention input in e4m3: `data` (B, L, H, D) codes (any storage with a unit last stride) and
    `descale` (B, H) fp32, contiguous: `data[b, :, h] * descale[b, h]` is the value it stands for."""

    data: Tensor
    descale: Tensor


def is_head_major_storage(x: Tensor) -> bool:
    """Whether (B, L, H, D) `x` is stored head-major ((B, H, L, D) contiguous), as `empty_heads` lays it out."""
    _, n, h, d = x.shape
    return h > 1 and n > 1 and x.stride() == (h * n * d, d, n * d, 1)


def head_scales(amax: Tensor) -> tuple[Tensor, Tensor]:
    """(scale, 1 / scale) fp32 from per-head absolute maxima `amax` (B, H) fp32: `max(amax, 1e-12) * fl32(1/448)`."""
    scale = amax.float().clamp(min=MIN_AMAX) * INV_E4M3_MAX
    return scale, scale.reciprocal()


def smooth_keys(k: Tensor) -> Tensor:
    """K minus its per-head mean over tokens (each channel's own), fp32 (B, L, H, D): the scores of each
    query row all shift by `q · mean`, which softmax removes."""
    kf = k.float()
    return kf - kf.mean(dim=1, keepdim=True)


def quantize_heads_reference(x: Tensor, *, smooth: bool = False, head_major: bool | None = None) -> Fp8Heads:
    """e4m3 codes of `x` (B, L, H, D) with one scale per (batch, head) (module docstring), stored head-major
    when `head_major` (default: as `x` is stored). `smooth`: quantize `smooth_keys(x)` instead (for K)."""
    if x.ndim != 4:
        raise ValueError(f"quantize_heads_reference: x must be (B, L, H, D), got {tuple(x.shape)}")
    major = is_head_major_storage(x) if head_major is None else head_major
    xf = smooth_keys(x) if smooth else x.float()
    scale, inv = head_scales(xf.abs().amax(dim=(1, 3)))
    codes = (xf * inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    data = empty_heads(*x.shape, dtype=E4M3, device=x.device, head_major=major).copy_(codes)
    return Fp8Heads(data, scale.contiguous())


def dequantize_heads(x: Fp8Heads) -> Tensor:
    """The fp32 (B, L, H, D) values `x` stands for."""
    return x.data.float() * x.descale[:, None, :, None]


def attention_fp32(q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Full attention of (B, L, H, D) inputs computed in `dtype` (fp32 or float64 for references), (B, L, H, D)."""
    o = F.scaled_dot_product_attention(*(t.to(dtype).permute(0, 2, 1, 3) for t in (q, k, v)))
    return o.permute(0, 2, 1, 3)


def _attention_e4m3_probabilities(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """fp32 attention whose unnormalised probabilities `exp(s - rowmax)` (in [0, 1]) are rounded to e4m3
    before multiplying V, the row sum taken from the unrounded ones (as FA3's FP8 path keeps it in fp32)."""
    qh, kh, vh = (t.float().permute(0, 2, 1, 3) for t in (q, k, v))
    s = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    o = (p.to(E4M3).float() @ vh) / p.sum(dim=-1, keepdim=True)
    return o.permute(0, 2, 1, 3)


def fp8_attention_reference(
    q: Fp8Heads, k: Fp8Heads, v: Fp8Heads, *, fp8_probabilities: bool = False
) -> Tensor:
    """The fp32 (B, L, H, D) attention of the dequantized inputs: what an FP8 kernel approximates, with
    `fp8_probabilities` also P rounded to e4m3 (module docstring)."""
    qf, kf, vf = dequantize_heads(q), dequantize_heads(k), dequantize_heads(v)
    if fp8_probabilities:
        return _attention_e4m3_probabilities(qf, kf, vf)
    return attention_fp32(qf, kf, vf)


def relative_error(x: Tensor, ref: Tensor) -> float:
    """`||x - ref|| / ||ref||` over all elements, in float64: the per-op error the FP8 attention is held to."""
    x64, r64 = x.double(), ref.double()
    return float((x64 - r64).norm() / r64.norm())
