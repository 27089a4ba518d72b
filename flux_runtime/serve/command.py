"""`flux-serve`: serve one pipeline over HTTP with uvicorn until SIGINT / SIGTERM, or `--replicas` of it on Ray Serve.

The port opens at once; the pipeline loads and warms up on the worker thread meanwhile (/health answers,
/ready says 503 until it is warm), and a failed load ends the process with one line. On a signal uvicorn
stops listening and waits up to `--shutdown-timeout` for the open requests, whose queued jobs the worker keeps
running; what is still queued after that is refused (`--drain` off: at once).
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from flux_runtime.command_help import DOCS_PAGE, GroupedCommand
from flux_runtime.serve.options import (
    api_keys,
    app_options,
    configure_logging,
    load_error,
    pipeline_loader,
    require_extra,
    serve_options,
    warn_if_open,
)

__all__ = ["main", "serve"]


@click.command(
    cls=GroupedCommand,
    # --help's headings (click's parameter names); an option not named here is listed under "Other options"
    groups=(
        ("Model", "model fp8 loras quality device dtype no_cuda_graphs offload_text_encoders"),
        ("Listening and access", "host port api_keys metrics_public shutdown_timeout"),
        ("Requests and batching", "max_queue max_batch no_batching max_n max_size max_upload_mb timeout"),
        ("Images answered by URL", "store_dir store_max"),
        ("Replicas on Ray Serve", "replicas gpus_per_replica ray_address"),
    ),
    epilog=f"Every option in full: {DOCS_PAGE} (flux-serve).",
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True, "max_content_width": 120},
)
@serve_options
def main(**opts: Any) -> None:
    """Serve FLUX over an OpenAI-compatible HTTP API (/v1/images/generations, /v1/images/edits)."""
    require_extra("serve", "flux-serve")
    if opts["replicas"] is None:
        for name in ("gpus_per_replica", "ray_address"):
            if opts[name] is not None:
                raise click.UsageError(f"--{name.replace('_', '-')} goes with --replicas")
        serve(pipeline_loader(opts), opts)
        return
    require_extra("ray", "flux-serve --replicas")
    from flux_runtime.serve.replicas import run

    run(opts, api_keys(opts))


def serve(load: Callable[[], Any], opts: dict[str, Any]) -> None:
    """Serve the pipeline `load()` returns under the name `--model` with `flux-serve`'s options until a
    signal; a failed load ends the server and is one line here (`--debug`: its traceback).

    `opts` are `main`'s parameters; a caller that builds its own pipeline (scripts/bench_serve.py, with random
    full-size weights) gets them from `flux_runtime.serve.options.parse(args)`.
    """
    import uvicorn

    from flux_runtime.serve.app import ImageStore, create_app

    configure_logging(opts)
    keys = api_keys(opts)
    store_dir = opts["store_dir"] or Path(tempfile.mkdtemp(prefix="flux-serve-"))
    app = create_app(load, store=ImageStore(store_dir, opts["store_max"]), **app_options(opts, keys))
    warn_if_open(opts, keys)
    click.echo(
        f"flux-serve: loading {opts['model']}; http://{opts['host']}:{opts['port']} (/ready once warm)",
        err=True,
    )
    config = uvicorn.Config(
        app, host=opts["host"], port=opts["port"], log_level="warning", access_log=False,
        timeout_graceful_shutdown=opts["shutdown_timeout"],
    )  # fmt: skip
    server = uvicorn.Server(config)
    worker = app.state.worker

    def stop_on_failed_load() -> None:
        worker.loaded.wait()
        if worker.failure is not None:
            server.should_exit = True

    threading.Thread(target=stop_on_failed_load, name="flux-serve-load-watch", daemon=True).start()
    server.run()
    if worker.failure is not None:
        if opts["debug"]:
            raise worker.failure
        raise click.ClickException(load_error(worker.failure))
