"""A stand-in for the Hugging Face Hub on 127.0.0.1, speaking the endpoints huggingface_hub's downloads use.

- `GET /api/models/{repo}[/revision/{rev}]`: the model info (`sha`, `siblings` with sizes, `gated`);
- `GET /api/models/{repo}/tree/{rev}[/{path}]`: the file list, in one page;
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}`: a file, with `X-Repo-Commit`, its sha256 as `ETag` and its
  `Content-Length`; a `Range: bytes=N-` request gets `206 Partial Content` from byte N.

No answer carries Xet headers or hashes, so the client downloads over plain HTTP. A gated repo answers its files
with 401 (no token) or 403 (a token that has not accepted the licence) and `X-Error-Code: GatedRepo`, as the
Hub does; its info and listing stay public. `drop_once` files send half their body on the first full GET and
then close the connection; `fail` files answer 500 to every GET. Every request is logged.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

ACCEPTED_TOKEN = "hf_accepted"  # a token whose account accepted every gated repo's licence


@dataclass
class Repo:
    """A repo: its files (path in the repo → bytes on disk) and whether it is gated."""

    files: dict[str, Path]
    gated: bool = False

    @property
    def sha(self) -> str:
        return hashlib.sha1("\n".join(sorted(self.files)).encode()).hexdigest()


@dataclass
class Request:
    method: str
    repo: str
    path: str  # the file's path in the repo ("" for API calls)
    kind: str  # "info", "tree" or "file"
    status: int
    range: str | None


@dataclass
class Hub:
    """The served repos and what happened: `log`, and the failures to stage (`drop_once`, `fail`)."""

    repos: dict[str, Repo]
    url: str = ""
    log: list[Request] = field(default_factory=list)
    drop_once: set[tuple[str, str]] = field(default_factory=set)
    fail: set[tuple[str, str]] = field(default_factory=set)
    _etags: dict[Path, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        self.log.clear()
        self.drop_once.clear()
        self.fail.clear()

    def fetched(self, repo: str | None = None) -> list[str]:
        """The files whose content was sent (GET answered 200 or 206), in order, of one repo or all."""
        return [
            r.path if repo else f"{r.repo}/{r.path}"
            for r in self.log
            if r.kind == "file" and r.method == "GET" and r.status in (200, 206) and repo in (None, r.repo)
        ]

    def etag(self, path: Path) -> str:
        with self._lock:
            if path not in self._etags:
                self._etags[path] = hashlib.sha256(path.read_bytes()).hexdigest()
            return self._etags[path]


_INFO = re.compile(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?")
_TREE = re.compile(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?")
_FILE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub

    def log_message(self, format: str, *args: object) -> None:  # quiet: the hub keeps its own log
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        found = [
            (k, m) for p, k in ((_TREE, "tree"), (_INFO, "info"), (_FILE, "file")) if (m := p.fullmatch(path))
        ]
        if not found:
            return self._send(404, b"", {}, "", path, "?", body)
        kind, m = found[0]
        name, repo = m.group(1), self.hub.repos.get(m.group(1))
        if repo is None:
            headers = {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
            return self._send(404, b"", headers, name, "", kind, body)
        if kind != "file":
            listing = [
                {"rfilename": p, "size": f.stat().st_size, "blobId": self.hub.etag(f)}
                for p, f in repo.files.items()
            ]
            if kind == "tree":
                data = [
                    {"type": "file", "path": x["rfilename"], "size": x["size"], "oid": x["blobId"]}
                    for x in listing
                ]
            else:
                data = {
                    "id": name,
                    "sha": repo.sha,
                    "gated": "manual" if repo.gated else False,
                    "private": False,
                }
                data["siblings"] = listing
            return self._send(
                200, json.dumps(data).encode(), {"Content-Type": "application/json"}, name, "", kind, body
            )
        return self._file(name, repo, m.group(3), body)

    def _file(self, name: str, repo: Repo, path: str, body: bool) -> None:
        common = {"X-Repo-Commit": repo.sha}
        if repo.gated and self.headers.get("Authorization") != f"Bearer {ACCEPTED_TOKEN}":
            status = 403 if self.headers.get("Authorization") else 401
            headers = {
                **common,
                "X-Error-Code": "GatedRepo",
                "X-Error-Message": "Access to model is restricted",
            }
            return self._send(status, b"", headers, name, path, "file", body)
        if path not in repo.files:
            return self._send(404, b"", {**common, "X-Error-Code": "EntryNotFound"}, name, path, "file", body)
        if body and (name, path) in self.hub.fail:
            return self._send(500, b"", common, name, path, "file", body)
        data = repo.files[path].read_bytes()
        headers = {**common, "ETag": f'"{self.hub.etag(repo.files[path])}"', "Accept-Ranges": "bytes"}
        start = _range_start(self.headers.get("Range"))
        if start is not None:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(206, data[start:], headers, name, path, "file", body)
        if body and (name, path) in self.hub.drop_once:
            self.hub.drop_once.discard((name, path))
            self._record(name, path, "file", 200)
            self._head(200, len(data), headers)
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # the connection drops mid-file
            self.close_connection = True
            return None
        return self._send(200, data, headers, name, path, "file", body)

    def _send(
        self, status: int, data: bytes, headers: dict[str, str], repo: str, path: str, kind: str, body: bool
    ) -> None:
        self._record(repo, path, kind, status)
        self._head(status, len(data), headers)
        if body:
            self.wfile.write(data)

    def _record(self, repo: str, path: str, kind: str, status: int) -> None:
        self.hub.log.append(Request(self.command, repo, path, kind, status, self.headers.get("Range")))

    def _head(self, status: int, length: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()


def _range_start(header: str | None) -> int | None:
    m = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(m.group(1)) if m else None


@contextmanager
def serve(repos: dict[str, Repo]) -> Iterator[Hub]:
    """Serve `repos` on a free port of 127.0.0.1 for the length of the block."""
    hub = Hub(repos)
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
