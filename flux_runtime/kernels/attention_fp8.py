"""Attention on Hopper's FP8 tensor cores: a `high`-tier candidate for the DiT's joint attention.

The reference is the model's attention, `F.scaled_dot_product_attention` in bf16. The fused path:

- K is quantized to e4m3 once per call with one scale per (token, head) row (`|row|max / 448`), V with
  one scale per (head, channel) over all tokens, stored channel-major (B, H, D, L) as the FP8 MMA wants
  its B operand; Q is quantized per row inside the attention kernel, from the tile it loads anyway.
- `_attention_fp8_kernel` is a flash-attention forward: `S = (Q8 K8^T) * q_scale * k_scale`, an online
  softmax in fp32 with `exp2`, `P` scaled by 2^8 (so small probabilities keep e4m3's normal range; the
  factor cancels against the running sum) and cast to e4m3, `O += P8 V8`, and at the end
  `O / l * v_scale`, one rounding to bf16.

Not bit-identical to the reference; its error against a float64 attention is stated by its tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.dispatch import FusedOp, UnsupportedInput, run_op
from flux_runtime.kernels.triton_utils import check_launchable, jit, tl, triton

# in the kernels as literals: 448 (e4m3's largest finite value) and 2^8, the scale of P (<= 256 < 448)


@jit
def _k_quant_kernel(
    k_ptr,  # (B, L, H, D) bf16, unit D stride
    k8_ptr,  # (B, H, L, D) e4m3 out
    ks_ptr,  # (B, H, L) fp32 out: per-row scale
    L,
    H,
    s_b,
    s_l,
    s_h,
    D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_l = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, D)
    mask = offs_l[:, None] < L
    k = tl.load(k_ptr + b * s_b + h * s_h + offs_l[:, None] * s_l + offs_d[None, :], mask=mask, other=0.0)
    k = k.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(k), axis=1), 1e-12)
    k8 = (k * (448.0 / amax)[:, None]).to(tl.float8e4nv)
    row = bh.to(tl.int64) * L + offs_l
    tl.store(k8_ptr + row[:, None] * D + offs_d[None, :], k8, mask=mask)
    tl.store(ks_ptr + row, amax * (1.0 / 448.0), mask=offs_l < L)


@jit
def _v_amax_kernel(
    v_ptr,  # (B, L, H, D) bf16
    amax_ptr,  # (B, H, D) fp32, zeroed: per-channel max |v| over the tokens (atomic max)
    L,
    H,
    s_b,
    s_l,
    s_h,
    D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_l = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, D)
    v = tl.load(
        v_ptr + b * s_b + h * s_h + offs_l[:, None] * s_l + offs_d[None, :],
        mask=offs_l[:, None] < L,
        other=0.0,
    )
    tl.atomic_max(amax_ptr + bh * D + offs_d, tl.max(tl.abs(v.to(tl.float32)), axis=0))


@jit
def _v_quant_kernel(
    v_ptr,  # (B, L, H, D) bf16
    amax_ptr,  # (B, H, D) fp32
    v8_ptr,  # (B, H, D, L) e4m3 out: channel-major
    L,
    H,
    s_b,
    s_l,
    s_h,
    D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_l = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, D)
    mask = offs_l[:, None] < L
    v = tl.load(v_ptr + b * s_b + h * s_h + offs_l[:, None] * s_l + offs_d[None, :], mask=mask, other=0.0)
    amax = tl.maximum(tl.load(amax_ptr + bh * D + offs_d), 1e-12)
    v8 = (v.to(tl.float32) * (448.0 / amax)[None, :]).to(tl.float8e4nv)
    tl.store(v8_ptr + (bh.to(tl.int64) * D + offs_d[None, :]) * L + offs_l[:, None], v8, mask=mask)


@jit
def _attention_fp8_kernel(
    q_ptr,  # (B, L, H, D) bf16
    k8_ptr,  # (B, H, L, D) e4m3
    ks_ptr,  # (B, H, L) fp32
    v8_ptr,  # (B, H, D, L) e4m3
    vs_ptr,  # (B, H, D) fp32: per-channel max |v| (the scale is that / 448)
    o_ptr,  # (B, L, H, D) bf16 out, contiguous
    L,
    H,
    s_qb,
    s_ql,
    s_qh,
    qk_scale,  # softmax scale * log2(e)
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr,  # L % BLOCK_N == 0 and L % BLOCK_M == 0
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    # Q: quantized per row from the loaded tile
    q = tl.load(
        q_ptr + b * s_qb + h * s_qh + offs_m[:, None] * s_ql + offs_d[None, :],
        mask=offs_m[:, None] < L,
        other=0.0,
    )
    q = q.to(tl.float32)
    q_amax = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-12)
    q8 = (q * (448.0 / q_amax)[:, None]).to(tl.float8e4nv)
    q_scale = q_amax * (qk_scale / 448.0)  # folds the softmax scale and log2(e)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    k_base = k8_ptr + bh.to(tl.int64) * L * D
    v_base = v8_ptr + bh.to(tl.int64) * D * L
    ks_base = ks_ptr + bh.to(tl.int64) * L
    for start in range(0, L, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if EVEN:
            kt = tl.load(k_base + offs_n[None, :] * D + offs_d[:, None])  # (D, BLOCK_N)
            ks = tl.load(ks_base + offs_n)
            vt = tl.load(v_base + offs_d[:, None] * L + offs_n[None, :])  # (D, BLOCK_N)
        else:
            kt = tl.load(k_base + offs_n[None, :] * D + offs_d[:, None], mask=offs_n[None, :] < L, other=0.0)
            ks = tl.load(ks_base + offs_n, mask=offs_n < L, other=0.0)
            vt = tl.load(v_base + offs_d[:, None] * L + offs_n[None, :], mask=offs_n[None, :] < L, other=0.0)
        s = tl.dot(q8, kt) * q_scale[:, None] * ks[None, :]
        if not EVEN:
            s = tl.where(offs_n[None, :] < L, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None] + 8.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc)
        m_i = m_new
    v_scale = tl.load(vs_ptr + bh * D + offs_d) * (1.0 / 448.0)
    o = acc / l_i[:, None] * v_scale[None, :]
    o_offs = ((b * L + offs_m[:, None]).to(tl.int64) * H + h) * D + offs_d[None, :]
    tl.store(o_ptr + o_offs, o.to(tl.bfloat16), mask=offs_m[:, None] < L)


def attention_fp8_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_m: int = 128,
    block_n: int = 128,
    num_warps: int = 8,
    num_stages: int = 3,
) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over (B, L, H, D) bf16 inputs with FP8 MMAs; (B, L, H, D) bf16 out."""
    op = "attention_fp8"
    check_launchable(op, q, k, v)
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) < (8, 9):
        raise UnsupportedInput(f"{op}: needs FP8 tensor cores (compute capability 8.9+)")
    if not (q.shape == k.shape == v.shape) or q.ndim != 4:
        raise UnsupportedInput(f"{op}: expected q, k, v of one (B, L, H, D) shape")
    if {q.dtype, k.dtype, v.dtype} != {torch.bfloat16}:
        raise UnsupportedInput(f"{op}: expected bf16 inputs")
    bsz, length, heads, d = q.shape
    if d not in (64, 128) or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise UnsupportedInput(f"{op}: head width must be 64 or 128 with unit stride")
    dev = q.device
    k8 = torch.empty(bsz, heads, length, d, device=dev, dtype=torch.float8_e4m3fn)
    ks = torch.empty(bsz, heads, length, device=dev, dtype=torch.float32)
    v8 = torch.empty(bsz, heads, d, length, device=dev, dtype=torch.float8_e4m3fn)
    vmax = torch.zeros(bsz, heads, d, device=dev, dtype=torch.float32)
    rows = 64
    grid = (triton.cdiv(length, rows), bsz * heads)
    _k_quant_kernel[grid](k, k8, ks, length, heads, k.stride(0), k.stride(1), k.stride(2), D=d, BLOCK_L=rows)
    _v_amax_kernel[grid](v, vmax, length, heads, v.stride(0), v.stride(1), v.stride(2), D=d, BLOCK_L=rows)
    _v_quant_kernel[grid](
        v, vmax, v8, length, heads, v.stride(0), v.stride(1), v.stride(2), D=d, BLOCK_L=rows
    )
    out = torch.empty(bsz, length, heads, d, device=dev, dtype=torch.bfloat16)
    even = length % block_m == 0 and length % block_n == 0
    _attention_fp8_kernel[(triton.cdiv(length, block_m), bsz * heads)](
        q, k8, ks, v8, vmax, out, length, heads, q.stride(0), q.stride(1), q.stride(2),
        (1.0 / math.sqrt(d)) * math.log2(math.e), D=d, BLOCK_M=block_m, BLOCK_N=block_n, EVEN=even,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def attention_reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The model's attention: SDPA over the heads of (B, L, H, D) inputs, (B, L, H, D) out (a strided view)."""
    o = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
    return o.permute(0, 2, 1, 3).to(q.dtype)


_ATTENTION_FP8 = FusedOp(
    "attention_fp8", fused=attention_fp8_triton, reference=attention_reference, tier="high"
)


def attention_heads(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention of every head, (B, L, H, D); on FP8 tensor cores in the `high` tier."""
    return run_op(_ATTENTION_FP8, q, k, v)
