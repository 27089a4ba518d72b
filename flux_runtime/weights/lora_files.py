"""Reading a LoRA: its file (a path, a folder holding one, a cached Hugging Face id), bytes, tensors and metadata."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from torch import Tensor

from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.lora_common import LoraError
from flux_runtime.weights.safetensors_io import read_header


def lora_file(path_or_id: str | Path) -> Path:
    """The file of a LoRA given as a .safetensors path, a folder holding one, or a Hugging Face id in the
    local cache (`pytorch_lora_weights.safetensors` where a folder holds several)."""
    try:
        path = resolve(path_or_id)
    except WeightsError as e:
        raise LoraError(f"LoRA {e}") from None
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        named = path / "pytorch_lora_weights.safetensors"
        if named.is_file():
            files = [named]
        if len(files) != 1:
            found = ", ".join(f.name for f in files) if files else "none"
            raise LoraError(f"{path_or_id}: give the LoRA file itself; this folder holds {found}")
        path = files[0]
    return path.resolve()


def check_lora_file(path_or_id: str | Path) -> Path:
    """`lora_file`, its safetensors header read and checked (no tensor data): what a command checks before it
    loads a model, so a missing or damaged LoRA fails first."""
    path = lora_file(path_or_id)
    try:
        read_header(path)
    except WeightsError as e:
        raise LoraError(f"{e}; LoRAs are read from .safetensors") from None
    return path


def open_lora(path_or_id: str | Path) -> tuple[Path, bytes, str]:
    """(the file, its bytes, their sha256) of a LoRA (`lora_file`)."""
    path = lora_file(path_or_id)
    data = path.read_bytes()
    return path, data, hashlib.sha256(data).hexdigest()


def read_lora(data: bytes, name: str) -> tuple[dict[str, Tensor], dict | None]:
    """The tensors of a safetensors LoRA (CPU, the file's dtypes, keys sorted) and its PEFT metadata."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        sd = load(data)
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
    except (SafetensorError, struct.error, ValueError) as e:
        raise LoraError(f"{name}: not a safetensors file ({e}); LoRAs are read from .safetensors") from None
    sd = {k: sd[k] for k in sorted(sd)}
    if not sd:
        raise LoraError(f"{name}: the file holds no tensors")
    for k, t in sd.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise LoraError(f"{name}: {k} holds NaN or infinite values; the file is damaged")
    raw = (header.get("__metadata__") or {}).get("lora_adapter_metadata")
    try:
        metadata = json.loads(raw) if raw else None
    except ValueError:
        raise LoraError(f"{name}: its lora_adapter_metadata header is not valid JSON") from None
    return sd, metadata if isinstance(metadata, dict) else None
