"""Loading `transformers` models without their progress bars (flux-gen draws its own; errors stay one line)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """Inside the block `transformers` draws no "Loading weights" bar; the previous setting is restored after."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
