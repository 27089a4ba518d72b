"""Quality tiers, loudly: which kernels a request may mount, and which tier it actually got.

`lossless` runs the reference ops or fused kernels proven `torch.equal` to them; `high` may also run
approximate fusions (today: the adaLN projections of all steps batched into one GEMM each). A call's
tier is resolved once, by `resolve_tier`, into one `RunTier` that the denoiser receives and the
provenance records: when a requested tier cannot run (CPU, fp32) the runtime says so once and the tier
actually used is the one recorded. Nothing falls back silently.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from flux_runtime.kernels.dispatch import Tier as KernelTier
from flux_runtime.kernels.dispatch import use_fused

log = logging.getLogger(__name__)

Tier = Literal["lossless", "high"]
"""The quality a caller asks for (`quality=`, `--quality`)."""
_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class RunTier:
    """One call's tier, decided once: `quality` is the tier that runs (and is recorded), `kernels` the
    dispatch tier mounted around each model call ("off" where no fused kernels exist: a CPU, fp32; the
    reference ops *are* the lossless tier, so "off" changes no bits)."""

    quality: Tier
    kernels: KernelTier

    @property
    def batched_modulation(self) -> bool:
        """Whether every step's adaLN projections are computed up front in one GEMM (high tier, fused)."""
        return self.kernels == "high"

    @contextlib.contextmanager
    def mounted(self) -> Iterator[None]:
        """Mount the fused kernels this tier allows inside the block."""
        with use_fused(self.kernels):
            yield


# the approximations `high` can make, as the provenance names them (`approximations`)
BATCHED_MODULATION = "adaLN projections of all steps in one GEMM"
FAST_FP8_ACCUMULATION = "fast FP8 accumulation"
FUSED_DECODE = "fused GroupNorm + SiLU decode, channels-last"
FP8_ATTENTION = "FP8 attention (FA3 e4m3, per-head scales)"
DENOISER_APPROXIMATIONS = (BATCHED_MODULATION, FAST_FP8_ACCUMULATION, FP8_ATTENTION)


def record_approximations(tier: RunTier, made: set[str], model: str, precision: str) -> list[str]:
    """The provenance's `approximations`: what `high` approximated in a call, in a fixed order (empty under
    `lossless`). When `high` ran and had nothing to approximate in the denoiser (a bf16 FLUX.2 or FLUX.3
    model where FP8 attention cannot run: no batched adaLN, no FP8 GEMMs, no FP8 attention) it says so once:
    those steps are the lossless kernels' bits."""
    if tier.kernels == "high" and not any(a in made for a in DENOISER_APPROXIMATIONS):
        _say_once(
            ("high-denoiser", f"{model}/{precision}"),
            f"quality 'high' has no approximation for the {model} ({precision}) denoiser: its steps run the "
            "lossless kernels; the record's `approximations` lists what was approximated",
        )
    order = (*DENOISER_APPROXIMATIONS, FUSED_DECODE)
    return [a for a in order if a in made]


def _say_once(key: tuple[str, str], message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def resolve_tier(requested: Tier, device: torch.device, dtype: torch.dtype) -> RunTier:
    """The tier a request gets on this device and dtype (warning once when it differs from `requested`)."""
    quality = requested
    if requested == "high" and device.type != "cuda":
        _say_once(
            ("high", device.type), f"quality 'high' needs a CUDA GPU; running 'lossless' on {device.type}"
        )
        quality = "lossless"
    elif requested == "high" and dtype == torch.float32:
        _say_once(("high", "fp32"), "quality 'high' has no fp32 kernels; running 'lossless'")
        quality = "lossless"
    fused = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    return RunTier(quality=quality, kernels=quality if fused else "off")
