"""`flux-serve`: load one pipeline and serve it over HTTP with uvicorn until SIGINT / SIGTERM.

On a signal uvicorn stops listening and waits up to `--shutdown-timeout` for the open requests, whose queued
jobs the worker keeps running; what is still queued after that is refused (`--drain` off: at once).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import click

from flux_runtime.command_help import DOCS_PAGE, GroupedCommand
from flux_runtime.registry import MODEL_NAMES

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@click.command(
    cls=GroupedCommand,
    # --help's headings (click's parameter names); an option not named here is listed under "Other options"
    groups=(
        ("Model", "model fp8 quality device dtype no_cuda_graphs offload_text_encoders"),
        ("Listening", "host port shutdown_timeout"),
        ("Requests and batching", "max_queue max_batch no_batching max_n max_size max_upload_mb timeout"),
        ("Images answered by URL", "store_dir store_max"),
    ),
    epilog=f"Every option in full: {DOCS_PAGE} (flux-serve).",
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True, "max_content_width": 120},
)
@click.option(
    "--model", "-m", default="tiny", help=f"A preset ({', '.join(MODEL_NAMES)}), a cached id or a path."
)
@click.option("--fp8", is_flag=True, help="Quantize the transformer's block projections to FP8 at load.")
@click.option(
    "--quality", type=click.Choice(["lossless", "high"]), default="lossless", help="The default tier."
)
@click.option("--host", default="127.0.0.1", help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, help="Port to listen on.")
@click.option("--device", default=None, help="cuda, cuda:1, cpu [default: cuda if available].")
@click.option(
    "--dtype", type=click.Choice(list(DTYPES)), default=None, help="[default: bf16 on GPU, fp32 on CPU]"
)
@click.option("--max-queue", type=click.IntRange(min=1), default=16, help="Requests waiting; more get 503.")
@click.option("--max-batch", type=click.IntRange(min=1), default=4, help="Images in one pipeline call.")
@click.option(
    "--no-batching", is_flag=True, help="Run every request alone (docs/serving.md: batching and bits)."
)
@click.option("--max-n", type=click.IntRange(min=1), default=4, help="Images one request may ask for.")
@click.option("--max-size", type=click.IntRange(min=16), default=2048, help="Largest width or height.")
@click.option(
    "--max-upload-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=16.0,
    help="Largest uploaded image or mask, in MiB.",
)
@click.option(
    "--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, help="Seconds per request."
)
@click.option(
    "--shutdown-timeout", type=click.FloatRange(min=0), default=60.0, help="Seconds to finish on a signal."
)
@click.option("--store-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of the PNGs answered by URL [default: a temporary folder].")  # fmt: skip
@click.option("--store-max", type=click.IntRange(min=1), default=256, help="PNGs kept for URL answers.")
@click.option("--no-cuda-graphs", is_flag=True, help="Run the denoiser eagerly.")
@click.option(
    "--offload-text-encoders", is_flag=True, help="Keep the text encoders on the CPU between calls."
)
@click.option("--debug", is_flag=True, help="Log each batch; show the traceback of a failed load.")
def main(**opts: Any) -> None:
    """Serve FLUX over an OpenAI-compatible HTTP API (/v1/images/generations, /v1/images/edits)."""
    serve(load_pipeline(opts), opts)


def load_pipeline(opts: dict[str, Any]) -> Any:
    """The pipeline `--model` names, on `--device` in `--dtype`; a load error is one line (unless `--debug`)."""
    from flux_runtime.pipeline import FluxError, Pipeline
    from flux_runtime.pipeline.checks import check_device
    from flux_runtime.weights.errors import WeightsError

    _configure_logging(opts)
    try:
        device = check_device(opts["device"])
        pipe = Pipeline.from_pretrained(
            opts["model"], device=device, dtype=dtype_of(opts, device), quality=opts["quality"],
            cuda_graphs=not opts["no_cuda_graphs"], offload_text_encoders=opts["offload_text_encoders"],
            fp8=opts["fp8"],
        )  # fmt: skip
    except (FluxError, WeightsError, OSError) as e:
        if opts["debug"]:
            raise
        raise click.ClickException(str(e).strip().splitlines()[0]) from None
    return pipe


def dtype_of(opts: dict[str, Any], device: Any) -> Any:
    """`--dtype`, else bf16 on a GPU or with `--fp8`, fp32 on the CPU."""
    import torch

    name = opts["dtype"] or ("bf16" if device.type == "cuda" or opts["fp8"] else "fp32")
    return getattr(torch, DTYPES[name])


def serve(pipe: Any, opts: dict[str, Any]) -> None:
    """Serve `pipe` under the name `--model` with `flux-serve`'s options until a signal.

    `opts` are `main`'s parameters; a caller that builds its own pipeline (scripts/bench_serve.py, with random
    full-size weights) gets them from `main.make_context("flux-serve", args).params`.
    """
    import uvicorn

    from flux_runtime.serve.app import ImageStore, Limits, create_app

    _configure_logging(opts)
    store_dir = opts["store_dir"] or Path(tempfile.mkdtemp(prefix="flux-serve-"))
    app = create_app(
        pipe,
        model=opts["model"],
        store=ImageStore(store_dir, opts["store_max"]),
        limits=Limits(
            max_n=opts["max_n"],
            max_side=opts["max_size"],
            max_upload_bytes=int(opts["max_upload_mb"] * 2**20),
            timeout=opts["timeout"],
        ),
        max_queue=opts["max_queue"],
        max_batch=opts["max_batch"],
        batching=not opts["no_batching"],
    )
    click.echo(
        f"flux-serve: {opts['model']} on {pipe.device}, http://{opts['host']}:{opts['port']}", err=True
    )
    uvicorn.run(
        app, host=opts["host"], port=opts["port"], log_level="warning", access_log=False,
        timeout_graceful_shutdown=opts["shutdown_timeout"],
    )  # fmt: skip


def _configure_logging(opts: dict[str, Any]) -> None:
    logging.basicConfig(
        level=logging.DEBUG if opts["debug"] else logging.WARNING, format="flux-serve: %(message)s"
    )
