"""Reading safetensors files one tensor at a time, with clear errors for broken files."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from flux_runtime.weights.errors import WeightsError

_MAX_HEADER = 100 * 1024 * 1024


def read_header(path: Path) -> dict[str, dict]:
    """Parse and check a safetensors header: key → {dtype, shape, data_offsets}.

    Raises `WeightsError` for an empty, truncated or non-safetensors file instead of the
    library's low-level message.
    """
    size = os.path.getsize(path)
    if size == 0:
        raise WeightsError(f"{path}: the file is empty")
    if size < 8:
        raise WeightsError(f"{path}: {size} bytes is too short to be a safetensors file")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise WeightsError(
                f"{path}: not a safetensors file (header length {n} does not fit in {size} bytes)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise WeightsError(
            f"{path}: the file is truncated ({size} bytes, its header describes {8 + n + end})"
        )
    return header


class TensorSource:
    """Lazy view over one or more safetensors files: shapes from the headers, tensors on demand."""

    def __init__(self, files: list[Path]) -> None:
        if not files:
            raise WeightsError("no safetensors files to read")
        self.files = files
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for path in files:
            for key, info in read_header(path).items():
                if key in self._where:
                    raise WeightsError(f"key {key!r} appears in both {self._where[key]} and {path}")
                self._where[key] = path
                self._shapes[key] = tuple(info["shape"])
                self._dtypes[key] = str(info.get("dtype", ""))
        self._handles: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def dtype(self, key: str) -> str:
        """The header's dtype name (`BF16`, `F8_E4M3`, ...)."""
        return self._dtypes[key]

    def get(
        self, key: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Read one tensor and move it to `device`/`dtype` (host memory holds one tensor at a time)."""
        path = self._where[key]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
        t = handle.get_tensor(key)
        return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)

    def items(
        self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self._where:
            yield key, self.get(key, device, dtype)
