"""Plain-PyTorch replays of aten's CUDA vectorised LayerNorm / fused RMSNorm.

Written lane by lane in fp32 torch ops, independently of the Triton kernels, so they serve twice:
- on the CPU they are the bit-exact oracle for the kernels under `TRITON_INTERPRET=1` (aten's own CPU
  LayerNorm/RMSNorm reduce in another order, so the CPU reference differs by up to one ulp);
- on CUDA, `test_*_replay_matches_aten` checks them against aten itself, which confirms the reading
  of aten's algorithm the kernels are built on (a failure there points at the reading, not Triton).

FMAs are computed in float64 and rounded to fp32 through round-to-odd, which makes them exact. The
one hardware-specific step is `rsqrtf`: on CUDA the replay uses `torch.rsqrt` (aten's `rsqrtf`), on the
CPU `1 / sqrt`, which is what the Triton interpreter computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

THREADS = 128
VEC = 4


def fma32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Correctly rounded fp32 `a * b + c` (one rounding), for fp32 tensors."""
    p = a.double() * b.double()  # exact: 24 + 24 significant bits
    cd = c.double().expand_as(p)
    s = p + cd
    t = s - p  # TwoSum: p + cd == s + e exactly
    e = (p - (s - t)) + (cd - t)
    bits = s.view(torch.int64)
    # round to odd: if inexact and s is even, step one ulp towards the exact value
    step = torch.where((e > 0) == (s > 0), 1, -1)
    bits = torch.where((e != 0) & (bits & 1 == 0), bits + step, bits)
    return bits.view(torch.float64).float()


def rsqrtf(x: Tensor) -> Tensor:
    """CUDA's `rsqrtf` on CUDA tensors; elsewhere the interpreter's rsqrt, `1 / sqrt` with numpy's correctly
    rounded fp32 sqrt. torch's vectorised CPU sqrt is not correctly rounded on every CPU (on an AVX2 one 17 %
    of fp32 roots were an ulp off), so the root is taken in float64 and rounded once to fp32 (exact: 53 bits
    hold the 2 x 24 + 2 that make the double rounding harmless)."""
    return torch.rsqrt(x) if x.is_cuda else 1.0 / torch.sqrt(x.double()).float()


def _lane_values(xf: Tensor, it: int, ii: int) -> tuple[Tensor, Tensor]:
    """Element `ii` of vector `it * 128 + t` for every lane t: values (M, 128) and validity (128,)."""
    n = xf.shape[1]
    vec = it * THREADS + torch.arange(THREADS, device=xf.device)
    valid = vec < n // VEC
    idx = (vec * VEC + ii).clamp(max=n - 1)
    return xf[:, idx] * valid, valid


def _shuffle_down_tree(lanes: tuple[Tensor, ...], combine: Callable) -> tuple[Tensor, ...]:
    """Fold (M, 128) lane state to (M,): per warp offsets 16..1, then warps (0,2),(1,3), then (0,1)."""
    state = tuple(v.reshape(v.shape[0], 4, 32) for v in lanes)
    for k in (16, 8, 4, 2, 1):
        state = combine(tuple(v[..., :k] for v in state), tuple(v[..., k : 2 * k] for v in state))
    state = tuple(v[..., 0] for v in state)  # (M, 4): one value per warp
    for k in (2, 1):
        state = combine(tuple(v[..., :k] for v in state), tuple(v[..., k : 2 * k] for v in state))
    return tuple(v[..., 0] for v in state)


def _welford_combine(b: tuple[Tensor, ...], a: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """aten `cuWelfordCombine(dataB = self, dataA = other)`, contracted as nvcc does."""
    mean_b, m2_b, n_b = b
    mean_a, m2_a, n_a = a
    delta = mean_b - mean_a
    count = n_a + n_b
    nonempty = count > 0
    coef = 1.0 / torch.where(nonempty, count, torch.ones_like(count))
    na, nb = n_a * coef, n_b * coef
    mean = fma32(mean_a, na, nb * mean_b)
    m2 = fma32(nb, n_a * (delta * delta), m2_a + m2_b)
    zero = torch.zeros_like(mean)
    return torch.where(nonempty, mean, zero), torch.where(nonempty, m2, zero), count


def layer_norm_replay(x: Tensor, eps: float) -> Tensor:
    """aten `vectorized_layer_norm_kernel` without affine over the last dim of bf16/fp16 `x`."""
    shape, n = x.shape, x.shape[-1]
    xf = x.reshape(-1, n).float()
    m = xf.shape[0]
    mean = torch.zeros(m, THREADS, device=x.device)
    m2 = torch.zeros_like(mean)
    count = torch.zeros_like(mean)
    for it in range(-(-n // (THREADS * VEC))):
        for ii in range(VEC):
            v, valid = _lane_values(xf, it, ii)
            delta = v - mean
            new_count = count + 1
            new_mean = fma32(delta, 1.0 / new_count, mean)
            new_m2 = fma32(delta, v - new_mean, m2)
            mean = torch.where(valid, new_mean, mean)
            m2 = torch.where(valid, new_m2, m2)
            count = torch.where(valid, new_count, count)
    mean, m2, _ = _shuffle_down_tree((mean, m2, count), _welford_combine)
    var = m2 / torch.full_like(m2, n)  # a true division: aten CUDA turns `/ scalar` into `* (1/scalar)`
    rstd = rsqrtf(var + torch.tensor(eps, dtype=torch.float32))
    y = rstd[:, None] * (xf - mean[:, None])
    return y.to(x.dtype).reshape(shape)


def rms_norm_replay(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """aten's fused CUDA RMSNorm (`rms_norm=true` vectorised kernel) over the last dim of `x`."""
    shape, n = x.shape, x.shape[-1]
    xf = x.reshape(-1, n).float()
    total = torch.zeros(xf.shape[0], THREADS, device=x.device)
    for it in range(-(-n // (THREADS * VEC))):
        for ii in range(VEC):
            v, _ = _lane_values(xf, it, ii)  # invalid lanes read 0 and add 0
            total = fma32(v, v, total)
    (total,) = _shuffle_down_tree((total,), lambda b, a: (b[0] + a[0],))
    rstd = rsqrtf(total / torch.full_like(total, n) + torch.tensor(eps, dtype=torch.float32))
    y = weight.float() * (rstd[:, None] * xf)
    return y.to(x.dtype).reshape(shape)
