"""Gated residual `residual + gate * update` (fusion F3).

Eager runs two bf16 ops: the gated product (rounded), then the sum (rounded).
"""

from __future__ import annotations

from torch import Tensor


def gated_residual_reference(residual: Tensor, gate: Tensor, update: Tensor) -> Tensor:
    """`residual + gate[:, None] * update` for `residual`, `update` (B, L, D) and `gate` (B, D)."""
    return residual + gate.unsqueeze(1) * update


def gated_residual(residual: Tensor, gate: Tensor, update: Tensor) -> Tensor:
    """Gated residual add; see `gated_residual_reference` for the exact semantics."""
    return gated_residual_reference(residual, gate, update)
