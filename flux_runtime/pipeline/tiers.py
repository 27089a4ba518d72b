"""Quality tiers, loudly: which kernels a request may mount, and which tier it actually got.

`lossless` runs the reference ops or fused kernels proven `torch.equal` to them; `high` may also run
approximate fusions (today: the adaLN projections of all steps batched into one GEMM each, F13). When a requested tier cannot run (CPU, fp32), the runtime says so once and the
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
        _say_once(
            ("high", device.type), f"quality 'high' needs a CUDA GPU; running 'lossless' on {device.type}"
        )
        return "lossless"
    if requested == "high" and dtype == torch.float32:
        _say_once(("high", "fp32"), "quality 'high' has no fp32 kernels; running 'lossless'")
        return "lossless"
    return requested


def fused_tier(tier: Tier, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel dispatch tier: fused kernels only where they exist (CUDA, bf16/fp16), else the reference ops.

    The reference ops *are* the lossless tier, so "off" on a CPU or in fp32 changes no bits.
    """
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "off"
    return tier


@contextlib.contextmanager
def tier_context(dispatch_tier: str) -> Iterator[None]:
    """Mount the fused kernels allowed at `dispatch_tier` ("off", "lossless", "high") inside the block."""
    from flux_runtime.kernels.dispatch import use_fused

    with use_fused(dispatch_tier):  # type: ignore[arg-type]
        yield
