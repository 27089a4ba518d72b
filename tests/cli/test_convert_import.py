"""`flux-convert` loads no torch at import (Ctrl-C while torch loads is one line), with the library's choices."""

from __future__ import annotations

import subprocess
import sys

from flux_runtime.cli import convert as cli
from flux_runtime.weights import convert as library


def test_the_command_names_the_library_choices() -> None:
    assert cli.COMPONENTS == library.COMPONENTS
    assert cli.DEFAULT_MAX_SHARD_SIZE == library.DEFAULT_MAX_SHARD_SIZE


def test_the_command_names_the_gguf_types() -> None:
    from flux_runtime.weights import gguf_write

    assert cli.GGUF_TYPES == gguf_write.GGUF_TYPES


def test_importing_the_command_loads_no_torch() -> None:
    code = "import sys, flux_runtime.cli.convert; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
