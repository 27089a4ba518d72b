"""GroupNorm, optionally followed by SiLU: the autoencoders' normalisation (a `high`-tier kernel).

The reference is what the FLUX autoencoders run: `F.group_norm` (fp32 statistics, one rounding to the
storage dtype), then `F.silu` where the block applies it (a second rounding). aten's CUDA GroupNorm
reduces each (image, group) in a single thread block, so a 1024² decode spends about half its time in
32 of them while the GPU's other SMs idle.

The fused path splits the work over the whole GPU in two passes:

1. `_group_stats_kernel`: each program loads one tile of `BLOCK_HW` positions x all `C` channels and
   writes, per group, the tile's mean and sum of squared deviations from it (fp32, from registers).
2. The tiles' partial statistics are merged in fp32 with Chan's formula (a few small torch ops), then
   folded with the affine into per-channel `a = rstd * weight`, `b = bias - mean * a`.
3. `_group_apply_kernel`: `y = x * a + b` in fp32, SiLU on that unrounded value where asked, one
   rounding to the storage dtype.

It is not bit-identical to the reference (a different reduction order, and SiLU sees the unrounded
normalised value), so it is a `high` kernel; tests state its error against a float64 reference. It
reads NCHW and channels-last tensors alike (and the attention block's `(B, C, HW)` view) and writes
its output in the input's layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.launch import check_inputs
from flux_runtime.kernels.triton_utils import ON_GPU, jit, tl, to_storage, triton, upcast

# elements of one program's tile (positions x channels): 32 fp32 registers a thread at 8 warps
TILE = 8192
MAX_CHANNELS = TILE


@jit
def _load_tile(
    x_ptr, HW, stride_b, stride_hw, stride_c, C: tl.constexpr, BLOCK_HW: tl.constexpr, GPU: tl.constexpr,
    FULL_MASK: tl.constexpr,
):  # fmt: skip
    """This program's tile (grid (tiles, B)): `BLOCK_HW` positions x all `C` channels of image b as fp32, with
    its mask ((BLOCK_HW, C) when FULL_MASK, else (BLOCK_HW, 1)) and element offsets; returns
    (t, b, channels, mask, offsets, x)."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    hw = t * BLOCK_HW + tl.arange(0, BLOCK_HW)
    c = tl.arange(0, C)
    mask = (hw < HW)[:, None]
    if FULL_MASK:
        mask = tl.broadcast_to(mask, (BLOCK_HW, C))
    offs = b.to(tl.int64) * stride_b + hw[:, None].to(tl.int64) * stride_hw + c[None, :] * stride_c
    x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), GPU)
    return t, b, c, mask, offs, x


