"""The PNGs flux-serve answers by URL (`response_format="url"`): a bounded folder of randomly named files."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

_FILE_NAME = re.compile(r"^[0-9a-f]{32}\.png$")


class ImageStore:
    """The PNGs answered by `url`: a folder holding at most `max_files`, the oldest removed first."""

    def __init__(self, folder: Path, max_files: int) -> None:
        self.folder, self.max_files = folder, max_files
        folder.mkdir(parents=True, exist_ok=True)
        self._names: list[str] = []

    def put(self, data: bytes) -> str:
        """Store `data` under a new random name; written beside it and renamed in, so a process killed
        mid-write leaves no partial PNG to serve (the name pattern never matches the temporary file)."""
        name = f"{secrets.token_hex(16)}.png"
        tmp = self.folder / f".{name}.partial"
        tmp.write_bytes(data)
        os.replace(tmp, self.folder / name)
        self._names.append(name)
        while len(self._names) > self.max_files:
            (self.folder / self._names.pop(0)).unlink(missing_ok=True)
        return name

    def path(self, name: str) -> Path | None:
        if not _FILE_NAME.match(name) or not (self.folder / name).is_file():
            return None
        return self.folder / name
