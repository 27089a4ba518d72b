"""The request models (pydantic) and errors shaped as OpenAI's: `{"error": {message, type, param, code}}`.

Field names follow OpenAI's Images API (`prompt`, `n`, `size`, `response_format`, `model`, `user`); the
FLUX controls (`seed`, `steps`, `guidance`, `quality`, `cache`, `negative_prompt`, `true_cfg_scale`, `upsample`, `timeout`;
for edits `strength`, `max_area`, `auto_resize`) are extra fields, sent by the openai client through `extra_body`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# the size multiple of every FLUX model: the VAE's factor 8 times the 2x2 latent packing
SIZE_MULTIPLE = 16
_SIZE = re.compile(r"^(\d{1,9})x(\d{1,9})$")


class APIError(Exception):
    """An error answered as OpenAI answers one: HTTP `status`, a message, the field at fault (`param`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class GenerationRequest(BaseModel):
    """`POST /v1/images/generations` (JSON). Unknown fields are refused, so a typo is not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=20_000)
    model: str | None = None
    n: int = Field(1, ge=1)
    size: str | None = None  # "WIDTHxHEIGHT"; None or "auto": the model's default size
    response_format: Literal["b64_json", "url"] = "b64_json"
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # None: a random seed, recorded in the PNG
    steps: int | None = Field(None, ge=1)
    guidance: float | None = Field(None, ge=0)
    quality: Literal["lossless", "high"] | None = None
    cache: str | None = Field(
        None, max_length=200
    )  # a step-cache spec ("first-block:threshold=0.1"); runs alone
    negative_prompt: str | None = Field(None, min_length=1, max_length=20_000)
    true_cfg_scale: float = Field(1.0, ge=1)
    upsample: bool | None = None  # FLUX.3: run the prompt upsampler (None: the model's default)
    timeout: float | None = Field(None, gt=0)  # seconds; at most the server's --timeout


class EditRequest(GenerationRequest):
    """The form fields of `POST /v1/images/edits` (multipart; the files `image` / `image[]` and `mask` are
    read beside these)."""

    strength: float | None = Field(None, gt=0, le=1)  # FLUX.1 img2img / inpainting
    max_area: int | None = Field(None, ge=1)  # FLUX.1 Kontext: output pixels (default: native area)
    auto_resize: bool | None = None  # FLUX.1 Kontext: the reference to its preferred resolution (default on)


def parse_size(size: str | None, max_side: int) -> tuple[int, int] | None:
    """(width, height) from "WxH", None for the model's default; an APIError naming `size` otherwise."""
    if size is None or size == "auto":
        return None
    m = _SIZE.match(size)
    if m is None:
        raise APIError(400, f"size {size!r} must be WIDTHxHEIGHT in pixels, e.g. 512x512", param="size")
    w, h = int(m[1]), int(m[2])
    for name, v in (("width", w), ("height", h)):
        if v % SIZE_MULTIPLE or v == 0:
            raise APIError(
                400, f"size {size}: {name} {v} is not a positive multiple of {SIZE_MULTIPLE}", param="size"
            )
        if v > max_side:
            raise APIError(400, f"size {size}: {name} {v} is over this server's {max_side}", param="size")
    return w, h
