"""Choose between a fused Triton kernel and its PyTorch reference, and keep a record of every choice.

The pipeline sets the quality tier for a block of work::

    with use_fused("lossless"):
        image = pipe(...)
    print(fused_ops_report())  # `.tier_used`: what actually ran

- `off`: every op runs its reference (the eager model math).
- `lossless`: kernels that are bit-identical to their reference. Each one is verified on the first call
  per signature (shapes, strides, dtypes, device, alignment, scalars): both paths run and must agree
  bit for bit (`torch.equal`, NaNs in the same places allowed). A mismatch is logged as an error,
  recorded, and that signature uses the reference from then on (the idea of sglang's
  `BitExactFusionGate`). Verification needs a host sync, so it never happens while a CUDA
  graph is captured; an unverified signature runs the reference there. On a CUDA device a pass is
  written down (`verified`): a later process on the same machine, with the same kernels, torch, Triton,
  GPU model and driver, takes that signature's kernel without running both paths again.
- `high`: also kernels that change rounding (none of the kernels here yet: the pipeline's `high` tier batches
  the adaLN projections of all steps instead); lossless kernels are still verified.

Nothing falls back silently: each reason a fused kernel was not used is counted per (op, reason),
logged once (a warning, or an error for a failed verification) and reported by `fused_ops_report()`.
Under `torch.compile` the ops return their reference expression (Dynamo cannot read the tier context
variable, and Inductor fuses that chain itself); those calls are not counted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from flux_runtime.kernels import verified

log = logging.getLogger(__name__)

Tier = Literal["off", "lossless", "high"]
TIERS: tuple[Tier, ...] = get_args(Tier)
_RANK = {"off": 0, "lossless": 1, "high": 2}

_tier: ContextVar[Tier] = ContextVar("flux_runtime_fused_tier", default="off")


class UnsupportedInput(ValueError):
    """A fused kernel's guard rejected its input (dtype, layout, width, device); the reference runs."""


@contextmanager
def use_fused(tier: Tier) -> Iterator[None]:
    """Run the enclosed ops at `tier` ("off", "lossless" or "high"); restores the previous tier on exit."""
    if tier not in TIERS:
        raise ValueError(f"unknown fused tier {tier!r}; expected one of {', '.join(TIERS)}")
    token = _tier.set(tier)
    try:
        yield
    finally:
        _tier.reset(token)


def fused_tier() -> Tier:
    """The tier active in this context."""
    return _tier.get()


@dataclass(frozen=True)
class FusedOp:
    """One op with a fused kernel and its reference, as the public op functions hand it to `run_op`.

    `fused` raises `UnsupportedInput` when its guards reject the input. `self_check`, if given, runs
    once per signature during verification with the op's arguments and returns None or a problem
    (the GELU kernel checks all 65,536 inputs of its dtype there).
    """

    name: str
    fused: Callable[..., Any]
    reference: Callable[..., Any]
    tier: Literal["lossless", "high"] = "lossless"
    devices: tuple[str, ...] = ("cuda",)
    self_check: Callable[..., str | None] | None = None


@dataclass(frozen=True)
class FusedOpsReport:
    """What ran since the last reset: fused calls per op, fallbacks per (op, reason), failed checks."""

    tiers: tuple[Tier, ...]  # tiers other than "off" that were active during the recorded calls
    fused_calls: dict[str, int]
    fallbacks: dict[tuple[str, str], int]
    mismatches: tuple[str, ...]
    verified_signatures: int
    remembered_signatures: int = 0  # of those, passed in an earlier process on this machine (`verified`)

    @property
    def all_fused(self) -> bool:
        """True when at least one op ran fused and nothing fell back to its reference."""
        return bool(self.fused_calls) and not self.fallbacks

    @property
    def tier_used(self) -> str:
        """What actually ran: "off", the requested tier, or "<tier>, partly reference"."""
        if not self.tiers:
            return "off"
        tier = max(self.tiers, key=_RANK.__getitem__)
        return tier if not self.fallbacks else f"{tier}, partly reference"

    def __str__(self) -> str:
        lines = [
            f"fused tier {self.tier_used}: {sum(self.fused_calls.values())} fused calls, "
            f"{sum(self.fallbacks.values())} reference fallbacks, "
            f"{self.verified_signatures} signatures verified bit-exact"
            + (f" ({self.remembered_signatures} by an earlier process)" if self.remembered_signatures else "")
        ]
        lines += [f"  fused     {op}: {n}" for op, n in sorted(self.fused_calls.items())]
        lines += [f"  reference {op}: {n} x {reason}" for (op, reason), n in sorted(self.fallbacks.items())]
        lines += [f"  MISMATCH  {m}" for m in self.mismatches]
        return "\n".join(lines)


