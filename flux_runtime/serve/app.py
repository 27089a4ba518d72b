"""The FastAPI app: the OpenAI-shaped routes over one `Worker`, the URL store, the probes and `/metrics`.

Routes: `POST /v1/images/generations`, `POST /v1/images/edits`, `GET /v1/images/files/{name}` (the `url`
answers), `GET /v1/models`, `GET /health` (the process is up), `GET /ready` (the pipeline is loaded and
warm), `GET /metrics`. A handler checks what needs no model, queues a job and waits for it; it gives the job
up when its client disconnects or its timeout passes. Until the worker is ready the model's routes answer 503
with Retry-After. With API keys every route but the probes (and /metrics with `metrics_public`) needs one.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.routing import Match

from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.provenance import png_bytes
from flux_runtime.sampling.flux3_references import MAX_REFERENCES as MAX_FLUX3_REFERENCES
from flux_runtime.serve.api import SIZE_MULTIPLE, APIError, EditRequest, GenerationRequest, parse_size
from flux_runtime.serve.auth import PROBES, ApiKeys, RequireKey
from flux_runtime.serve.store import ImageStore
from flux_runtime.serve.worker import Abandoned, Generated, Job, Metrics, QueueFull, Worker


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one request may ask for, and how long the server waits for it."""

    max_n: int = 4
    max_side: int = 2048
    max_upload_bytes: int = 16 << 20
    timeout: float = 600.0
    retry_after: int = 5  # seconds, in a 503's Retry-After


EditKind = Literal["flux2", "flux3", "text2img", "kontext", "fill", "control"]
"""What an edit does on the served checkpoint: FLUX.2 or FLUX.3 references, or the FLUX.1 variant (`text2img`:
img2img and inpainting)."""


