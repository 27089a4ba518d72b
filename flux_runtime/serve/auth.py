"""API keys: `Authorization: Bearer KEY` on every route but the probes, as vLLM and SGLang check it.

The server keeps only the keys' SHA-256 digests, so a key is never in its memory dumps, its logs, its metrics
or (under Ray) its deployment's arguments; a presented key is hashed and compared with every digest in
constant time. The check is a plain ASGI middleware, so a request without the key is answered 401 before its
body is read or its route runs.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Any

from starlette.responses import JSONResponse

ENV_VAR = "FLUX_SERVE_API_KEY"
"""The environment variable of the keys (comma-separated), read when no `--api-key` is given."""

PROBES = ("/health", "/ready")
"""The routes open without a key: a balancer or an orchestrator probes them."""


def check_key(key: str, where: str) -> None:
    """A ValueError naming `where` (never the key) unless `key` is printable ASCII without whitespace,
    what an HTTP header carries unchanged."""
    if not key:
        raise ValueError(f"{where} is empty")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{where} holds whitespace or a character other than printable ASCII")


class ApiKeys:
    """The accepted keys, as SHA-256 digests; empty: every request is let in."""

    def __init__(self, digests: Iterable[bytes] = ()) -> None:
        self.digests = tuple(digests)

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        return cls(hashlib.sha256(k.encode()).digest() for k in keys)

    def __bool__(self) -> bool:
        return bool(self.digests)

    def __repr__(self) -> str:  # digests only, but nothing of them in a log either
        return f"ApiKeys({len(self.digests)} keys)"

    def accepts(self, authorization: bytes) -> bool:
        """Whether an `Authorization` header value carries one of the keys; every digest is compared, each
        in constant time, so the answer's timing says nothing of which key came close."""
        scheme, _, token = authorization.strip().partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        found = False
        for d in self.digests:
            found |= hmac.compare_digest(d, digest)
        return found and scheme.lower() == b"bearer"


class RequireKey:
    """ASGI middleware: 401 in OpenAI's error shape unless the request carries an accepted key; `open_paths`
    (the probes, and /metrics with --metrics-public) need none."""

    def __init__(self, app: Any, keys: ApiKeys, open_paths: tuple[str, ...]) -> None:
        self.app, self.keys, self.open_paths = app, keys, open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys:
            await self.app(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if path in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if given and self.keys.accepts(given[0]):
            await self.app(scope, receive, send)
            return
        if given:
            message, code = "the API key is not one this server accepts", "invalid_api_key"
        else:
            message, code = "no API key: send the header 'Authorization: Bearer KEY'", "missing_api_key"
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        answer = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await answer(scope, receive, send)
