"""flux-serve's options, parsed the same way for the command and for a Ray Serve config, and what they set up:
the API keys, the pipeline's loader, the app's limits, the logging.

The command (`flux_runtime.serve.command`) and the replicas (`flux_runtime.serve.replicas`) both read them here,
so one option table serves the HTTP server in this process and each replica Ray starts.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from flux_runtime.registry import MODEL_NAMES

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# the modules of each optional extra the command needs, checked before anything is loaded
EXTRAS = {
    "serve": ("fastapi", "uvicorn", "pydantic", "prometheus_client", "multipart"),
    "ray": ("ray.serve",),
}
KEY_ENV = "FLUX_SERVE_API_KEY"  # the keys, comma-separated, when no --api-key is given

F = TypeVar("F", bound=Callable[..., Any])


def serve_options(fn: F) -> F:
    """`fn` with every flux-serve option, as `main` takes them."""
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


def parse(argv: list[str]) -> dict[str, Any]:
    """flux-serve's options from command-line words, checked as the command checks them (click's errors)."""
    return _PARSER.make_context("flux-serve", argv).params


_OPTIONS = [
    click.option(
        "--model",
        "-m",
        default="tiny",
        help=f"A preset, a cached id or a path. The presets: {', '.join(MODEL_NAMES)}.",
    ),
    click.option("--fp8", is_flag=True, help="Quantize the transformer's block projections to FP8 at load."),
    click.option(
        "--lora",
        "loras",
        multiple=True,
        metavar="PATH[:SCALE]",
        help="Fuse a LoRA into the model at load, for every request (repeatable; each image records it).",
    ),
    click.option(
        "--quality", type=click.Choice(["lossless", "high"]), default="lossless", help="The default tier."
    ),
    click.option("--host", default="127.0.0.1", help="Address to listen on."),
    click.option("--port", type=click.IntRange(0, 65535), default=8000, help="Port to listen on."),
    click.option("--device", default=None, help="cuda, cuda:1, cpu [default: cuda if available]."),
    click.option(
        "--dtype",
        type=click.Choice(list(DTYPES)),
        default=None,
        help="Model dtype [default: bf16 on GPU, fp32 on CPU].",
    ),
    click.option(
        "--api-key",
        "api_keys",
        multiple=True,
        metavar="KEY",
        help=f"Accept 'Authorization: Bearer KEY' (repeatable); every route but /health and /ready needs one. "
        f"[default: ${KEY_ENV}, comma-separated; neither: no key needed]",
    ),
    click.option("--metrics-public", is_flag=True, help="Serve /metrics without an API key."),
    click.option(
        "--max-queue", type=click.IntRange(min=1), default=16, help="Requests waiting; more get 503."
    ),
    click.option("--max-batch", type=click.IntRange(min=1), default=4, help="Images in one pipeline call."),
    click.option(
        "--no-batching", is_flag=True, help="Run every request alone (docs/serving.md: batching and bits)."
    ),
    click.option("--max-n", type=click.IntRange(min=1), default=4, help="Images one request may ask for."),
    click.option("--max-size", type=click.IntRange(min=16), default=2048, help="Largest width or height."),
    click.option(
        "--max-upload-mb",
        type=click.FloatRange(min=0, min_open=True),
        default=16.0,
        help="Largest uploaded image or mask, in MiB.",
    ),
    click.option(
        "--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, help="Seconds per request."
    ),
    click.option(
        "--shutdown-timeout",
        type=click.FloatRange(min=0),
        default=60.0,
        help="Seconds to finish on a signal.",
    ),
    click.option(
        "--store-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Folder of the PNGs answered by URL [default: a temporary folder].",
    ),
    click.option("--store-max", type=click.IntRange(min=1), default=256, help="PNGs kept for URL answers."),
    click.option("--no-cuda-graphs", is_flag=True, help="Run the denoiser eagerly."),
    click.option(
        "--offload-text-encoders", is_flag=True, help="Keep the text encoders on the CPU between calls."
    ),
    click.option(
        "--replicas",
        type=click.IntRange(min=1),
        default=None,
        help="Serve N replicas as a Ray Serve deployment (pip install 'flux-runtime[ray]').",
    ),
    click.option(
        "--gpus-per-replica",
        type=click.FloatRange(min=0),
        default=None,
        help="GPUs Ray gives each replica [default: 1 with CUDA here or --device cuda, else 0].",
    ),
    click.option(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="An existing Ray cluster (ray://HOST:10001, auto) [default: a local Ray instance].",
    ),
    click.option("--debug", is_flag=True, help="Log each batch; show the traceback of a failed load."),
]
_PARSER = click.command("flux-serve")(serve_options(lambda **opts: None))


def require_extra(extra: str, what: str) -> None:
    """One line naming the install command when a module of the optional `extra` is missing."""
    for name in EXTRAS[extra]:
        parts = name.split(".")
        # a package set to None in sys.modules cannot be imported, even where a submodule of it already was
        blocked = any(sys.modules.get(".".join(parts[:i]), True) is None for i in range(1, len(parts) + 1))
        try:
            found = not blocked and importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a missing parent package; a module set to None in sys.modules
            found = False
        if not found:
            raise click.ClickException(
                f"{what} needs the {extra} extra ({name.partition('.')[0]} is missing): "
                f"pip install 'flux-runtime[{extra}]'"
            )


def api_keys(opts: dict[str, Any]) -> list[str]:
    """The keys of `--api-key`, else of FLUX_SERVE_API_KEY; an empty or blank one is a one-line error that
    names where it came from, never the key."""
    from flux_runtime.serve.auth import check_key

    env = os.environ.get(KEY_ENV)
    if opts["api_keys"]:
        keys, where = list(opts["api_keys"]), "--api-key"
    elif env is not None:
        keys, where = env.split(","), KEY_ENV
    else:
        return []
    for i, key in enumerate(keys, 1):
        try:
            check_key(key, f"{where}: key {i} of {len(keys)}" if len(keys) > 1 else where)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    return keys


def pipeline_loader(opts: dict[str, Any]) -> Callable[[], Any]:
    """A function loading the pipeline `--model` names on `--device` in `--dtype` (run on the worker thread);
    the device is checked here, before the port opens."""
    from flux_runtime.pipeline import FluxError, Pipeline
    from flux_runtime.pipeline.checks import check_device

    try:
        device = check_device(opts["device"])
    except FluxError as e:
        raise click.ClickException(str(e)) from None
    loras = lora_specs(opts)

    def load() -> Any:
        pipe = Pipeline.from_pretrained(
            opts["model"], device=device, dtype=dtype_of(opts, device), quality=opts["quality"],
            cuda_graphs=not opts["no_cuda_graphs"], offload_text_encoders=opts["offload_text_encoders"],
            fp8=opts["fp8"],
        )  # fmt: skip
        for path, scale in loras:
            pipe.load_lora(path, scale)
        return pipe

    return load


def lora_specs(opts: dict[str, Any]) -> list[tuple[str, float]]:
    """`--lora`'s (path, scale) pairs, each file checked (it exists, it is a LoRA) before the model loads."""
    from flux_runtime.pipeline.loras import split_spec
    from flux_runtime.weights.lora_formats import LoraError, check_lora_file

    out = []
    for spec in opts.get("loras", ()):
        try:
            path, scale = split_spec(spec)
            check_lora_file(path)
        except (ValueError, LoraError) as e:
            raise click.ClickException(f"--lora {spec}: {str(e).removeprefix('LoRA ')}") from None
        out.append((path, scale))
    return out


