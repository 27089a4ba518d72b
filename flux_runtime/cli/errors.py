"""How `flux-gen` and `flux-convert` end on an error: one line and exit 1, the traceback only with `--debug`.

Errors we foresee (bad input said in our words, files, memory) print their own first line. Anything else
is a bug of ours or of a library below us: it prints one line too, naming the exception and asking for a
report. Ctrl-C prints "interrupted" and exits 130, as shells expect.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

# Our error types, by module. An exception of one of them can only exist once its module is loaded, so
# they are looked up in `sys.modules` rather than imported here (which would import torch, too early to
# catch a Ctrl-C while it loads).
_OUR_ERRORS = (
    ("flux_runtime.pipeline.errors", "FluxError"),
    ("flux_runtime.weights.errors", "WeightsError"),
    ("flux_runtime.parallel.group", "ParallelError"),
)
INTERRUPTED_EXIT = 130


class Interrupted(click.ClickException):
    exit_code = INTERRUPTED_EXIT


def is_foreseen(e: BaseException) -> bool:
    """Ours (FluxError, WeightsError, ParallelError), the file system's (OSError), or out of memory."""
    if isinstance(e, (OSError, MemoryError)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, torch.OutOfMemoryError):
        return True
    for module, name in _OUR_ERRORS:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(e, getattr(loaded, name)):
            return True
    return False


def one_line(e: BaseException) -> str:
    """The message printed for `e`: its first line, and for an unforeseen error what it is and whom to tell."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if is_foreseen(e):
        return first
    return (
        f"internal error: {type(e).__name__}: {first} (please report this, with the command that caused it; "
        "--debug shows the traceback)"
    )


@contextmanager
def one_line_errors(debug: bool) -> Iterator[None]:
    """Run a command's body: click's own exceptions pass, any other error becomes one ClickException line.

    With `debug` nothing is translated, so Python prints the full traceback.
    """
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
        raise
    except KeyboardInterrupt:
        if debug:
            raise
        raise Interrupted("interrupted") from None
    except Exception as e:  # the command line is where every error becomes one line
        if debug:
            raise
        raise click.ClickException(one_line(e)) from None
