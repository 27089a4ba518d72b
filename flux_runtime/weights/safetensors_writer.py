"""Writing safetensors files tensor by tensor, from a header planned before any tensor is read.

Used by the converter to stream checkpoints of any size with one step's tensors in memory; sizes parse
the way diffusers' `max_shard_size` does.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flux_runtime.weights.dtype_names import ST_DTYPES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """Bytes in `size`: an int, or a string like diffusers' `"10GB"` (GB = 10^9, GiB = 2^30)."""
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE.match(size)
        if not m:
            raise ValueError(f"cannot read {size!r} as a size: use bytes or a unit, like 10GB, 500MB or 2GiB")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if n <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return n


@dataclass(frozen=True)
class Output:
    """One tensor a conversion writes."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class SafetensorsWriter:
    """One safetensors file written tensor by tensor: the header from the planned outputs, then the bytes.

    Tensors must arrive in the planned order with the planned shape and dtype; `close` checks that
    all of them came. The file is the one `safetensors.torch.save_file` would accept loading.
    """

    def __init__(self, path: Path, outputs: list[Output], metadata: dict[str, str] | None = None) -> None:
        if sys.byteorder != "little":
            raise RuntimeError(
                "safetensors files are little-endian; writing them on a big-endian host is not supported"
            )
        header: dict[str, Any] = {}
        offset = 0
        for o in outputs:
            header[o.key] = {
                "dtype": ST_DTYPES[o.dtype],
                "shape": list(o.shape),
                "data_offsets": [offset, offset + o.nbytes],
            }
            offset += o.nbytes
        header["__metadata__"] = metadata or {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
        self.path, self.outputs, self.written = path, outputs, 0
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close(), across many write calls)
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, key: str, t: Tensor) -> None:
        want = self.outputs[self.written]
        if key != want.key or tuple(t.shape) != want.shape or t.dtype != want.dtype:
            raise AssertionError(f"{self.path}: got {key} {tuple(t.shape)} {t.dtype}, planned {want}")
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(data.data)
        self.written += 1

    def close(self) -> None:
        self._file.close()
        if self.written != len(self.outputs):
            raise AssertionError(f"{self.path}: wrote {self.written} of {len(self.outputs)} planned tensors")

    def abort(self) -> None:
        self._file.close()


def shard(outputs: list[Output], max_shard_size: int) -> list[list[Output]]:
    """Split `outputs`, in order, into shards of at most `max_shard_size` bytes (a larger tensor goes alone)."""
    shards: list[list[Output]] = [[]]
    size = 0
    for o in outputs:
        if shards[-1] and size + o.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(o)
        size += o.nbytes
    return shards
