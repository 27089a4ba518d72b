"""`flux-serve --replicas N`: the same app as N replicas of a Ray Serve deployment (the `ray` extra).

Each replica builds the app of `flux-serve` around its own pipeline (`create_app` with `wait_ready`: Ray routes
to a replica only once its load and warm-up are done) and names itself in the `X-Flux-Replica` header, in each
PNG's provenance and as a `replica` label of its metrics. Every replica pushes its metrics to one small actor
every few seconds, so `/metrics` on any replica answers every live replica's series. The API keys reach the
replicas as SHA-256 digests only. A replica whose worker thread has ended fails Ray's health check and is
replaced. A replica that dies mid-request costs its requests a 500 from Ray's proxy (plain text, without
Retry-After: the proxy's own answer, not ours), never a hang; the openai client retries it.

For a Ray config of your own: `import_path: flux_runtime.serve.replicas:build` with `args` of flux-serve's
option names (`model: flux1-dev`, `max_batch: 4`, `replicas: 2`, `gpus_per_replica: 1`, ...); the keys come
from FLUX_SERVE_API_KEY where the builder runs, never from the config.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
import ray
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from flux_runtime.serve import options as serve_options

log = logging.getLogger(__name__)

APP_NAME = "flux-serve"
METRICS_ACTOR = "flux-serve-metrics"
NAMESPACE = "serve"  # Ray Serve's own, where the board is found by name
PUSH_EVERY = 5.0  # seconds between a replica's metrics pushes; older than 3 of them is a dead replica's


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest metrics exposition of every replica, by replica name."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def others(self, replica: str) -> list[str]:
        """Every other replica's latest exposition, but those whose pushes stopped (a dead replica's)."""
        fresh = time.monotonic() - 3 * PUSH_EVERY
        return [text for name, (at, text) in self.texts.items() if name != replica and at >= fresh]


class _Merged:
    """Several expositions as one registry for `generate_latest`: each family once, the samples of all."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for text in self.texts:
            for f in text_string_to_metric_families(text):
                merged = families.setdefault(f.name, Metric(f.name, f.documentation, f.type, f.unit))
                merged.samples += f.samples
        return list(families.values())


@serve.deployment(name="FluxServe")
@serve.ingress()
class FluxServe:
    """One replica: `flux-serve`'s app around its own pipeline (built by Ray after `__init__`)."""

    def __init__(self, opts: dict[str, Any], key_digests: list[bytes], store_dir: str) -> None:
        self.opts, self.key_digests, self.store_dir = opts, key_digests, store_dir
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.flux_app: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        from flux_runtime.serve.app import ImageStore, create_app
        from flux_runtime.serve.auth import ApiKeys

        options = serve_options.app_options(self.opts, [])
        options["keys"] = ApiKeys(self.key_digests)
        store = ImageStore(Path(self.store_dir), self.opts["store_max"])
        # detached: the board outlives the replica that happened to create it
        self.board = MetricsBoard.options(
            name=METRICS_ACTOR, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
        ).remote()
        self.flux_app = create_app(
            serve_options.pipeline_loader(self.opts), store=store, replica=self.replica, wait_ready=True,
            gather_metrics=self._gather_metrics, **options,
        )  # fmt: skip
        threading.Thread(target=self._push_metrics, name="flux-serve-metrics", daemon=True).start()
        return self.flux_app

    async def _gather_metrics(self, own: bytes) -> bytes:
        """This replica's exposition now, with the others' latest pushes."""
        others = await self.board.others.remote(self.replica)
        return generate_latest(_Merged([own.decode(), *others]))  # type: ignore[arg-type]

    def _push_metrics(self) -> None:
        while True:
            self.board.put.remote(self.replica, self.flux_app.state.exposition().decode())
            time.sleep(PUSH_EVERY)

    def check_health(self) -> None:
        """Ray replaces a replica whose worker thread has ended (a failed load, or a bug)."""
        if self.flux_app is not None and not self.flux_app.state.worker.healthy:
            raise RuntimeError(f"replica {self.replica}: the worker thread has ended")