def check_edit(req: EditRequest, n_images: int, has_mask: bool, kind: EditKind, model: str) -> None:
    """The edit's fields fit the served checkpoint, or an APIError naming the one that does not (before any
    upload is decoded)."""
    if kind == "control":
        raise APIError(
            400, f"image: {model} is a Depth / Canny checkpoint; flux-serve does not serve control images",
            param="image",
        )  # fmt: skip
    if n_images == 0:
        raise APIError(400, "image: an edit needs at least one image file", param="image")
    references = kind in ("flux2", "flux3")
    if not references and n_images > 1:
        raise APIError(400, f"image: {model} (FLUX.1) takes one image, got {n_images}", param="image")
    if kind == "flux3" and n_images > MAX_FLUX3_REFERENCES:
        raise APIError(
            400,
            f"image: {model} (FLUX.3) takes 1 to {MAX_FLUX3_REFERENCES} images, got {n_images}",
            param="image",
        )
    refused = {
        "flux2": ("mask", "strength", "max_area", "auto_resize"),
        "flux3": ("mask", "strength", "max_area", "auto_resize"),
        "kontext": ("mask", "strength"),
        "fill": ("max_area", "auto_resize"),
        "text2img": ("max_area", "auto_resize"),
    }[kind]
    given = {"mask": has_mask, "strength": req.strength is not None, "max_area": req.max_area is not None,
             "auto_resize": req.auto_resize is not None}  # fmt: skip
    for field in refused:
        if given[field]:
            what = {"flux2": "is FLUX.2", "flux3": "is FLUX.3", "kontext": "is a Kontext checkpoint"}.get(
                kind, "is not Kontext"
            )
            raise APIError(400, f"{field} is not a setting of {model}: it {what}", param=field)
    if kind == "fill" and not has_mask:
        raise APIError(400, f"mask: {model} is a Fill checkpoint; give a mask (white = fill)", param="mask")


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic complaint as a 400 naming its field (`n`, `size`, ...)."""
    first = e.errors()[0]
    if first.get("type") == "json_invalid":  # loc is ("body", character offset): no field to name
        where = first.get("loc", ("body", "?"))[-1]
        return APIError(400, f"the request body is not valid JSON (at character {where}): send a JSON object")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[-1] if loc else None
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object of the generation's fields")
    return APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


def prompt_counter(pipe: Any) -> Callable[[str], int]:
    """A function giving how many tokens the pipeline's sequence encoder makes of a prompt (T5 for FLUX.1, the
    LLM's chat text for FLUX.2 and FLUX.3), to refuse a prompt the pipeline would cut short.

    It counts with its own copy of the tokenizer: a Hugging Face fast tokenizer keeps its padding and
    truncation settings on the shared Rust object and resets them on every call, so counting on the event
    loop with the pipeline's tokenizer while the worker thread pads a batch would hand the worker unpadded ids.
    """
    te = pipe.text_encoder
    if hasattr(te, "t5_tokenizer"):
        t5 = copy.deepcopy(te.t5_tokenizer)
        return lambda prompt: len(t5(prompt)["input_ids"])
    tok = copy.deepcopy(te.tokenizer)  # render only fills the chat template: it leaves the tokenizer alone
    if pipe.transformer.config.family == "flux3":  # Qwen3-VL's chat text of one prompt
        return lambda prompt: len(tok(te.render(prompt))["input_ids"])
    return lambda prompt: len(tok(te.render([prompt])[0])["input_ids"])


REPLICA_HEADER = "X-Flux-Replica"
"""The response header naming the replica that answered (set when the app serves as one of several)."""


@dataclass(frozen=True)
class _Served:
    """What the routes read of the loaded pipeline, made once on the worker thread before it is ready."""

    family: str
    kind: EditKind
    count_tokens: Callable[[str], int]
    max_tokens: int

    @classmethod
    def of(cls, pipe: Any) -> _Served:
        family = pipe.transformer.config.family
        kind = family if family in ("flux2", "flux3") else getattr(pipe, "variant", "text2img")
        return cls(family, kind, prompt_counter(pipe), pipe.default_max_sequence_length)


def create_app(
    load: Callable[[], Any],
    *,
    model: str,
    store: ImageStore,
    limits: Limits,
    max_queue: int = 16,
    max_batch: int = 4,
    batching: bool = True,
    drain: bool = True,
    keys: ApiKeys | None = None,
    metrics_public: bool = False,
    replica: str | None = None,
    wait_ready: bool = False,
    gather_metrics: Callable[[bytes], Awaitable[bytes]] | None = None,
) -> FastAPI:
    """The server of the pipeline `load()` returns, served under the name `model`.

    The worker thread calls `load` when the app starts, then warms the pipeline up; until then /health
    answers and /ready and the model's routes answer 503 (`wait_ready`: the app's start waits for it, and a
    failed load fails the start, for a host such as Ray Serve that routes to a replica once it has started).
    `keys`: the accepted API keys (none: open). `replica`: this app's name among several, sent in the
    `X-Flux-Replica` header, recorded in each PNG's provenance (`served_replica`) and as a `replica` label of
    every metric. `gather_metrics`: /metrics answers what it makes of this app's exposition (the replicas:
    every replica's series).
    """
    metrics = Metrics()
    served: list[_Served] = []  # one item once loaded
    worker = Worker(
        load, metrics, max_queue=max_queue, max_batch=max_batch, batching=batching,
        on_load=lambda pipe: served.append(_Served.of(pipe)),
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        if wait_ready:
            await asyncio.to_thread(worker.loaded.wait)
            if worker.failure is not None:
                raise worker.failure
        yield
        # uvicorn has waited for the open requests (their jobs ran); whatever remains is run or refused
        await asyncio.to_thread(worker.close, drain)

    app = FastAPI(title="flux-serve", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(_validation_error(e))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        """One request's bug answers 500; the server lives on."""
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))

    # the last added runs first: count every answer (a 401 too), then name the replica, then check the key
    open_paths = PROBES + (("/metrics",) if metrics_public else ())
    app.add_middleware(RequireKey, keys=keys or ApiKeys(), open_paths=open_paths)
    if replica is not None:
        app.add_middleware(_NameReplica, replica=replica)
    app.add_middleware(_CountAnswers, metrics=metrics, routes=app.router.routes)

    def loaded() -> _Served:
        """The loaded pipeline's facts, or a 503 while it loads and warms up."""
        if not worker.ready.is_set():
            raise APIError(
                503, f"{model} is still loading; retry after {limits.retry_after} s", kind="server_busy",
                code="model_loading", headers={"Retry-After": str(limits.retry_after)},
            )  # fmt: skip
        return served[0]

    def check_common(req: GenerationRequest) -> tuple[int, int] | None:
        family, count_tokens = loaded().family, loaded().count_tokens
        if req.model is not None and req.model != model:
            raise APIError(
                404, f"model {req.model!r} is not served here; this server serves {model!r}",
                param="model", code="model_not_found",
            )  # fmt: skip
        if req.n > limits.max_n:
            raise APIError(400, f"n {req.n} is over this server's limit of {limits.max_n}", param="n")
        if req.timeout is not None and req.timeout > limits.timeout:
            raise APIError(
                400, f"timeout {req.timeout} is over this server's {limits.timeout} s", param="timeout"
            )
        size = parse_size(req.size, limits.max_side)
        for name, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt)):
            if text is not None:
                tokens, limit = count_tokens(text), loaded().max_tokens
                if tokens > limit:
                    raise APIError(
                        400, f"{name} is {tokens} tokens; {model} reads at most {limit}", param=name
                    )
        if req.cache is not None:
            from flux_runtime.sampling.step_cache import CacheSpecError, parse_cache

            try:
                policy = parse_cache(req.cache)
            except CacheSpecError as e:
                raise APIError(400, str(e), param="cache") from None
            req.cache = None if policy is None else policy.spec
        if family != "flux3" and req.upsample is not None:
            raise APIError(400, f"upsample is FLUX.3's prompt upsampler; {model} has none", param="upsample")
        if family != "flux1" and (req.negative_prompt is not None or req.true_cfg_scale != 1.0):
            field = "negative_prompt" if req.negative_prompt is not None else "true_cfg_scale"
            name = "FLUX.2" if family == "flux2" else "FLUX.3"
            raise APIError(400, f"{field} needs a FLUX.1 model; {model} is {name}", param=field)
        return size

    def new_job(req: GenerationRequest, **extra: Any) -> Job:
        size = check_common(req)
        timeout = req.timeout or limits.timeout
        return Job(
            prompt=req.prompt, n=req.n, seed=secrets.randbelow(2**32) if req.seed is None else req.seed,
            width=size[0] if size else None, height=size[1] if size else None, steps=req.steps,
            guidance=req.guidance, quality=req.quality, cache=req.cache, negative_prompt=req.negative_prompt,
            true_cfg_scale=req.true_cfg_scale, upsample=req.upsample, deadline=time.monotonic() + timeout, **extra,
        )  # fmt: skip

    async def answer(request: Request, job: Job, response_format: str) -> Response:
        """Queue `job`, wait for it (giving it up on a disconnect or its deadline), answer OpenAI's shape."""
        try:
            worker.submit(job)
        except QueueFull as e:
            metrics.dropped.labels("queue_full").inc()
            raise APIError(
                503, f"{e}; retry after {limits.retry_after} s", kind="server_busy", code="queue_full",
                headers={"Retry-After": str(limits.retry_after)},
            ) from None  # fmt: skip
        began = time.monotonic()
        waiting = asyncio.wrap_future(job.future)
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=0.05)
            if done:
                break
            if time.monotonic() > job.deadline:
                worker.abandon(job, "timeout")
                raise APIError(504, "the request timed out before its images were made", kind="timeout")
            if await request.is_disconnected():
                worker.abandon(job, "disconnected")
                return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        try:
            generated: Generated = waiting.result()
        except asyncio.CancelledError:  # cancelled unrun by the worker: the deadline passed in the queue
            raise APIError(504, "the request timed out in the queue", kind="timeout") from None
        except Abandoned:
            raise APIError(504, "the request timed out while it ran", kind="timeout") from None
        except QueueFull as e:
            raise APIError(
                503, str(e), kind="server_busy", headers={"Retry-After": str(limits.retry_after)}
            ) from None
        except FluxError as e:
            raise APIError(400, str(e).strip().splitlines()[0]) from None
        data = await asyncio.to_thread(
            _encode, generated, response_format, store, str(request.base_url), replica
        )
        metrics.stage.labels("total").observe(time.monotonic() - began)
        return JSONResponse({"created": int(time.time()), "data": data})

    @app.post("/v1/images/generations")
    async def generations(request: Request, req: GenerationRequest) -> Response:
        """Text to image."""
        return await answer(request, new_job(req), req.response_format)

    @app.post("/v1/images/edits")
    async def edits(request: Request) -> Response:
        """FLUX.2: draw from reference images (`image`, repeatable); FLUX.1: img2img, inpainting with `mask`
        (white = repaint), a Kontext edit, or a Fill inpainting, as the served checkpoint is."""
        kind = loaded().kind
        references = kind in ("flux2", "flux3")  # edits draw from reference images
        try:
            form = await request.form(max_files=16, max_fields=64)
        except Exception as e:  # starlette's MultiPartException, a body that is not a form
            raise APIError(400, f"the body must be a multipart form: {e}") from None
        files = [f for name in ("image", "image[]") for f in form.getlist(name) if isinstance(f, UploadFile)]
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str) and k not in ("image", "image[]")}
        try:
            req = EditRequest.model_validate(fields)
        except ValidationError as e:
            raise _validation_error(e) from None
        mask_file = form.get("mask")
        has_mask = isinstance(mask_file, UploadFile)
        check_edit(req, len(files), has_mask, kind, model)
        images = [await _read_image(f, "image", limits.max_upload_bytes) for f in files]
        mask = await _read_image(mask_file, "mask", limits.max_upload_bytes) if has_mask else None
        job = new_job(
            req, images=images, mask=mask, strength=req.strength, max_area=req.max_area,
            auto_resize=req.auto_resize,
        )  # fmt: skip
        w, h = images[0].size
        if not references and job.width is None and not (w % SIZE_MULTIPLE or h % SIZE_MULTIPLE):
            # as OpenAI: a FLUX.1 edit is the size of its image by default (Kontext: its aspect ratio at
            # max_area); FLUX.2 and FLUX.3 take their first reference's size as the pipeline prepares it
            job.width, job.height = w, h
        return await answer(request, job, req.response_format)

    @app.get("/v1/images/files/{name}")
    async def files(name: str) -> Response:
        path = store.path(name)
        if path is None:
            raise APIError(
                404, f"no image {name!r} (the store keeps the latest {store.max_files})", param="name"
            )
        return FileResponse(path, media_type="image/png")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "flux-runtime"}],
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """The process is up (loading or not). The pid tells a client that started this server that it talks
        to its own process, not to another that took the same port first."""
        return {"status": "ok", "model": model, "ready": worker.ready.is_set(), "queue_depth": worker.depth,
                "pid": os.getpid(), **({"replica": replica} if replica is not None else {})}  # fmt: skip

    @app.get("/ready")
    async def ready() -> dict[str, Any]:
        """200 once the pipeline is loaded and warm (the warm-up call made), else 503: what a balancer routes
        by."""
        if worker.failure is not None:
            raise APIError(503, f"{model} failed to load", kind="server_error", code="load_failed")
        loaded()
        return {"status": "ready", "model": model}

    registry = metrics.registry if replica is None else _WithReplica(metrics.registry, replica)
    app.state.exposition = lambda: generate_latest(registry)  # type: ignore[arg-type]

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = app.state.exposition()
        if gather_metrics is not None:
            text = await gather_metrics(text)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


