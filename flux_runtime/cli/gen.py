"""`flux-gen`: one click command: parse, call `Pipeline`, save PNGs with their provenance.

FLUX.1, FLUX.2 and FLUX.3 alike (`Pipeline.from_pretrained` picks by the checkpoint); FLUX.2 and FLUX.3 also
edit with `--image` reference images, whose paths and pixel fingerprints go into the provenance so `--replay` can
refuse a reference that has gone or changed. Library errors become one line and exit 1 here, and only
here (`--debug` shows the traceback instead). Nothing heavy is imported at module level, so that even a
Ctrl-C while torch loads ends in one line. Every check that needs no model (output folder, device, prompt,
step count, guidance, reference images) runs before any weights are read. `--prompts FILE` makes one such call
per line of FILE with one load, every line checked first (the file's reading is `prompts_file`'s).

The command's parts, each in its module: the option table (`gen_options`), the checks (`gen_checks`) and
output paths (`gen_outputs`), `--replay` (`gen_replay`), fetching (`gen_download`), the run (`gen_run`) and
`--gpus` (`gen_ranks`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import click

from flux_runtime.cli import early_cuda
from flux_runtime.cli.errors import one_line_errors
from flux_runtime.cli.gen_checks import parse_lora, prompts_file_options
from flux_runtime.cli.gen_download import download_only
from flux_runtime.cli.gen_options import GROUPS, MODEL_CHOICES, PARAMS
from flux_runtime.cli.gen_ranks import launched_rank, rank_errors, spawn_ranks
from flux_runtime.cli.gen_replay import apply_replay
from flux_runtime.cli.gen_run import generate
from flux_runtime.cli.timings import Stopwatch
from flux_runtime.command_help import DOCS_PAGE, GroupedCommand

__all__ = ["MODEL_CHOICES", "main", "parse_lora", "run"]


@click.command(
    cls=GroupedCommand,
    groups=GROUPS,
    params=[*PARAMS],
    epilog=f"Every option in full: {DOCS_PAGE} (flux-gen).",
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True, "max_content_width": 120},
)
def main(**opts: Any) -> None:
    """Generate images with FLUX; a model id is fetched from the Hugging Face Hub on first use."""
    logging.basicConfig(level=logging.WARNING, format="flux-gen: %(message)s")
    opts["_watch"] = Stopwatch()
    rank = launched_rank(opts)
    if rank is None and (opts["gpus"] or 1) == 1 and not opts["download_only"]:
        early_cuda.start(opts["device"])  # the CUDA context made while torch imports
    with one_line_errors(opts["debug"]), rank_errors(rank, opts["debug"]):
        if opts["prompts"] is not None:
            prompts_file_options(opts, click.get_current_context())
        elif opts["replay"] is not None:
            apply_replay(opts, click.get_current_context())
        if opts["download_only"]:
            download_only(opts)
            return
        if not opts["prompt"] and opts["prompts"] is None and opts["redux"] is None:
            raise click.UsageError(
                "--prompt is required (or --replay an image, --prompts a file, or --redux)"
            )
        if rank is None and (opts["gpus"] or 1) > 1:
            spawn_ranks(opts)
        opts["_rank"] = rank
        generate(opts)
        if opts["timings"] and rank in (None, 0):
            click.echo(f"flux-gen: {opts['_watch'].line()}", err=True)


def run() -> None:
    """The `flux-gen` command: `main`, then, once a run has succeeded and every file is written and closed, the
    process ends at once instead of tearing down the interpreter (freeing the GPU's memory block by block and
    its context took 1.3 s on the H200 after FLUX.1-dev, for nothing: the system frees it all). A failure, or a
    rank of a parallel run (its process group ends in its own teardown), exits the usual way."""
    try:
        main()  # click ends with SystemExit
    except SystemExit as e:
        if e.code in (None, 0) and not _in_process_group():
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(0)
        raise


def _in_process_group() -> bool:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


if __name__ == "__main__":  # how `--gpus N` runs each rank (and `torchrun -m flux_runtime.cli.gen`)
    run()
