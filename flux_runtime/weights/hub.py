"""Finding checkpoints: a local path, or a Hugging Face model id in the local cache (`weights.download` fetches
them)."""

from __future__ import annotations

import re
from pathlib import Path

from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(path_or_id: str | Path) -> Path:
    """Return a local path for a file, a folder, or a model id in the local cache (never touches the network).

    A cached id gives its snapshot folder, which may hold only the files a load reads (`weights.download`
    fetches no more); the loaders check their own files."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    name = str(path_or_id)
    if not _REPO_ID.match(name):
        raise WeightsError(
            f"{name!r} is neither an existing file or folder nor a Hugging Face model id (org/name)"
        )
    folder = cached_snapshot(name)
    if folder is None:
        raise WeightsError(
            f"{name!r} is not in the local Hugging Face cache, and this load fetches nothing (offline: "
            "--offline, HF_HUB_OFFLINE=1 or download=False): fetch it once online (`flux-gen --model ... "
            "--download-only`, or a load with download=True), or pass a local path"
        )
    return folder


def hub_id(path_or_id: str | Path) -> str | None:
    """`path_or_id` if it names a Hugging Face model (org/name) rather than an existing file or folder."""
    name = str(path_or_id)
    if Path(name).expanduser().exists() or not _REPO_ID.match(name):
        return None
    return name


def cached_snapshot(repo_id: str) -> Path | None:
    """The local cache's snapshot folder of `repo_id`'s default branch, or None (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # allow_patterns=[]: the folder whatever part of the repo it holds (else huggingface_hub refuses a
        # snapshot that lacks files of the repo that no load reads)
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=[]))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None


def cached_revision(path: Path) -> tuple[str, str] | None:
    """(repo id, commit) when `path` lies in a snapshot of the Hugging Face cache
    (`.../models--org--name/snapshots/<commit>/...`), else None."""
    parts = path.absolute().parts  # not resolved: a snapshot's files are links into blobs/
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return parts[i - 1].removeprefix("models--").replace("--", "/"), parts[i + 1]
    return None


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