class _CountAnswers:
    """Count every answer by route and status: a plain ASGI middleware (it leaves `receive` alone, so a
    handler still sees its client disconnect, which Starlette's BaseHTTPMiddleware would hide). An answer
    given before routing (a 401) is counted under the route its path would have taken."""

    def __init__(self, app: Any, metrics: Metrics, routes: list[Any]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: dict[str, int] = {}

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, receive, send_status)
        route = scope.get("route") or next(
            (r for r in self.routes if r.matches(scope)[0] is Match.FULL), None
        )
        self.metrics.requests.labels(getattr(route, "path", "other"), str(status.get("code", 0))).inc()


class _NameReplica:
    """Name the replica in every answer's `X-Flux-Replica` header (plain ASGI, as `_CountAnswers`)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.lower().encode(), replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


class _WithReplica:
    """A registry's metrics with a `replica` label on every sample, for `generate_latest`."""

    def __init__(self, registry: CollectorRegistry, replica: str) -> None:
        self.registry, self.replica = registry, replica

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, "replica": self.replica}) for s in family.samples]
            yield out


async def _read_image(upload: UploadFile, param: str, limit: int) -> Image.Image:
    """An uploaded image, decoded now: a 413 past `limit` bytes, a 400 naming `param` if it does not decode."""
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise APIError(413, f"{param}: the upload is over this server's {limit} bytes", param=param)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        raise APIError(
            400, f"{param}: {upload.filename or 'the upload'} is not an image PIL reads ({e})", param=param
        ) from None
    return image


def _encode(
    generated: Generated, response_format: str, store: ImageStore, base_url: str, replica: str | None
) -> list[dict[str, Any]]:
    """PNGs with the provenance chunk (and the replica that made them), as base64 or as URLs into the store."""
    data = []
    for image, info in generated:
        png = png_bytes(image, info if replica is None else {**info, "served_replica": replica})
        if response_format == "url":
            data.append({"url": f"{base_url}v1/images/files/{store.put(png)}", "revised_prompt": None})
        else:
            data.append({"b64_json": base64.b64encode(png).decode(), "revised_prompt": None})
    return data
