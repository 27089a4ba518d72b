"""The safetensors header reader: as strict as the library, every fault one WeightsError naming the file."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flux_runtime.weights import WeightsError
from flux_runtime.weights.safetensors_io import TensorSource, read_header
from tests.fuzz import mutate_json, mutate_text


def _write(path: Path, header: bytes, data: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _valid(tmp_path: Path) -> tuple[dict, bytes]:
    """The header (as JSON) and data of a small real file: three dtypes, a 0-d and an empty tensor."""
    tensors = {
        "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b.bias": torch.ones(4, dtype=torch.bfloat16),
        "c.count": torch.tensor(7, dtype=torch.int64),
        "d.empty": torch.zeros(0, 3),
    }
    path = tmp_path / "valid.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def test_fuzzed_headers_give_a_header_or_a_weights_error(tmp_path: Path) -> None:
    header, data = _valid(tmp_path)
    rng = random.Random(0)
    accepted = 0
    for case in range(300):
        path = tmp_path / f"f{case}.safetensors"
        body, tail = data, b""
        if rng.random() < 0.7:
            raw = json.dumps(mutate_json(header, rng)).encode()
        elif rng.random() < 0.5:
            raw = mutate_text(json.dumps(header), rng).encode()
        else:  # a valid header, with the data cut short or followed by bytes
            raw = json.dumps(header).encode()
            body, tail = (data[: rng.randrange(len(data))], b"") if rng.random() < 0.5 else (data, b"\0" * 4)
        _write(path, raw, body + tail)
        try:
            read_header(path)
        except WeightsError as e:
            assert str(e).startswith(str(path)) and "\n" not in str(e)
            continue
        accepted += 1
        # what we accept, the library opens and reads in full, and so does TensorSource
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
        src = TensorSource([path])
        for key in src.keys():
            src.get(key)
    assert 0 < accepted < 100  # the mutations reach both outcomes


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": "F32", "shape": [2]}, r"tensor 'x' has data_offsets None, not \[begin, end\]"),
        ([1, 2], r"header entry 'x' is not an object"),
        ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, r"tensor 'x' has shape '2'"),
        ({"dtype": "F17", "shape": [2], "data_offsets": [0, 8]}, r"tensor 'x' has dtype 'F17'"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, r"is 12 bytes but its data_offsets span 8"),
    ],
)
def test_a_bad_entry_is_named(tmp_path: Path, entry, message) -> None:
    path = _write(tmp_path / "x.safetensors", json.dumps({"x": entry}).encode(), b"\0" * 8)
    with pytest.raises(WeightsError, match=message):
        read_header(path)


def test_bytes_after_the_last_tensor_are_refused(tmp_path: Path) -> None:
    header = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    path = _write(tmp_path / "x.safetensors", json.dumps(header).encode(), b"\0" * 12)
    with pytest.raises(WeightsError, match="4 bytes follow the last tensor"):
        read_header(path)