def application(opts: dict[str, Any], keys: list[str]) -> Any:
    """The Ray Serve application of `flux-serve`'s options `opts` and API `keys` (as digests)."""
    from flux_runtime.serve.auth import ApiKeys

    gpus = opts["gpus_per_replica"]
    if gpus is None:
        gpus = 1 if _cuda_here(opts) else 0
    store_dir = str(opts["store_dir"] or Path(tempfile.mkdtemp(prefix="flux-serve-")))
    deployment = FluxServe.options(
        num_replicas=opts["replicas"],
        ray_actor_options={"num_gpus": gpus},
        # Ray holds back what the replica's own queue would refuse, so both bounds agree
        max_ongoing_requests=opts["max_queue"] + opts["max_batch"],
        graceful_shutdown_timeout_s=opts["shutdown_timeout"],
    )
    return deployment.bind(opts, list(ApiKeys.of(keys).digests), store_dir)


def _cuda_here(opts: dict[str, Any]) -> bool:
    if opts["device"] is not None:
        return opts["device"].startswith("cuda")
    import torch

    return torch.cuda.is_available()


def build(args: dict[str, Any]) -> Any:
    """The application for a Ray Serve config (`import_path: flux_runtime.serve.replicas:build`): `args` are
    flux-serve's options by name (`model`, `max_batch`, `replicas`, flags as true), checked as the command
    checks them; the keys come from FLUX_SERVE_API_KEY."""
    argv: list[str] = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if name == "api_keys":
            raise ValueError("give the API keys in FLUX_SERVE_API_KEY, not in the Ray config")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    opts = serve_options.parse(argv)
    opts["replicas"] = opts["replicas"] or 1
    return application(opts, serve_options.api_keys(opts))


def run(opts: dict[str, Any], keys: list[str]) -> None:
    """`flux-serve --replicas N`: start (or join) Ray, deploy, serve until SIGINT / SIGTERM, then take the
    application down (a local Ray instance with it). A signal before the replicas are ready ends the start-up
    the same way, exit status 0."""
    serve_options.configure_logging(opts)
    serve_options.lora_specs(opts)  # a missing or damaged LoRA fails here, before Ray starts
    address = opts["ray_address"]
    stop = threading.Event()
    serving = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        # before the replicas are up, Ray's start-up waits in the main thread: leave it at once, through the
        # `finally` below, so that a local Ray instance is taken down rather than left running
        if not serving.is_set():
            raise _Stopped(signum)
        stop.set()

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=opts["debug"])
    for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's start-up, which installs handlers of its own
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": opts["host"], "port": opts["port"]})
        serve_options.warn_if_open(opts, keys)
        click.echo(
            f"flux-serve: {opts['replicas']} replicas of {opts['model']} on Ray Serve, "
            f"http://{opts['host']}:{opts['port']} (answers once a replica is warm)",
            err=True,
        )
        try:
            serve.run(application(opts, keys), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as e:  # a replica failed to start: Ray's logs hold its traceback
            first = (str(e).strip().splitlines() or [""])[0]
            raise click.ClickException(
                f"{first} (the replicas' logs: /tmp/ray/session_latest/logs/serve)"
            ) from None
        click.echo("flux-serve: every replica is ready", err=True)
        serving.set()
        stop.wait()
        serve.delete(APP_NAME)
        with contextlib.suppress(ValueError):  # ValueError: no replica got as far as making it
            ray.kill(ray.get_actor(METRICS_ACTOR, namespace=NAMESPACE))
    except _Stopped:
        click.echo("flux-serve: stopped before every replica was ready", err=True)
    finally:
        if address is None:
            serve.shutdown()
            ray.shutdown()


class _Stopped(BaseException):
    """SIGINT / SIGTERM while Ray starts or the replicas load (a BaseException: Ray's waits catch Exception)."""