def dtype_of(opts: dict[str, Any], device: Any) -> Any:
    """`--dtype`, else bf16 on a GPU or with `--fp8`, fp32 on the CPU."""
    import torch

    name = opts["dtype"] or ("bf16" if device.type == "cuda" or opts["fp8"] else "fp32")
    return getattr(torch, DTYPES[name])


def app_options(opts: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """`create_app`'s keyword arguments from `flux-serve`'s options (the pipeline's loader and the store
    aside); the keys go in as digests only."""
    from flux_runtime.serve.app import Limits
    from flux_runtime.serve.auth import ApiKeys

    return dict(
        model=opts["model"],
        limits=Limits(
            max_n=opts["max_n"],
            max_side=opts["max_size"],
            max_upload_bytes=int(opts["max_upload_mb"] * 2**20),
            timeout=opts["timeout"],
        ),
        max_queue=opts["max_queue"],
        max_batch=opts["max_batch"],
        batching=not opts["no_batching"],
        keys=ApiKeys.of(keys),
        metrics_public=opts["metrics_public"],
    )


def warn_if_open(opts: dict[str, Any], keys: list[str]) -> None:
    """One line on stderr when no key guards a port that other machines may reach."""
    if keys or _loopback(opts["host"]):
        return
    click.echo(
        f"flux-serve: warning: no API key and {opts['host']} is not a loopback address: anyone who reaches "
        f"port {opts['port']} can generate (set --api-key or ${KEY_ENV})",
        err=True,
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def load_error(e: BaseException) -> str:
    """A failed load in one line: our errors' first line, another error's type and first line."""
    from flux_runtime.pipeline import FluxError
    from flux_runtime.weights.errors import WeightsError

    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, (FluxError, WeightsError, OSError)):
        return first
    return f"loading failed: {type(e).__name__}: {first} (--debug shows the traceback)"


def configure_logging(opts: dict[str, Any]) -> None:
    logging.basicConfig(
        level=logging.DEBUG if opts["debug"] else logging.WARNING, format="flux-serve: %(message)s"
    )
