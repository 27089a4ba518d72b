"""QK RMSNorm + rotary embedding over the joint text/image sequence (fusion F7).

diffusers normalises each stream's heads with its own `torch.nn.RMSNorm` weight, concatenates
text before image along the sequence, then applies RoPE in fp32: `x * cos + rot(x) * sin`
(two fp32 products and one fp32 add, separately rounded) with a single cast back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`torch.nn.RMSNorm` over the last dim (aten's fused kernel: weight applied in fp32, one rounding)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved channel pairs of `x` (B, L, H, D) by the (L, D) fp32 tables `cos`, `sin`."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def qk_norm_rope_reference(
    x_txt: Tensor | None,
    x_img: Tensor,
    weight_txt: Tensor | None,
    weight_img: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
) -> Tensor:
    """Normalise `x_txt` (B, L_txt, H, D) and `x_img` (B, L_img, H, D), join them text first, rotate.

    `x_txt` is None in single-stream blocks, where `x_img` already holds the joint sequence.
    Returns (B, L_txt + L_img, H, D) in the input dtype.
    """
    x = rms_norm_reference(x_img, weight_img, eps)
    if x_txt is not None:
        assert weight_txt is not None
        x = torch.cat([rms_norm_reference(x_txt, weight_txt, eps), x], dim=1)
    return rope_reference(x, cos, sin)


def qk_norm_rope(
    x_txt: Tensor | None,
    x_img: Tensor,
    weight_txt: Tensor | None,
    weight_img: Tensor,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
) -> Tensor:
    """QK-norm + RoPE; see `qk_norm_rope_reference`."""
    return qk_norm_rope_reference(x_txt, x_img, weight_txt, weight_img, cos, sin, eps)
