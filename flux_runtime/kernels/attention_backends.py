"""Attention as one named op with backends: which one a block's attention runs, and the record of what ran.

- `sdpa`: PyTorch's `scaled_dot_product_attention` on the bf16/fp16 heads (cuDNN or flash on the GPU). The
  only backend `lossless` (and `off`) ever runs: today's path, bit for bit.
- `fa3-fp8`: FlashAttention-3's e4m3 forward (sm90 only) from the optional `fa3-fwd` package
  (`pip install 'flux-runtime[fp8-attention]'`), fed e4m3 q, k, v with per-(batch, head) descales written by
  their producers (`heads_fp8`); output bf16. Only the `high` tier runs it, only when asked for, and only where
  it can: a CUDA sm90 device, the package importable, a bf16 model (FA3's FP8 output is bf16 only), heads of
  128 (the producers' width).

FP8 attention is opt-in: a whole 28-step FLUX.1-dev image (random full-size weights) came out 35.4 dB PSNR from
`lossless` with it, under the 40 dB that `high` promises, where `high`'s other approximations gave 47.1 dB. So
the default setting, "sdpa", keeps `high` in bf16 attention; `set_attention_backend` (or the `attention_backend`
context) changes it: "auto" takes FP8 attention wherever it can run and says once (a log line, not per call) why
it cannot elsewhere, "fa3-fp8" insists (a missing package is then an `ImportError` naming the extra, another
obstacle a `ValueError`). `choose_attention` decides once per (tier, setting, device, dtype, head width). The
blocks `record_attention` what each call ran, so the provenance's `attention` names the backend that actually
ran and why (`attention_record`); a pipeline resets the record per generation. The package is imported lazily,
on the first choice that could use it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, get_args

import torch
from torch import Tensor

from flux_runtime.kernels.attention_quant import Fp8Heads
from flux_runtime.kernels.triton_utils import temporarily

log = logging.getLogger(__name__)

Backend = Literal["sdpa", "fa3-fp8"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
Preference = Literal["auto", "sdpa", "fa3-fp8"]
PREFERENCES: tuple[Preference, ...] = get_args(Preference)

FA3_MODULE = "fa3_fwd_interface"  # what the fa3-fwd wheel installs (beside its compiled `fa3_fwd._C`)
EXTRA = "pip install 'flux-runtime[fp8-attention]'"
FP8_HEAD_DIM = 128  # the e4m3 producers' head width (`heads_fp8`)
FA3_ARCH = (9, 0)  # fa3-fwd builds its kernels for sm90 only

_preference: list[Preference] = ["sdpa"]  # FP8 attention is opt-in (see the module)
_said: set[str] = set()
_lock = threading.Lock()
_record: Counter[tuple[Backend, str]] = Counter()


class MissingFp8Attention(ImportError):
    """FP8 attention was asked for explicitly and its package is not installed."""


@dataclass(frozen=True)
class AttentionChoice:
    """The backend an attention call runs and why (the provenance's `attention` and `attention_reason`)."""

    backend: Backend
    reason: str

    @property
    def fp8(self) -> bool:
        return self.backend == "fa3-fp8"


@functools.cache
def _fa3() -> ModuleType | str:
    """The fa3-fwd interface module, or why it cannot be imported (a one-line reason)."""
    try:
        return importlib.import_module(FA3_MODULE)
    except ImportError as e:
        return f"the fa3-fwd package is not installed ({EXTRA}): {e}"
    except Exception as e:  # a wheel built against another torch fails in its extension's loader
        return f"the fa3-fwd package does not load here ({type(e).__name__}: {e})"


def fa3_missing() -> str | None:
    """None when fa3-fwd imports, else why not."""
    found = _fa3()
    return found if isinstance(found, str) else None


def fp8_obstacle(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FP8 attention cannot run for heads of `head_dim` in `dtype` on `device`, or None when it can."""
    if device.type != "cuda":
        return f"on {device.type}; FP8 attention needs an sm90 (Hopper) GPU"
    cap = torch.cuda.get_device_capability(device)
    if cap != FA3_ARCH:
        return f"the GPU is sm{cap[0]}{cap[1]}; fa3-fwd's FP8 kernels are sm90 (Hopper) only"
    if dtype != torch.bfloat16:
        return f"the model computes in {str(dtype).removeprefix('torch.')}; FA3's FP8 output is bf16 only"
    if head_dim != FP8_HEAD_DIM:
        return f"heads of {head_dim}; the e4m3 producers are written for heads of {FP8_HEAD_DIM}"
    return fa3_missing()


def set_attention_backend(name: Preference) -> Preference:
    """Set the backend `high` uses: "sdpa" (the default), "auto" (FP8 attention where it can run) or "fa3-fp8"
    (FP8 attention or an error); `lossless` always runs sdpa. Returns the previous setting. "fa3-fp8" without
    the package raises `MissingFp8Attention` naming the extra."""
    if name not in PREFERENCES:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(PREFERENCES)}")
    if name == "fa3-fp8" and (missing := fa3_missing()) is not None:
        raise MissingFp8Attention(f"FP8 attention needs fa3-fwd: {EXTRA} ({missing})")
    previous = _preference[0]
    _preference[0] = name
    return previous


def attention_preference() -> Preference:
    """The backend setting (`set_attention_backend`): part of a captured CUDA graph's key, since the graph holds
    the backend it was captured with."""
    return _preference[0]


def attention_backend(name: Preference) -> AbstractContextManager[None]:
    """`set_attention_backend(name)` for the enclosed block, the previous setting restored after it."""
    return temporarily(set_attention_backend, name)


def _say_once(message: str) -> None:
    with _lock:
        first = message not in _said
        _said.add(message)
    if first:
        log.warning(message)


FA3_FP8 = AttentionChoice("fa3-fp8", "high tier on sm90: FA3 e4m3 attention, per-head scales")


@functools.cache
def _choose(
    tier: str, preference: Preference, device: torch.device, dtype: torch.dtype, head_dim: int
) -> AttentionChoice:
    if tier == "off":
        return AttentionChoice("sdpa", "reference ops (no fused kernels here)")
    if tier != "high":
        return AttentionChoice("sdpa", f"the {tier} tier runs SDPA only")
    if preference == "sdpa":
        return AttentionChoice("sdpa", "attention backend set to sdpa (FP8 attention is opt-in)")
    obstacle = fp8_obstacle(device, dtype, head_dim)
    if obstacle is None:
        return FA3_FP8
    if preference == "fa3-fp8":
        raise ValueError(f"attention backend fa3-fp8 cannot run: {obstacle}")
    return AttentionChoice("sdpa", obstacle)


def choose_attention(tier: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionChoice:
    """The backend an attention call at dispatch `tier` ("off", "lossless", "high") runs for (B, L, H,
    `head_dim`) heads in `dtype` on `device`; `high` set to "auto" but without FP8 attention says why, once."""
    preference = _preference[0]
    choice = _choose(tier, preference, device, dtype, head_dim)
    if tier == "high" and preference == "auto" and not choice.fp8:
        _say_once(f"quality 'high': attention stays bf16 (SDPA): {choice.reason}")
    return choice


def record_attention(choice: AttentionChoice) -> None:
    """Count one attention call that ran `choice` (the blocks call this; `attention_record` reads it)."""
    with _lock:
        _record[(choice.backend, choice.reason)] += 1


def reset_attention_record() -> None:
    """Forget the recorded calls (a pipeline does this per generation)."""
    with _lock:
        _record.clear()


def attention_record() -> dict[str, str]:
    """What the recorded calls ran, as the provenance writes it: `attention` (the backends, FP8 first, joined by
    ", ") and `attention_reason` (why, per backend when both ran). Empty when nothing was recorded (CUDA graph
    replays run no Python: the graph keeps the record of its capture)."""
    with _lock:
        counts = dict(_record)
    if not counts:
        return {}
    backends = [b for b in BACKENDS[::-1] if any(k[0] == b for k in counts)]
    reasons = "; ".join(f"{b}: {r}" if len(backends) > 1 else r for b, r in sorted(counts, reverse=True))
    return {"attention": ", ".join(backends), "attention_reason": reasons}


def attention_calls() -> dict[str, int]:
    """Recorded attention calls per backend."""
    with _lock:
        counts = dict(_record)
    return {
        b: sum(n for (k, _), n in counts.items() if k == b)
        for b in BACKENDS
        if any(k[0] == b for k in counts)
    }


def fa3_fp8_attention(q: Fp8Heads, k: Fp8Heads, v: Fp8Heads) -> Tensor:
    """FA3's e4m3 forward of (B, L, H, 128) codes with their (B, H) descales, softmax scale 1/sqrt(128):
    (B, L, H, 128) bf16. Needs the fa3-fwd package and an sm90 GPU (`choose_attention` checks both)."""
    fa3 = _fa3()
    if isinstance(fa3, str):
        raise MissingFp8Attention(fa3)
    return fa3.flash_attn_func(
        q.data, k.data, v.data, q_descale=q.descale, k_descale=k.descale, v_descale=v.descale
    )


def fa3_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """FA3's bf16 forward of (B, L, H, D) heads (the benches' comparison; the runtime runs `sdpa` in bf16)."""
    fa3 = _fa3()
    if isinstance(fa3, str):
        raise MissingFp8Attention(fa3)
    return fa3.flash_attn_func(q, k, v)
