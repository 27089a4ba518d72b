"""Finding checkpoints: a local path, or a Hugging Face model id already in the local cache."""

from __future__ import annotations

import re
from pathlib import Path

from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(path_or_id: str | Path) -> Path:
    """Return a local path for a file, a folder, or a cached model id (never touches the network)."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    name = str(path_or_id)
    if not _REPO_ID.match(name):
        raise WeightsError(
            f"{name!r} is neither an existing file or folder nor a Hugging Face model id (org/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        raise WeightsError(
            f"unknown model id {name!r}: it is not in the local Hugging Face cache; "
            f"fetch it first with `hf download {name}` (or pass a local path)"
        ) from None


def safetensors_files(folder: Path, stem: str) -> list[Path]:
    """The shards of `stem` in `folder`: `stem.safetensors.index.json`'s files, or `stem.safetensors`."""
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()
        ):
            raise WeightsError(
                f"{index}: not a valid safetensors index ('weight_map' must map each key to a shard file name)"
            )
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index} names shards that are not there: {', '.join(missing)}")
        return files
    single = folder / f"{stem}.safetensors"
    return [single] if single.is_file() else []
