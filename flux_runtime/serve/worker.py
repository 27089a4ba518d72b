"""The bounded queue, the batching and the one GPU worker thread, with the metrics they report.

The worker thread owns the pipeline from its load to the shutdown: it loads it, makes one warm-up call (what
the first call pays: CUDA graph capture, Triton compiles, cuBLAS handles) and only then says it is `ready`.
Handlers `submit` a `Job` (a full queue raises `QueueFull` at once) and wait on its `concurrent.futures`
future. The worker thread takes the oldest job and, unless batching is off, every queued job that can share
its batch (same size, steps, guidance, tier, negative prompt; text to image only) up to `max_batch` images,
and runs them as one pipeline call. A job whose client went away or whose time ran out before the worker
took it is dropped unrun (its future was cancelled); a running batch whose every job was abandoned stops at
its next step. An error in a batch of several jobs reruns each alone, so one bad request fails only itself.

Every image is drawn as its own seed (`seed + i` for a request's i-th image, a CPU generator each, as a
single `seed` call draws), so a served image is replayable as one `flux-gen --seed` run. A batch of two is
not promised `torch.equal` to two single runs: batched matmuls may sum in another order.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

log = logging.getLogger(__name__)

Generated = list[tuple[Image.Image, dict[str, Any]]]
"""A job's images with each one's provenance."""


class QueueFull(Exception):
    """The queue holds `max_queue` jobs (or the server is shutting down)."""


class Abandoned(Exception):
    """Every job of a running batch was given up by its client (disconnect or timeout)."""


@dataclass
class Job:
    """One request's work: `n` images of one prompt, seeds `seed .. seed + n - 1`."""

    prompt: str
    n: int
    seed: int
    width: int | None
    height: int | None
    steps: int | None
    guidance: float | None
    quality: str | None
    cache: str | None = (
        None  # a step-cache spec in full; such a job runs alone (a batch skips steps together)
    )
    negative_prompt: str | None = None
    true_cfg_scale: float = 1.0
    upsample: bool | None = None  # FLUX.3's prompt upsampler; None: the pipeline's default
    images: list[Image.Image] = field(default_factory=list)  # edits: references / the image to redraw
    mask: Image.Image | None = None
    strength: float | None = None
    max_area: int | None = None  # FLUX.1 Kontext
    auto_resize: bool | None = None  # FLUX.1 Kontext; None: the pipeline's default
    deadline: float = float("inf")  # time.monotonic() after which nobody waits for the answer
    enqueued: float = field(default_factory=time.monotonic)
    future: Future[Generated] = field(default_factory=Future)
    abandoned: bool = False  # set by the handler when it stops waiting

    @property
    def batch_key(self) -> tuple | None:
        """Jobs with equal keys run in one batch; None (edits, step-cached jobs) runs alone."""
        if self.images or self.cache is not None:
            return None
        return (
            self.width, self.height, self.steps, self.guidance, self.quality, self.negative_prompt,
            self.true_cfg_scale,
        )  # fmt: skip


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (one per app, so tests may build several).

    The names, types and labels are docs/serving.md's table (Metrics); every label value is made at
    start, so each series exists, at 0, before its first event. Counters and histograms carry no `_created`
    series: the switch is process-wide, and the server's process holds no other Prometheus metrics. The GPU
    memory gauges read the caching allocator's counters (no CUDA call, so a scrape never touches a stream
    the worker is capturing into a CUDA graph) and the device's total, read once.
    """

    STAGES = ("queue", "encode", "denoise", "decode", "total")
    DROP_REASONS = ("queue_full", "disconnected", "timeout", "abandoned")
    RATE_WINDOW = 60.0  # seconds of flux_serve_images_per_second

    def __init__(self, device: torch.device | None = None) -> None:
        """`device`: the pipeline's, for the GPU memory gauges; None until it is loaded (`watch_memory`)."""
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("flux_serve_queue_depth", "Jobs waiting for the GPU worker", registry=r)
        self.running = Gauge("flux_serve_running", "Jobs in the batch the worker runs now", registry=r)
        self.images = Counter("flux_serve_images", "Images generated", registry=r)
        self.requests = Counter(
            "flux_serve_requests",
            "Requests answered, by route and HTTP status",
            ["route", "status"],
            registry=r,
        )
        self.dropped = Counter(
            "flux_serve_dropped", "Jobs dropped before or during their run", ["reason"], registry=r
        )
        self.stage = Histogram(
            "flux_serve_stage_seconds",
            "Latency per stage (queue wait, encode, denoise, decode) and per request (total)",
            ["stage"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        for stage in self.STAGES:
            self.stage.labels(stage)
        for reason in self.DROP_REASONS:
            self.dropped.labels(reason)
        self.batch = Histogram(
            "flux_serve_batch_images", "Images per pipeline call", buckets=(1, 2, 4, 8, 16), registry=r
        )
        self._started = time.monotonic()
        self._done: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        rate = Gauge(
            "flux_serve_images_per_second",
            f"Images per second over the last {self.RATE_WINDOW:.0f} s (or since start, if sooner)",
            registry=r,
        )
        rate.set_function(self.images_per_second)
        if device is not None:
            self.watch_memory(device)

    def watch_memory(self, device: torch.device) -> None:
        """The GPU memory gauges of `device` (none on the CPU)."""
        if device.type == "cuda":
            r = self.registry
            mem = Gauge(
                "flux_serve_gpu_memory_bytes", "GPU memory of the server's device", ["kind"], registry=r
            )
            mem.labels("allocated").set_function(lambda: torch.cuda.memory_allocated(device))
            mem.labels("reserved").set_function(lambda: torch.cuda.memory_reserved(device))
            mem.labels("max_allocated").set_function(lambda: torch.cuda.max_memory_allocated(device))
            mem.labels("total").set(torch.cuda.get_device_properties(device).total_memory)

    def generated(self, count: int) -> None:
        self.images.inc(count)
        with self._lock:
            self._done.append((time.monotonic(), count))

    def images_per_second(self) -> float:
        """Images finished in the last RATE_WINDOW seconds over that window (over the uptime before that)."""
        now = time.monotonic()
        window = min(self.RATE_WINDOW, max(now - self._started, 1e-3))
        with self._lock:
            while self._done and self._done[0][0] < now - self.RATE_WINDOW:
                self._done.popleft()
            return sum(c for _, c in self._done) / window


class _StageTimer:
    """The pipeline's `progress` callback: times encode / denoise / decode, and stops an abandoned batch."""

    def __init__(self, metrics: Metrics, jobs: list[Job]) -> None:
        self.metrics, self.jobs = metrics, jobs
        self.began: dict[str, float] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if all(j.abandoned for j in self.jobs):
            raise Abandoned()
        if done == 0:
            self.began[stage] = time.perf_counter()
        if done >= total and stage in self.began:
            self.metrics.stage.labels(stage).observe(time.perf_counter() - self.began.pop(stage))


class Worker:
    """The queue and the thread that loads and runs the pipeline; `close(drain=True)` finishes what is queued.

    `ready` is set once the pipeline is loaded and warm; `loaded` once loading ended either way (`failure`
    holds the error of a failed load or warm-up, and the thread has ended).
    """

    def __init__(
        self,
        load: Callable[[], Any],
        metrics: Metrics,
        *,
        max_queue: int,
        max_batch: int,
        batching: bool,
        on_load: Callable[[Any], None] | None = None,
    ) -> None:
        """`load()` returns the pipeline, on the worker thread; `on_load(pipe)` runs there next, before the
        warm-up (the app reads what it needs of the pipeline)."""
        self.load, self.on_load, self.metrics = load, on_load, metrics
        self.max_queue, self.max_batch, self.batching = max_queue, max_batch, batching
        self.pipe: Any = None
        self.family = ""
        self.ready, self.loaded = threading.Event(), threading.Event()
        self.failure: Exception | None = None
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._main, name="flux-serve-gpu", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        """False after a failed load, or once the thread has ended while the server still takes jobs."""
        if self.failure is not None:
            return False
        return self._closing or not self.loaded.is_set() or self._thread.is_alive()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests)")
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()

    def abandon(self, job: Job, reason: str) -> None:
        """The handler stops waiting for `job`: dropped unrun if still queued, else its result discarded."""
        job.abandoned = True
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.queue_depth.set(len(self._queue))
                job.future.cancel()
                self.metrics.dropped.labels(reason).inc()

    @property
    def depth(self) -> int:
        return len(self._queue)

    def close(self, drain: bool, timeout: float | None = None) -> None:
        """Stop taking jobs; with `drain` run what is queued, else fail it with QueueFull; join the thread
        (not while it still loads: it is a daemon, and a load is not cut short cleanly)."""
        with self._cond:
            self._closing = True
            if not drain:
                while self._queue:
                    job = self._queue.popleft()
                    if job.future.set_running_or_notify_cancel():
                        job.future.set_exception(QueueFull("the server shut down before this request ran"))
                self.metrics.queue_depth.set(0)
            self._cond.notify_all()
        if self.ready.is_set() and self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker thread
    def _take(self) -> list[Job] | None:
        """The next batch (oldest job first), or None once closing with nothing queued."""
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return None
            first = self._queue.popleft()
            batch, images = [first], first.n
            key = first.batch_key
            if self.batching and key is not None:
                for job in list(self._queue):
                    if job.batch_key == key and images + job.n <= self.max_batch:
                        self._queue.remove(job)
                        batch.append(job)
                        images += job.n
            self.metrics.queue_depth.set(len(self._queue))
        live = []
        now = time.monotonic()
        for job in batch:
            if now > job.deadline:
                job.abandoned = True
                job.future.cancel()
                self.metrics.dropped.labels("timeout").inc()
            elif job.future.set_running_or_notify_cancel():
                self.metrics.stage.labels("queue").observe(now - job.enqueued)
                live.append(job)
        return live

    def _main(self) -> None:
        try:
            pipe = self.load()
            if self.on_load is not None:
                self.on_load(pipe)
            self.family = pipe.transformer.config.family
            # FLUX.3 takes one prompt per call: its jobs never share a batch (a job's images still run as one)
            self.batching = self.batching and self.family != "flux3"
            self.metrics.watch_memory(pipe.device)
            began = time.perf_counter()
            warm_up(pipe)
            log.debug("warmed up in %.2fs", time.perf_counter() - began)
        except Exception as e:  # the server reports it and exits: a load has no request to fail instead
            self.failure = e
            self.loaded.set()
            return
        self.pipe = pipe
        self.ready.set()
        self.loaded.set()
        self._loop()

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            if not batch:
                continue
            self.metrics.running.set(len(batch))
            try:
                self._run_isolated(batch)
            finally:
                self.metrics.running.set(0)

    def _run_isolated(self, batch: list[Job]) -> None:
        """Run `batch`; if it fails and holds several jobs, run each alone so an error stays with its job."""
        try:
            results = self._run(batch)
        except Abandoned:
            for job in batch:
                self.metrics.dropped.labels("abandoned").inc()
                job.future.set_exception(Abandoned())
            return
        except Exception as e:
            if len(batch) == 1:
                if not isinstance(e, ValueError):  # FluxError is a ValueError: bad input, not our bug
                    log.exception("request failed")
                batch[0].future.set_exception(e)
                return
            for job in batch:
                self._run_isolated([job])
            return
        for job, result in zip(batch, results, strict=True):
            job.future.set_result(result)

    def _run(self, batch: list[Job]) -> list[Generated]:
        """One pipeline call for a text-to-image batch; an edit runs image by image."""
        first = batch[0]
        if first.images:
            return [[img for i in range(first.n) for img in self._call([first], i, edit=True)]]
        images = self._call(batch, None, edit=False)
        out, k = [], 0
        for job in batch:
            out.append(images[k : k + job.n])
            k += job.n
        return out

    def _call(self, jobs: list[Job], index: int | None, *, edit: bool) -> Generated:
        """Run the pipeline for `jobs`' images (or only image `index` of one edit job)."""
        first = jobs[0]
        units = [(j, i) for j in jobs for i in range(j.n)] if index is None else [(first, index)]
        prompts = [j.prompt for j, _ in units]
        seeds = [j.seed + i for j, i in units]
        size = {} if first.width is None else {"width": first.width, "height": first.height}
        kwargs: dict[str, Any] = dict(
            num_steps=first.steps, guidance=first.guidance, quality=first.quality, cache=first.cache or "off",
            generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
            progress=_StageTimer(self.metrics, jobs), **size,
        )  # fmt: skip
        if self.family in ("flux2", "flux3"):
            if first.images:
                kwargs["image"] = first.images
            if self.family == "flux3":
                kwargs["upsample"] = first.upsample
        else:
            if first.negative_prompt is not None:
                kwargs["negative_prompt"] = [first.negative_prompt] * len(units)
            kwargs["true_cfg_scale"] = first.true_cfg_scale
            if first.images:
                kwargs.update(image=first.images[0], mask_image=first.mask, strength=first.strength)
                kwargs["max_area"] = first.max_area
                if first.auto_resize is not None:
                    kwargs["auto_resize"] = first.auto_resize
        began = time.perf_counter()
        if self.family == "flux3":  # one prompt a call: the job's images as num_images_per_prompt
            out = self.pipe(first.prompt, num_images_per_prompt=len(units), **kwargs)
        else:
            out = self.pipe(prompts, **kwargs)
        log.debug("ran %d image(s) in %.2fs", len(units), time.perf_counter() - began)
        self.metrics.batch.observe(len(units))
        self.metrics.generated(len(units))
        results = []
        for k, (image, seed) in enumerate(zip(out.images, seeds, strict=True)):
            info = {**out.info, "prompt": prompts[k], "seed": seed, "index": 0, "num_images": 1}
            if "negative_prompt" in info and isinstance(info["negative_prompt"], list):
                info["negative_prompt"] = info["negative_prompt"][k]
            if len(units) > 1:
                info["served_batch"] = len(units)  # how many images shared this image's pipeline call
            results.append((image, info))
        return results


def warm_up(pipe: Any) -> None:
    """One 1-step call, as a first request would make, so that what a first call pays (CUDA graph capture and
    Triton compiles, per shape; cuBLAS handles; the text encoders' first run) is paid before the server says
    it is ready. On a GPU it is made at the default size, the shape most requests take; on the CPU nothing is
    captured or compiled per shape, so a small size does. A Fill checkpoint gets a blank image and a full mask,
    a Depth / Canny one a blank control image (each takes only a call with them), Kontext the size as its area."""
    side = pipe.default_size if pipe.device.type == "cuda" else 64
    blank = Image.new("RGB", (side, side))
    extra: dict[str, Any] = {
        "fill": {"image": blank, "mask_image": Image.new("L", (side, side), 255)},
        "control": {"control_image": blank},
        "kontext": {"max_area": side * side},
    }.get(getattr(pipe, "variant", ""), {})
    pipe("warm-up", width=side, height=side, num_steps=1, seed=0, **extra)
