"""Quality tiers, loudly: which kernels a request may mount, and which tier it actually got.

`lossless` runs the reference ops or fused kernels proven `torch.equal` to them; `high` may also run
approximate fusions. When a requested tier cannot run (CPU, fp32), the runtime says so once and the
tier actually used goes into the image's provenance. Nothing falls back silently.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Literal

import torch

log = logging.getLogger(__name__)

Tier = Literal["lossless", "high"]
_warned: set[tuple[str, str]] = set()


def _say_once(key: tuple[str, str], message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def resolve_tier(requested: Tier, device: torch.device, dtype: torch.dtype) -> Tier:
    """The tier a request gets on this device and dtype (warning once when it differs)."""
    if requested == "high" and device.type != "cuda":
        _say_once(("high", device.type), f"quality 'high' needs a CUDA GPU; running 'lossless' on {device.type}")
        return "lossless"
    if requested == "high" and dtype == torch.float32:
        _say_once(("high", "fp32"), "quality 'high' has no fp32 kernels; running 'lossless'")
        return "lossless"
    return requested


@contextlib.contextmanager
def tier_context(tier: Tier) -> Iterator[None]:
    """Mount the fused kernels allowed in `tier` for the ops run inside the block."""
    try:
        from flux_runtime.kernels.dispatch import use_fused
    except ImportError:  # no fused kernels in this build: the reference ops are the lossless tier
        yield
        return
    with use_fused(tier):
        yield
