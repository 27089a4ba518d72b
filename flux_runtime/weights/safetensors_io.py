"""Reading safetensors files one tensor at a time, with clear errors for broken files.

`read_header` checks a header as strictly as the safetensors library does when it opens the file (every
entry an object with a known dtype, a shape and `data_offsets` that agree, the tensors tiling the data with
no gap, overlap or trailing bytes), so a damaged file fails here, naming the file and the tensor, and
never later inside `safe_open` or a loader.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from flux_runtime.weights import pinned_stream
from flux_runtime.weights.dtype_names import FLOAT_KINDS, ITEMSIZE, TORCH_DTYPES
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import safetensors_files

_MAX_HEADER = 100 * 1024 * 1024
# The floating-point kinds a load casts to the model's dtype (FP8 weights keep their own bytes).
CAST_KINDS = frozenset(k for k in FLOAT_KINDS if not k.startswith("F8"))


def _cast(dtype: torch.dtype | None, kind: str) -> torch.dtype | None:
    return dtype if kind.startswith(("F", "BF")) else None


def component_files(
    path: Path, folder: str, marks: Callable[[str], bool], what: str, single: str, named: str | None = None
) -> list[Path]:
    """The safetensors files of one model component under `path`: the file itself; under a pipeline root, its
    `folder/`; a diffusers folder's `diffusion_pytorch_model*.safetensors`; else, in a BFL repo root, the file
    `named`, or the first file with a key `marks` takes for the component's. None is a WeightsError saying what
    was looked for (`what`, the BFL `single` file)."""
    if path.is_file():
        return [path]
    if (path / folder).is_dir():
        return component_files(path / folder, folder, marks, what, single, named)
    files = safetensors_files(path, "diffusion_pytorch_model")
    if files:
        return files
    if named is not None and (path / named).is_file():
        return [path / named]
    for f in sorted(path.glob("*.safetensors")):
        if any(marks(k) for k in read_header(f)):
            return [f]
    raise WeightsError(
        f"{path}: no {what} found (no {folder}/ folder, no diffusion_pytorch_model*.safetensors, no {single})"
    )


def read_header(path: Path) -> dict[str, dict]:
    """Parse and check a safetensors header: key → {dtype, shape, data_offsets} (`__metadata__` dropped).

    Raises `WeightsError` for an empty, truncated or non-safetensors file, or a header entry of the wrong
    form, naming the file and the entry, instead of the library's low-level message.
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
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightsError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: not a safetensors file (header is not a JSON object)")
    meta = header.pop("__metadata__", None)
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())
    ):
        raise WeightsError(f"{path}: the header's __metadata__ must map names to strings")
    spans = sorted((_check_entry(path, key, info), key) for key, info in header.items())
    end = 0
    for (begin, stop), key in spans:
        if begin != end:
            raise WeightsError(
                f"{path}: tensor {key!r} starts at byte {begin} of the data, expected {end} "
                "(tensors overlap or leave a gap: a damaged file)"
            )
        end = stop
    data = size - 8 - n
    if end > data:
        raise WeightsError(
            f"{path}: the file is truncated ({size} bytes, its header describes {8 + n + end})"
        )
    if end < data:
        raise WeightsError(
            f"{path}: {data - end} bytes follow the last tensor (not a safetensors file as written, or damaged)"
        )
    return header


