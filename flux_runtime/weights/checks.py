"""What the loaders accept: the `device` and `dtype` asked for, and the dtypes and values of a checkpoint.

Each check fails as one `WeightsError` naming the argument, or the file and the tensor, before the model
sees the value: an int8 or bool tensor is refused by its header (not by `load_state_dict`), a NaN or an
infinity is found as the tensors stream in, and a non-float load dtype is refused before anything is read.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from flux_runtime.weights.dtype_names import FLOAT_KINDS
from flux_runtime.weights.errors import WeightsError

# Stored dtypes a FLUX weight may have: the floating-point safetensors kinds. The float8 kinds are let
# through so that a loader which pairs them with their scales can read them; a loader that must refuse
# them passes its own `allowed`.
WEIGHT_DTYPES: frozenset[str] = FLOAT_KINDS
DEVICE_TYPES = ("cpu", "cuda", "mps")


class HasDtypes(Protocol):
    def dtype(self, key: str) -> str: ...

    def path_of(self, key: str) -> Path: ...


def check_load_dtype(dtype: object) -> torch.dtype:
    """`dtype` if it is a floating-point `torch.dtype` (the dtype weights are loaded in), else a WeightsError."""
    if not isinstance(dtype, torch.dtype):
        raise WeightsError(f"dtype {dtype!r} must be a torch.dtype such as torch.bfloat16")
    if not dtype.is_floating_point:
        raise WeightsError(
            f"dtype {dtype} is not a floating-point dtype: load in torch.bfloat16, torch.float16 or torch.float32"
        )
    return dtype


def check_device(device: object) -> torch.device:
    """`device` as a `torch.device` that exists here: cpu, cuda, cuda:N or mps; else a WeightsError naming the fix."""
    if not isinstance(device, (str, torch.device)):
        raise WeightsError(f"device {device!r} must be a string such as 'cuda' or 'cpu', or a torch.device")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in DEVICE_TYPES:
        raise WeightsError(
            f"device {str(device)!r} is not one to run on: use 'cpu', 'cuda', 'cuda:N' or 'mps'"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise WeightsError(f"device {str(device)!r} asked for, but torch sees no CUDA GPU: use 'cpu'")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise WeightsError(
                f"device {str(device)!r} asked for, but torch sees {count} CUDA GPU(s): use cuda:0 to cuda:{count - 1}"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise WeightsError(f"device {str(device)!r} asked for, but this torch has no MPS: use 'cpu'")
    return dev


def check_weight_dtypes(
    src: HasDtypes, keys: Iterable[str], allowed: Collection[str] = WEIGHT_DTYPES
) -> None:
    """Refuse, from the headers alone, a weight stored as an integer or bool (or anything outside `allowed`)."""
    for key in keys:
        kind = src.dtype(key)
        if kind not in allowed:
            raise WeightsError(
                f"{src.path_of(key)}: {key} is stored as {kind}; the model's weights are floating point "
                f"({', '.join(sorted(allowed))})"
            )


class FiniteCheck:
    """Finds NaN and infinite weights as they are read, with one host sync at the end instead of one a tensor.

    `watch(key, path, t)` records, on `t`'s device, whether `t` is all finite and returns `t` unchanged;
    `raise_if_any()` reads the records once and names the first tensor that is not. Float8 tensors are
    checked as float16 (exact for both float8 kinds), as `torch.isfinite` has no float8 kernel on every build.
    """

    def __init__(self) -> None:
        self._seen: list[tuple[str, Path, torch.dtype]] = []
        self._flags: list[Tensor] = []

    def watch(self, key: str, path: Path, t: Tensor) -> Tensor:
        if t.is_floating_point():
            x = t.to(torch.float16) if t.element_size() == 1 else t
            self._seen.append((key, path, t.dtype))
            self._flags.append(torch.isfinite(x).all())
        return t

    def reader(self, get: Callable[[str], Tensor], path_of: Callable[[str], Path]) -> Callable[[str], Tensor]:
        """`get` with every tensor it returns watched."""
        return lambda key: self.watch(key, path_of(key), get(key))

    def raise_if_any(self) -> None:
        if not self._flags:
            return
        devices = {f.device for f in self._flags}
        flags = torch.stack([f.to(self._flags[0].device) if len(devices) > 1 else f for f in self._flags])
        bad = (~flags).nonzero()
        if bad.numel():
            key, path, dtype = self._seen[int(bad[0, 0])]
            raise WeightsError(
                f"{path}: {key} holds NaN or infinite values in {str(dtype).removeprefix('torch.')} "
                "(a damaged checkpoint, or values beyond that dtype's range)"
            )