@jit
def _group_stats_kernel(
    x_ptr,  # (B, HW, C) through strides: the input, bf16/fp16
    part_ptr,  # (B, T, 2, G) fp32 out: per tile and group, the mean and the sum of squared deviations
    HW,  # positions per image
    T,  # tiles per image
    stride_b,
    stride_hw,
    stride_c,
    C: tl.constexpr,
    G: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    GPU: tl.constexpr,
):
    t, b, _, mask, _, x = _load_tile(x_ptr, HW, stride_b, stride_hw, stride_c, C, BLOCK_HW, GPU, True)
    x3 = tl.reshape(x, (BLOCK_HW, G, C // G))
    m3 = tl.reshape(mask, (BLOCK_HW, G, C // G))
    n = (tl.minimum(HW - t * BLOCK_HW, BLOCK_HW) * (C // G)).to(tl.float32)
    mean = tl.sum(tl.sum(x3, axis=2), axis=0) / n  # (G,)
    d = tl.where(m3, x3 - mean[None, :, None], 0.0)
    m2 = tl.sum(tl.sum(d * d, axis=2), axis=0)
    g = tl.arange(0, G)
    base = part_ptr + (b * T + t).to(tl.int64) * (2 * G)
    tl.store(base + g, mean)
    tl.store(base + G + g, m2)


@jit
def _group_apply_kernel(
    x_ptr,  # (B, HW, C) through strides: the input
    out_ptr,  # the output, same strides
    ab_ptr,  # (B, 2, C) fp32: per-channel scale a and shift b
    HW,
    stride_b,
    stride_hw,
    stride_c,
    C: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    SILU: tl.constexpr,
    GPU: tl.constexpr,
):
    _, b, c, mask, offs, x = _load_tile(x_ptr, HW, stride_b, stride_hw, stride_c, C, BLOCK_HW, GPU, False)
    a = tl.load(ab_ptr + b * 2 * C + c)
    s = tl.load(ab_ptr + b * 2 * C + C + c)
    y = x * a[None, :] + s[None, :]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + offs, to_storage(y, out_ptr.dtype.element_ty, GPU), mask=mask)


def _as_positions(op: str, x: Tensor) -> tuple[int, int, int, int]:
    """(HW, stride_b, stride_hw, stride_c) of `x` (B, C, H, W) or (B, C, L) viewed as (B, HW, C)."""
    if x.ndim == 3:
        return x.shape[2], x.stride(0), x.stride(2), x.stride(1)
    if x.ndim != 4:
        raise UnsupportedInput(f"{op}: expected a (B, C, H, W) or (B, C, L) tensor, got {x.ndim} dims")
    _, _, h, w = x.shape
    if h > 1 and w > 1 and x.stride(2) != w * x.stride(3):
        raise UnsupportedInput(f"{op}: H and W do not merge into one stride (strides {x.stride()})")
    return h * w, x.stride(0), x.stride(3) if w > 1 else x.stride(2), x.stride(1)


def group_norm_silu_triton(
    x: Tensor, weight: Tensor, bias: Tensor, groups: int, eps: float, silu: bool
) -> Tensor:
    """The two-pass GroupNorm (+ SiLU) described above, in `x`'s layout."""
    op = "group_norm_silu"
    check_inputs(op, x=x, weight=weight, bias=bias)
    c = x.shape[1]
    if c % groups or c & (c - 1) or (c // groups) & (c // groups - 1) or c > MAX_CHANNELS:
        raise UnsupportedInput(
            f"{op}: needs power-of-two channels ({c}) and channels per group, at most {MAX_CHANNELS}"
        )
    if weight.shape != (c,) or bias.shape != (c,):
        raise UnsupportedInput(f"{op}: weight and bias must be ({c},)")
    hw, sb, shw, sc = _as_positions(op, x)
    b = x.shape[0]
    block = max(1, TILE // c)
    tiles = triton.cdiv(hw, block)
    part = torch.empty(b, tiles, 2, groups, device=x.device, dtype=torch.float32)
    _group_stats_kernel[(tiles, b)](
        x, part, hw, tiles, sb, shw, sc, C=c, G=groups, BLOCK_HW=block, GPU=ON_GPU, num_warps=8
    )
    # Chan's merge of the tiles' (count, mean, M2), all in fp32
    per_group = c // groups
    counts = (hw - torch.arange(tiles, device=x.device) * block).clamp(max=block).float() * per_group
    total = float(hw * per_group)
    means, m2s = part[:, :, 0], part[:, :, 1]  # (B, T, G)
    mean = (means * counts[None, :, None]).sum(1) / total  # (B, G)
    m2 = m2s.sum(1) + (counts[None, :, None] * (means - mean[:, None]).square()).sum(1)
    rstd = torch.rsqrt(m2 / total + eps)
    a = rstd.repeat_interleave(per_group, dim=1) * weight.float()
    shift = bias.float() - mean.repeat_interleave(per_group, dim=1) * a
    ab = torch.stack([a, shift], dim=1).contiguous()  # (B, 2, C)
    out = torch.empty_like(x)
    _, osb, oshw, osc = _as_positions(op, out)
    if (osb, oshw, osc) != (sb, shw, sc):
        raise UnsupportedInput(f"{op}: could not allocate the output in the input's layout")
    _group_apply_kernel[(tiles, b)](
        x, out, ab, hw, sb, shw, sc, C=c, BLOCK_HW=block, SILU=silu, GPU=ON_GPU, num_warps=8
    )
    return out


def group_norm_silu_reference(
    x: Tensor, weight: Tensor, bias: Tensor, groups: int, eps: float, silu: bool
) -> Tensor:
    """`F.group_norm`, then `F.silu` if `silu`: the autoencoders' eager ops, each rounding once."""
    y = F.group_norm(x, groups, weight, bias, eps)
    return F.silu(y) if silu else y


_GROUP_NORM_SILU = FusedOp(
    "group_norm_silu", fused=group_norm_silu_triton, reference=group_norm_silu_reference, tier="high"
)


def group_norm_silu(x: Tensor, norm: torch.nn.GroupNorm, silu: bool = True) -> Tensor:
    """`norm(x)` then SiLU if `silu` (see `group_norm_silu_reference`); fused in the `high` tier."""
    return run_op(_GROUP_NORM_SILU, x, norm.weight, norm.bias, norm.num_groups, norm.eps, silu)
