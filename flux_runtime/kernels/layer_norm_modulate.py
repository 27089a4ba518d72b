"""LayerNorm (no affine) followed by adaLN modulate (fusion F2), and its deferred-residual form (F4).

`residual_layer_norm_modulate` first materialises a pending gated residual `r + g * u` and then
normalises the result: one pass over the row in a fused kernel, two eager chains in the reference.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from flux_runtime.kernels.gated_residual import gated_residual_reference
from flux_runtime.kernels.modulate import modulate_reference


def layer_norm_modulate_reference(x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6) -> Tensor:
    """`LayerNorm(x) * (1 + scale) + shift` for `x` (B, L, D), `shift`/`scale` (B, D)."""
    y = F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return modulate_reference(y, shift, scale)


def residual_layer_norm_modulate_reference(
    residual: Tensor, gate: Tensor, update: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Return `(r, layer_norm_modulate(r))` with `r = residual + gate * update`."""
    r = gated_residual_reference(residual, gate, update)
    return r, layer_norm_modulate_reference(r, shift, scale, eps)


def layer_norm_modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6) -> Tensor:
    """LayerNorm + modulate; see `layer_norm_modulate_reference`."""
    return layer_norm_modulate_reference(x, shift, scale, eps)


def residual_layer_norm_modulate(
    residual: Tensor, gate: Tensor, update: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Deferred gated residual + LayerNorm + modulate; see `residual_layer_norm_modulate_reference`."""
    return residual_layer_norm_modulate_reference(residual, gate, update, shift, scale, eps)
