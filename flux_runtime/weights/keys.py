"""Reading a checkpoint's keys: prefix stripping, required shapes, and strict key-set errors.

Shared by every loader so a missing, unexpected or misshapen key reads the same everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.safetensors_io import TensorSource

log = logging.getLogger(__name__)

ShapeOf = Callable[[str], tuple[int, ...]]


def strip_prefix(key: str, prefixes: tuple[str, ...]) -> str:
    """`key` without the first of `prefixes` it starts with."""
    for p in prefixes:
        if key.startswith(p):
            return key[len(p) :]
    return key


class KeyView:
    """A TensorSource seen through one component's own names.

    When some keys carry one of `prefixes` (`vae.`, `model.diffusion_model.`, ...), the file holds
    several components: only the keys under the first such prefix are kept, with it stripped.
    Otherwise every key is kept as is.
    """

    def __init__(self, src: TensorSource, prefixes: tuple[str, ...]) -> None:
        self.src = src
        keys = src.keys()
        self.names = {k: k for k in keys}
        for p in prefixes:
            if any(k.startswith(p) for k in keys):
                self.names = {k[len(p) :]: k for k in keys if k.startswith(p)}
                if len(self.names) < len(keys):
                    log.info(
                        "reading the %d keys under %r, ignoring %d others",
                        len(self.names),
                        p,
                        len(keys) - len(self.names),
                    )
                break

    def keys(self) -> list[str]:
        return list(self.names)

    def __contains__(self, key: str) -> bool:
        return key in self.names

    def shape(self, key: str) -> tuple[int, ...]:
        return self.src.shape(self.names[key])

    def dtype(self, key: str) -> str:
        return self.src.dtype(self.names[key])

    def path_of(self, key: str) -> Path:
        return self.src.path_of(self.names[key])

    def get(
        self, key: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        return self.src.get(self.names[key], device, dtype)

    def streaming(self, keys: Iterable[str], device: torch.device | str) -> AbstractContextManager[None]:
        """`TensorSource.streaming` of these keys, under this view's names."""
        return self.src.streaming([self.names[k] for k in keys if k in self.names], device)


def need_shape(shape_of: ShapeOf, key: str, what: str, ndim: int) -> tuple[int, ...]:
    """The shape of `key`, a non-empty `ndim`-D tensor, or a WeightsError saying which property needed it."""
    try:
        shape = tuple(shape_of(key))
    except KeyError:
        raise WeightsError(f"checkpoint has no {key!r} (needed to read the {what})") from None
    if len(shape) != ndim or 0 in shape:
        raise WeightsError(
            f"{key} has shape {shape}, not the non-empty {ndim}-D tensor that gives the {what}"
        )
    return shape


def raise_key_errors(missing: list[str], unexpected: list[str]) -> None:
    """Raise a WeightsError naming up to five missing (first) or unexpected keys."""

    def few(ks: list[str]) -> str:
        return ", ".join(ks[:5]) + (f" (+{len(ks) - 5} more)" if len(ks) > 5 else "")

    if missing:
        raise WeightsError(f"checkpoint is missing {len(missing)} key(s): {few(missing)}")
    if unexpected:
        raise WeightsError(f"checkpoint has {len(unexpected)} unexpected key(s): {few(unexpected)}")
