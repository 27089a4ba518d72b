"""What the flux-convert tests share: running the command (to success, or to one error line) and reading back
what it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from flux_runtime.cli.convert import main


def run(*args: object) -> str:
    """Run a conversion that must succeed; its output."""
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def fail(*args: object) -> str:
    """Run a conversion that must fail: exit code 1 and one `Error: ...` line, no traceback."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def tensors(*paths: Path) -> dict[str, torch.Tensor]:
    """Every tensor in these safetensors files (a folder means all its *.safetensors)."""
    out: dict[str, torch.Tensor] = {}
    for p in paths:
        for f in sorted(p.glob("*.safetensors")) if p.is_dir() else [p]:
            out.update(load_file(f))
    return out


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same keys, and each tensor the same dtype and bits."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def config(folder: Path) -> dict:
    """A written folder's config.json."""
    return json.loads((folder / "config.json").read_text())
