"""The FastAPI app: the OpenAI-shaped routes over one `Worker`, the URL store, `/health` and `/metrics`.

Routes: `POST /v1/images/generations`, `POST /v1/images/edits`, `GET /v1/images/files/{name}` (the `url`
answers), `GET /v1/models`, `GET /health`, `GET /metrics`. A handler checks what needs no model, queues a
job and waits for it; it gives the job up when its client disconnects or its timeout passes.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.provenance import png_bytes
from flux_runtime.sampling.flux3_references import MAX_REFERENCES as MAX_FLUX3_REFERENCES
from flux_runtime.serve.api import SIZE_MULTIPLE, APIError, EditRequest, GenerationRequest, parse_size
from flux_runtime.serve.worker import Abandoned, Generated, Job, Metrics, QueueFull, Worker

_FILE_NAME = re.compile(r"^[0-9a-f]{32}\.png$")


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one request may ask for, and how long the server waits for it."""

    max_n: int = 4
    max_side: int = 2048
    max_upload_bytes: int = 16 << 20
    timeout: float = 600.0
    retry_after: int = 5  # seconds, in a 503's Retry-After


class ImageStore:
    """The PNGs answered by `url`: a folder holding at most `max_files`, the oldest removed first."""

    def __init__(self, folder: Path, max_files: int) -> None:
        self.folder, self.max_files = folder, max_files
        folder.mkdir(parents=True, exist_ok=True)
        self._names: list[str] = []

    def put(self, data: bytes) -> str:
        name = f"{secrets.token_hex(16)}.png"
        (self.folder / name).write_bytes(data)
        self._names.append(name)
        while len(self._names) > self.max_files:
            (self.folder / self._names.pop(0)).unlink(missing_ok=True)
        return name

    def path(self, name: str) -> Path | None:
        if not _FILE_NAME.match(name) or not (self.folder / name).is_file():
            return None
        return self.folder / name


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


def create_app(
    pipe: Any,
    *,
    model: str,
    store: ImageStore,
    limits: Limits,
    max_queue: int = 16,
    max_batch: int = 4,
    batching: bool = True,
    drain: bool = True,
) -> FastAPI:
    """The server over the loaded `pipe`, served under the name `model`."""
    family = pipe.transformer.config.family
    references = family in ("flux2", "flux3")  # edits draw from reference images
    kind: EditKind = family if references else getattr(pipe, "variant", "text2img")
    metrics = Metrics(pipe.device)
    count_tokens = prompt_counter(pipe)
    worker = Worker(pipe, metrics, max_queue=max_queue, max_batch=max_batch, batching=batching, family=family)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
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

    app.add_middleware(_CountAnswers, metrics=metrics)

    def check_common(req: GenerationRequest) -> tuple[int, int] | None:
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
                tokens, limit = count_tokens(text), pipe.default_max_sequence_length
                if tokens > limit:
                    raise APIError(
                        400, f"{name} is {tokens} tokens; {model} reads at most {limit}", param=name
                    )
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
            guidance=req.guidance, quality=req.quality, negative_prompt=req.negative_prompt,
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
        data = await asyncio.to_thread(_encode, generated, response_format, store, str(request.base_url))
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
        # the pid tells a client that started this server that it talks to its own process, not to another
        # that took the same port first
        return {"status": "ok", "model": model, "queue_depth": worker.depth, "pid": os.getpid()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _CountAnswers:
    """Count every answer by route and status: a plain ASGI middleware (it leaves `receive` alone, so a
    handler still sees its client disconnect, which Starlette's BaseHTTPMiddleware would hide)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

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
        route = getattr(scope.get("route"), "path", "other")
        self.metrics.requests.labels(route, str(status.get("code", 0))).inc()


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
    generated: Generated, response_format: str, store: ImageStore, base_url: str
) -> list[dict[str, Any]]:
    """PNGs with the provenance chunk, as base64 or as URLs into the store."""
    data = []
    for image, info in generated:
        png = png_bytes(image, info)
        if response_format == "url":
            data.append({"url": f"{base_url}v1/images/files/{store.put(png)}", "revised_prompt": None})
        else:
            data.append({"b64_json": base64.b64encode(png).decode(), "revised_prompt": None})
    return data