def _check_entry(path: Path, key: str, info: Any) -> tuple[int, int]:
    """The `(begin, end)` data offsets of one header entry, after checking its dtype, shape and size agree."""
    if not isinstance(info, dict):
        raise WeightsError(
            f"{path}: header entry {key!r} is not an object with dtype, shape and data_offsets"
        )
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise WeightsError(
            f"{path}: tensor {key!r} has dtype {dtype!r}, not a safetensors dtype flux-runtime reads"
        )
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise WeightsError(f"{path}: tensor {key!r} has shape {shape!r}, not a list of sizes >= 0")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise WeightsError(
            f"{path}: tensor {key!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end"
        )
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise WeightsError(
            f"{path}: tensor {key!r} ({dtype} {tuple(shape)}) is {nbytes} bytes but its data_offsets "
            f"span {offsets[1] - offsets[0]}"
        )
    return offsets[0], offsets[1]


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class TensorSource:
    """Lazy view over one or more safetensors files: shapes and dtypes from the headers, tensors on demand."""

    def __init__(self, files: list[Path]) -> None:
        if not files:
            raise WeightsError("no safetensors files to read")
        self.files = files
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # absolute byte range in its file
        for path in files:
            header = read_header(path)  # checked first: an empty or damaged file fails in our words
            with open(path, "rb") as f:
                data_start = 8 + struct.unpack("<Q", f.read(8))[0]
            for key, info in header.items():
                if key in self._where:
                    raise WeightsError(f"key {key!r} appears in both {self._where[key]} and {path}")
                self._where[key] = path
                self._shapes[key] = tuple(info["shape"])
                self._dtypes[key] = info["dtype"]
                begin, end = info["data_offsets"]
                self._spans[key] = (data_start + begin, data_start + end)
        self._handles: dict[Path, Any] = {}
        self._stream: pinned_stream.DeviceStream | None = None

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def dtype(self, key: str) -> str:
        """The safetensors dtype name the header gives `key` (`BF16`, `F32`, `F8_E4M3`, `I8`, ...)."""
        return self._dtypes[key]

    def path_of(self, key: str) -> Path:
        """The file holding `key`."""
        return self._where[key]

    def file_order(self, keys: Iterable[str]) -> list[str]:
        """`keys` in the order they lie on disk (file by file, by offset): the order a read streams best."""
        return sorted(keys, key=lambda k: (self.files.index(self._where[k]), self._spans[k][0]))

    @contextmanager
    def streaming(self, keys: Iterable[str], device: torch.device | str) -> Iterator[None]:
        """Within the scope, `get(key, device)` of the planned `keys` is served by reading ahead in this order.

        On a GPU the bytes go through a bounded ring of pinned buffers filled by several reader threads and
        are copied on a side stream (`pinned_stream`): the load runs at the machine's copy bandwidth and
        its per-tensor work (casts, merges, quantization) overlaps the reads. Keys outside the plan, and
        every key on the CPU, are read as without a plan. The bytes, hence the loaded tensors, are the same.
        """
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if self._stream is not None or not (
            dev.type == "cuda" or (dev.type == "cpu" and pinned_stream.stream_on_cpu)
        ):
            yield
            return
        plan = [
            pinned_stream.Span(k, self._where[k], self._spans[k][0], self._spans[k][1] - self._spans[k][0])
            for k in dict.fromkeys(keys)
            if TORCH_DTYPES.get(self._dtypes[k]) is not None
        ]
        with pinned_stream.device_stream(plan, dev) as stream:
            self._stream = stream
            try:
                yield
            finally:
                self._stream = None

    def get(
        self, key: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Read one tensor and move it to `device`/`dtype` (host memory holds one tensor at a time).

        Without a `streaming` plan the bytes are read with plain file reads into a fresh tensor, not
        through a memory map: mapped file pages would count in this process's resident memory for as long
        as the file stays open, nearly doubling the host memory a load takes.
        """
        path = self._where[key]
        torch_dtype = TORCH_DTYPES.get(self._dtypes[key])
        if torch_dtype is None:  # a dtype torch reads only through safetensors (none FLUX uses)
            return self._get_mapped(key).to(device=device, dtype=_cast(dtype, self._dtypes[key]))
        stream = self._stream
        if stream is not None and stream.has(key) and _same_device(stream.device, device):
            raw = stream.take(key)
        else:
            begin, end = self._spans[key]
            raw = torch.empty(end - begin, dtype=torch.uint8)
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = open(path, "rb")  # noqa: SIM115 - kept open across reads
            handle.seek(begin)
            if handle.readinto(memoryview(raw.numpy())) != end - begin:
                raise WeightsError(f"{path}: cannot read {key!r} (the file is shorter than its header says)")
        t = raw.view(torch_dtype).reshape(self._shapes[key])
        return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)

    def _get_mapped(self, key: str) -> torch.Tensor:
        path = self._where[key]
        try:
            return safe_open(str(path), framework="pt", device="cpu").get_tensor(key)
        except SafetensorError as e:
            raise WeightsError(f"{path}: cannot read {key!r} ({e})") from None

    def items(
        self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self._where:
            yield key, self.get(key, device, dtype)


def _same_device(have: torch.device, want: torch.device | str) -> bool:
    want = torch.device(want)
    if want.type == "cuda" and want.index is None:
        return have.type == "cuda" and have.index == torch.cuda.current_device()
    return have == want


def read_state_dict(files: list[Path], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every tensor of `files` on `device` in its stored dtype, read in file order (streamed onto a GPU)."""
    src = TensorSource(files)
    order = src.file_order(src.keys())
    with src.streaming(order, device):
        return {k: src.get(k, device) for k in order}


def check_safetensors_folder(folder: Path, stem: str = "model") -> None:
    """Check the headers of the `stem` safetensors weights in `folder` (single file or sharded), if any.

    For models that a third-party loader opens (the text encoders): a damaged file then fails here in our
    words before that loader reads it.
    """
    for path in safetensors_files(folder, stem):
        read_header(path)


def files_fingerprint(files: list[Path]) -> str:
    """A short fingerprint of a model's weight files: sha256 over their names, sizes and first 64 KiB (the
    header, whose offsets pin every tensor's size), cheap for files of many GB."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        digest.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(1 << 16))
    return digest.hexdigest()[:16]