@dataclass
class _Record:
    fused_calls: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[tuple[str, str]] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    tiers: set[Tier] = field(default_factory=set)
    logged: set[tuple[str, str]] = field(default_factory=set)
    # signature -> None (verified) or the reason the reference is used for it from now on
    signatures: dict[tuple[Any, ...], str | None] = field(default_factory=dict)
    remembered: int = 0  # signatures taken as verified from an earlier process's record


_lock = threading.Lock()
_record = _Record()


def fused_ops_report() -> FusedOpsReport:
    """Summary of fused and reference calls since the last `reset_fused_ops_report()`."""
    with _lock:
        return FusedOpsReport(
            tiers=tuple(sorted(_record.tiers, key=_RANK.__getitem__)),
            fused_calls=dict(_record.fused_calls),
            fallbacks=dict(_record.fallbacks),
            mismatches=tuple(_record.mismatches),
            verified_signatures=sum(1 for v in _record.signatures.values() if v is None),
            remembered_signatures=_record.remembered,
        )


def reset_fused_ops_report(forget_signatures: bool = False) -> None:
    """Clear the counters (e.g. per image); `forget_signatures` also drops verification results."""
    global _record
    with _lock:
        signatures = {} if forget_signatures else _record.signatures
        remembered = 0 if forget_signatures else _record.remembered
        _record = _Record(signatures=signatures, remembered=remembered)


