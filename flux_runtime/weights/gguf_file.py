"""Reading GGUF files (llama.cpp's container, as city96's FLUX quantizations use it) one tensor at a time.

The container is parsed by the `gguf` package's `GGUFReader` (the optional `gguf` extra), never by hand.
`GgufSource` offers what the transformer loaders read of a safetensors `TensorSource` (keys, shapes,
header dtypes, `get`), plus the raw blocks of quantized tensors (`raw`, `ggml_type`) so that a loader can
keep them quantized. A quantized tensor reports the safetensors header name of float16: the values its blocks
stand for are float16 (see `kernels.gguf_dequant`), so every floating-point check of the loaders applies to it as
it is.

Problems are one-line `WeightsError`s naming the file and, where there is one, the tensor: a file cut
short, a GGML type this runtime does not dequantize, a row that is not a whole number of blocks.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flux_runtime.kernels import gguf_dequant
from flux_runtime.kernels.gguf_dequant import GgmlType
from flux_runtime.weights.dtype_names import ST_DTYPES
from flux_runtime.weights.errors import WeightsError

GGUF_MAGIC = b"GGUF"
INSTALL = "pip install 'flux-runtime[gguf]'"


def is_gguf_file(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic (whatever its name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def require_gguf() -> Any:
    """The `gguf` package, or a one-line error naming the extra that installs it."""
    try:
        import gguf
    except ImportError:
        raise WeightsError(
            f"reading a GGUF checkpoint needs the gguf extra (gguf is missing): {INSTALL}"
        ) from None
    return gguf


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: its name, GGML type, shape in torch order (rows first) and stored data
    (a read-only memory map: typed values for float32 and float16, uint8 bytes for bfloat16 and the quantized
    types)."""

    name: str
    ggml_type: GgmlType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.ggml_type.id in gguf_dequant.QUANT_TYPES


def _ggml_type(number: int, name: str, path: Path) -> GgmlType:
    known = gguf_dequant.PLAIN_TYPES.get(number) or gguf_dequant.QUANT_TYPES.get(number)
    if known is not None:
        return known
    gguf = require_gguf()
    try:
        what = gguf.GGMLQuantizationType(number).name
    except ValueError:
        what = f"unknown type {number}"
    supported = ", ".join(gguf_dequant.BY_NAME)
    raise WeightsError(
        f"{path}: {name} is stored as GGML {what}, which is not supported (supported: {supported})"
    )


@functools.cache
def _reader_class(gguf: Any) -> type:
    """A `GGUFReader` that checks each tensor's type, shape and extent before the package maps it, so a
    problem names the tensor (the package itself fails on the first one with a numpy reshape error).

    It reads the tensor-info fields the package has parsed (name, dims, type, offset: the layout of
    `ReaderField.parts` since gguf 0.10, checked on 0.19); a release that lays them out otherwise skips
    these checks and leaves the package's own errors, which `read_tensors` still reports in one line.
    """

    class _Reader(gguf.GGUFReader):  # type: ignore[misc, name-defined]
        def __init__(self, path: Path) -> None:
            self._path = path
            super().__init__(str(path), mode="r")

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            if any(len(field.parts) != 6 for field in fields):  # not the layout this check knows
                return super()._build_tensors(start_offs, fields)
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                qtype = _ggml_type(int(raw_type[0]), name, self._path)
                shape = tuple(int(d) for d in reversed(dims.tolist()))
                if not shape or shape[-1] % qtype.block:
                    raise WeightsError(
                        f"{self._path}: {name} has shape {list(shape)}, whose rows are not a whole number of "
                        f"{qtype.name} blocks of {qtype.block}"
                    )
                n_bytes = int(np.prod(shape)) // qtype.block * qtype.type_size
                end = int(start_offs) + int(offset[0]) + n_bytes
                if end > size:
                    raise WeightsError(
                        f"{self._path}: the file is truncated: {name} ends at byte {end}, the file has {size}"
                    )
            super()._build_tensors(start_offs, fields)

    return _Reader


def read_tensors(path: str | Path) -> list[GgufTensor]:
    """Every tensor of the GGUF file at `path`, in file order (data memory-mapped, nothing copied)."""
    gguf = require_gguf()
    path = Path(path)
    size = os.path.getsize(path)
    if size == 0:
        raise WeightsError(f"{path}: the file is empty")
    try:
        reader = _reader_class(gguf)(path)
    except WeightsError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        why = "not a GGUF file" if "magic" in str(e) else "truncated or damaged"
        raise WeightsError(f"{path}: cannot read the GGUF file ({why}: {e})") from None
    out = []
    for t in reader.tensors:
        qtype = _ggml_type(int(t.tensor_type), t.name, path)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out.append(GgufTensor(t.name, qtype, shape, t.data))
    return out


class GgufSource:
    """The tensors of one GGUF file under the interface the loaders read a `TensorSource` through."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files = [self.path]
        self.tensors: dict[str, GgufTensor] = {}
        for t in read_tensors(self.path):
            if t.name in self.tensors:
                raise WeightsError(f"{self.path}: {t.name} appears twice")
            self.tensors[t.name] = t

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].shape

    def dtype(self, key: str) -> str:
        """The safetensors header name of the values' dtype: the stored float type's, float16's for the quantized
        types (the dtype their blocks dequantize to)."""
        return ST_DTYPES[gguf_dequant.PLAIN_DTYPES.get(self.tensors[key].ggml_type.id, torch.float16)]

    def ggml_type(self, key: str) -> GgmlType:
        return self.tensors[key].ggml_type

    def is_quantized(self, key: str) -> bool:
        return self.tensors[key].quantized

    def nbytes(self, key: str) -> int:
        """The bytes `key` takes as stored (a quantized tensor's blocks stay so once loaded)."""
        return int(self.tensors[key].data.nbytes)

    def path_of(self, key: str) -> Path:
        return self.path

    def file_order(self, keys: Iterable[str]) -> list[str]:
        order = {k: i for i, k in enumerate(self.tensors)}
        return sorted(keys, key=order.__getitem__)

    @contextlib.contextmanager
    def streaming(self, keys: Iterable[str], device: torch.device | str) -> Iterator[None]:
        """No read-ahead plan for GGUF files yet: each tensor is copied from the memory map as asked."""
        yield

    def raw(self, key: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The stored bytes of a quantized tensor, uint8 (rows, bytes per row), on `device`."""
        t = self.tensors[key]
        data = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
        return data.reshape(*t.shape[:-1], -1).to(device)

    def get(
        self, key: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """One tensor's values on `device` in `dtype` (stored dtype without one); a quantized tensor is
        dequantized (fp16, as diffusers does) and then cast."""
        t = self.tensors[key]
        if t.quantized:
            values = gguf_dequant.dequantize(self.raw(key, device), t.ggml_type)
        else:
            stored = gguf_dequant.PLAIN_DTYPES[t.ggml_type.id]
            data = torch.from_numpy(np.array(t.data, copy=True))
            values = data.view(stored).reshape(t.shape).to(device)
        return values if dtype is None else values.to(dtype)
