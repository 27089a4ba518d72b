"""adaLN modulate `y * (1 + scale) + shift` (fusion F1).

Eager runs three bf16 ops, each rounding once: `1 + scale`, the product, the sum.
"""

from __future__ import annotations

from torch import Tensor


def modulate_reference(y: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """Modulate `y` (B, L, D) by per-batch `shift`, `scale` (B, D), as diffusers does."""
    return y * (1 + scale[:, None]) + shift[:, None]


def modulate(y: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN modulate; see `modulate_reference` for the exact semantics."""
    return modulate_reference(y, shift, scale)