def run_op(op: FusedOp, *args: Any) -> Any:
    """Run `op` fused if the active tier, the device, the kernel's guards and verification allow it."""
    if torch.compiler.is_compiling():
        return op.reference(*args)
    tier = _tier.get()
    if tier == "off":
        return op.reference(*args)
    if tier not in _record.tiers:
        with _lock:
            _record.tiers.add(tier)
    if _RANK[op.tier] > _RANK[tier]:
        _fallback(op.name, f"{op.tier}-tier kernel, active tier is {tier}", logging.INFO)
        return op.reference(*args)
    tensors = [a for a in args if isinstance(a, Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        _fallback(op.name, "inputs require grad; the fused kernels have no backward")
        return op.reference(*args)
    device = tensors[0].device
    if device.type not in op.devices:
        _fallback(op.name, f"inputs on {device.type}; the kernel runs on {'/'.join(op.devices)}")
        return op.reference(*args)

    sig = _signature(op.name, args)
    with _lock:
        known = sig in _record.signatures
        reason = _record.signatures.get(sig)
    if reason is not None:
        _fallback(op.name, reason)
        return op.reference(*args)
    if not known and op.tier == "lossless" and verified.was_verified(sig, device):
        _remember(sig, None)  # verified by an earlier process on this machine (`verified`)
        with _lock:
            _record.remembered += 1
        known = True
    if not known and op.tier == "lossless":
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            _fallback(op.name, "signature not yet verified while a CUDA graph is captured")
            return op.reference(*args)
        return _verify(op, sig, args, device)

    out = _fused(op, sig, args)
    if out is _REJECTED:
        return op.reference(*args)
    with _lock:
        _record.fused_calls[op.name] += 1
    return out


_REJECTED = object()  # `_fused`'s result when the kernel's guards rejected the input


def _fused(op: FusedOp, sig: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
    """`op.fused(*args)`, or `_REJECTED` when its guards raise `UnsupportedInput`: the reason is then remembered
    for `sig` (the reference runs from now on) and counted as a fallback."""
    try:
        return op.fused(*args)
    except UnsupportedInput as e:
        _remember(sig, str(e))
        _fallback(op.name, str(e))
        return _REJECTED


def _verify(op: FusedOp, sig: tuple[Any, ...], args: tuple[Any, ...], device: torch.device) -> Any:
    """First call of a lossless signature: run both paths, keep the fused one only if bit-identical (and
    write a pass down for later processes on this machine, `verified`)."""
    out = _fused(op, sig, args)
    if out is _REJECTED:
        return op.reference(*args)
    fused_out = _unaliased(out, args)
    ref = op.reference(*args)
    problem = _difference(fused_out, ref)
    if problem is None and op.self_check is not None:
        problem = op.self_check(*args)
    if problem is None:
        _remember(sig, None)
        verified.remember(sig, device)
        with _lock:
            _record.fused_calls[op.name] += 1
        return out
    reason = "not bit-exact against its reference; reference used for this signature"
    message = f"{op.name} {_describe(sig)}: {problem}"
    _remember(sig, reason)
    with _lock:
        _record.mismatches.append(message)
    _fallback(op.name, reason, logging.ERROR, detail=message)
    return ref


def _unaliased(out: Any, args: tuple[Any, ...]) -> Any:
    """`out` with copies of the outputs that share memory with an argument (an `out=` buffer).

    The reference writes the same buffer, so the fused result must be set aside before it runs.
    """
    storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, Tensor)}

    def keep(o: Any) -> Any:
        if isinstance(o, tuple):  # nested results, e.g. (r, Fp8Act(data, scale))
            return tuple(keep(p) for p in o)
        return o.clone() if o.untyped_storage().data_ptr() in storages else o

    return keep(out)


def _remember(sig: tuple[Any, ...], reason: str | None) -> None:
    with _lock:
        _record.signatures[sig] = reason


def _fallback(op: str, reason: str, level: int = logging.WARNING, detail: str | None = None) -> None:
    """Count a reference call and log its reason the first time it is seen for this op."""
    key = (op, reason)
    with _lock:
        _record.fallbacks[key] += 1
        first = key not in _record.logged
        _record.logged.add(key)
    if first or detail is not None:
        log.log(level, "fused kernel %s not used: %s%s", op, reason, f" ({detail})" if detail else "")


def _signature(name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Everything a kernel's guards and aten's kernel choice depend on: not the values."""
    parts: list[Any] = [name]
    for a in args:
        if isinstance(a, Tensor):
            parts.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.data_ptr() % 16))
        else:
            parts.append(a)
    return tuple(parts)


def _describe(sig: tuple[Any, ...]) -> str:
    shown = [
        f"{tuple(p[0])}/{p[2]}".replace("torch.", "") if isinstance(p, tuple) else repr(p) for p in sig[1:]
    ]
    return "(" + ", ".join(shown) + ")"


def _flat(x: Any) -> list[Tensor]:
    """The tensors of a result, nested tuples (an `Fp8Act` inside a pair) flattened in order."""
    if isinstance(x, tuple):
        return [t for part in x for t in _flat(part)]
    return [x]


def _difference(out: Any, ref: Any) -> str | None:
    """None when `out` and `ref` (tensors or tuples of them) hold the same values, else a description."""
    outs, refs = _flat(out), _flat(ref)
    if len(outs) != len(refs):
        return f"returned {len(outs)} tensors, the reference {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"output {i} is {tuple(o.shape)}/{o.dtype}, the reference {tuple(r.shape)}/{r.dtype}"
        if o.element_size() == 1 and o.is_floating_point():
            # e4m3: compare the bit patterns, with NaN's two patterns (either sign) as one
            ob, rb = o.view(torch.uint8), r.view(torch.uint8)
            same = (ob == rb) | (((ob & 0x7F) == 0x7F) & ((rb & 0x7F) == 0x7F))
        else:
            same = (o == r) | (o.isnan() & r.isnan())
        if not bool(same.all()):
            bad = int((~same).sum())
            diff = (o.float() - r.float()).abs().nan_to_num(float("inf")).max().item()
            return f"output {i}: {bad} of {o.numel()} elements differ, max |diff| {diff:.3g}"
    return None
