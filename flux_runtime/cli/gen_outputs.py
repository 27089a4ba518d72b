"""`flux-gen --out`: the PNG paths a run writes, checked before any weights are read.

The folder exists (a folder --out is made), takes new files, and holds none of the paths unless --overwrite.
One call writes `--out` itself or, for several images or a folder, numbered names; `--prompts` writes each
line's images into the --out folder under names `prompts_file` gives them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click


def output_paths(out: Path, n: int, seed: int, overwrite: bool) -> list[Path]:
    """The PNG paths to write, in a folder that exists (created for a folder --out) and takes new files."""
    if out.is_dir() or str(out).endswith(("/", "\\")) or out.suffix == "":
        _make_folder(out)
        folder = out
        paths = [out / f"flux-{seed}-{i}.png" for i in range(n)]
    elif out.suffix.lower() != ".png":
        raise click.ClickException(f"--out {out}: images are written as PNG; give a .png file or a folder")
    else:
        folder = out.parent
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise click.ClickException(f"--out {out}: {folder} {what}; create it or choose another --out")
        paths = [out] if n == 1 else [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(n)]
    _check_writable(out, folder)
    _refuse_existing(paths, overwrite)
    return paths


def prompts_paths(out: Path, names: list[list[str]], overwrite: bool) -> list[list[Path]]:
    """--prompts: each line's PNG paths (`names`) in the --out folder, made if missing, taking new files."""
    if not out.is_dir() and (out.exists() or out.suffix.lower() == ".png"):
        raise click.ClickException(
            f"--out {out}: with --prompts, --out is a folder (one PNG per image, named by line); give a folder"
        )
    _make_folder(out)
    _check_writable(out, out)
    paths = [[out / name for name in line] for line in names]
    _refuse_existing([p for line in paths for p in line], overwrite)
    return paths


def _make_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.ClickException(f"--out {out}: cannot make this folder ({e.strerror or e})") from None


def _check_writable(out: Path, folder: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise click.ClickException(f"--out {out}: cannot write in {folder} ({e.strerror or e})") from None


def _refuse_existing(paths: list[Path], overwrite: bool) -> None:
    """One error naming the files that exist (the first three of many), unless they are to be replaced."""
    clash = [str(p) for p in paths if p.exists()]
    if clash and not overwrite:
        shown = ", ".join(clash[:3]) + (f" and {len(clash) - 3} more" if len(clash) > 3 else "")
        verb = "exists" if len(clash) == 1 else "exist"
        raise click.ClickException(f"{shown} already {verb}; pass --overwrite or choose another --out")
