"""What the text-encoder tests share."""

from __future__ import annotations

import shutil
from pathlib import Path


def cache_repo(cache: Path, repo_id: str, files: Path) -> None:
    """Lay `files` out as the Hugging Face cache holds a downloaded snapshot of `repo_id`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    shutil.copytree(files, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
