"""The error type users see from the pipeline: one line that names the problem; and `warn_caller`, for the
warnings that should point at the user's own line."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path


class FluxError(ValueError):
    """Bad input or an impossible request (size, steps, memory), said in our words."""


def warn_caller(message: str) -> None:
    """`warnings.warn(message)` attributed to the first frame outside flux_runtime and torch (whose no_grad
    wrapper sits between a call and the pipeline): the user's call, whatever the depth of the recipe that
    noticed."""
    import torch

    inner = tuple(
        f"{Path(m.__file__).parent}{os.sep}" for m in (sys.modules["flux_runtime"], torch) if m.__file__
    )
    frame, level = sys._getframe(1), 2  # stacklevel 2 is this function's caller
    while frame is not None and frame.f_code.co_filename.startswith(inner):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)
