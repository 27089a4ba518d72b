"""Streaming safetensors bytes onto a GPU at the machine's copy bandwidth, through a bounded pinned ring.

A load reads each tensor's byte range once. Reading it with one thread into fresh pageable memory and copying
it with a blocking `.to("cuda")` runs at a small fraction of what the machine moves from the page cache: the
copy waits for the read, the read for the copy, and pageable copies are staged by the driver. Here:

- `ReaderThreads` reader threads (`os.preadv`, which releases the GIL) fill the buffers of one `PinnedRing`,
  a fixed set of page-locked host buffers, in the order the loader will ask for the tensors;
- the main thread issues each filled buffer's copy into the tensor's GPU memory on a side stream, without
  waiting, and hands the buffer back to the readers once that copy has run (an event per buffer);
- the loader's own GPU work (casts, merges, quantization, finite checks) runs on its stream as each tensor
  arrives, ordered after its copies by an event, so reading, copying and transforming overlap.

Host memory beyond the process's baseline is the ring (`slots * buffer_bytes`, 512 MiB by default) whatever
the checkpoint's size; GPU memory is the tensors asked for plus those read ahead of the loader (at most the
ring's worth). A ring is made once per `keep_ring()` scope (a pipeline's whole load), or ahead of it by
`prepare_ring` (flux-gen, while it imports), and reused by every component's load inside it; outside one, each
load makes and frees its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ContextDecorator, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from flux_runtime.weights.errors import WeightsError

MIB = 1024 * 1024
# Tests turn this on (or FLUX_LOAD_STREAM_CPU=1 for a whole run) to put loads onto the CPU through the same
# streaming logic (an unpinned ring, copies at once); otherwise a CPU load reads one tensor at a time, which
# keeps its host memory at the model's size.
stream_on_cpu = os.environ.get("FLUX_LOAD_STREAM_CPU") == "1"


def _env_int(name: str, default: int, low: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise WeightsError(f"{name}={raw!r} must be a whole number (at least {low})") from None
    if value < low:
        raise WeightsError(f"{name}={value} must be at least {low}")
    return value


@dataclass(frozen=True)
class RingShape:
    """How a load reads: `threads` readers sharing `slots` pinned buffers of `buffer_bytes` each.

    Defaults: 16 readers (fewer on a machine with fewer cores than 8), 32 MiB buffers, two buffers a reader
    (one being read into while the other's copy runs). `FLUX_LOAD_THREADS`, `FLUX_LOAD_BUFFER_MB` and
    `FLUX_LOAD_SLOTS` override them, e.g. for a disk that prefers fewer, larger reads.
    """

    threads: int
    slots: int
    buffer_bytes: int

    @property
    def host_bytes(self) -> int:
        """The pinned host memory the ring holds: the load's host-memory bound."""
        return self.slots * self.buffer_bytes

    @classmethod
    def default(cls) -> RingShape:
        threads = _env_int("FLUX_LOAD_THREADS", 16 if (os.cpu_count() or 1) >= 8 else 4, 1)
        buffer_mb = _env_int("FLUX_LOAD_BUFFER_MB", 32, 1)
        slots = _env_int("FLUX_LOAD_SLOTS", max(2, min(2 * threads, 16)), 2)
        return cls(threads, slots, buffer_mb * MIB)


class PinnedRing:
    """`slots` page-locked host buffers of `buffer_bytes`, with the event of each buffer's last copy."""

    def __init__(self, shape: RingShape, pinned: bool = True) -> None:
        self.shape = shape
        self.pinned = pinned
        self._storage = torch.empty(shape.host_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.buffers = [
            self._storage[i * shape.buffer_bytes : (i + 1) * shape.buffer_bytes] for i in range(shape.slots)
        ]
        self.events: list[torch.cuda.Event | None] = [None] * shape.slots

    def drain(self) -> None:
        """Wait for every copy out of the ring (before its buffers are reused by another stream or freed)."""
        for ev in self.events:
            if ev is not None:
                ev.synchronize()
        self.events = [None] * self.shape.slots

    def release(self) -> None:
        self.drain()
        self.buffers = []
        del self._storage
        # torch keeps freed pinned blocks cached for reuse; hand them back so the bound holds after the load.
        empty = getattr(torch._C, "_host_emptyCache", None)
        if self.pinned and empty is not None:
            empty()


_kept: list[PinnedRing | None] = [None]
_kept_depth = [0]
_lock = threading.Lock()
_spare: list[PinnedRing] = []  # made ahead by `prepare_ring`, for the next scope's first GPU load
_preparing: list[threading.Thread] = []


def prepare_ring() -> bool:
    """Make the next `keep_ring` scope's ring now, on a daemon thread: page-locking 512 MiB (and torch's CUDA
    start-up, which a pinned allocation needs) then runs while the caller goes on with other work (a command still
    importing its modules) instead of inside the load. Once per process; an error there leaves no ring, and the
    load makes its own (and reports the problem) as without this. Returns whether a thread was started."""
    with _lock:
        if _preparing or _kept[0] is not None:
            return False
        thread = threading.Thread(target=_make_spare, name="flux-load-ring", daemon=True)
        _preparing.append(thread)
    thread.start()
    return True


def _make_spare() -> None:
    try:
        made = PinnedRing(RingShape.default())
    except Exception:  # the load's own ring meets the same problem and reports it
        return
    with _lock:
        _spare.append(made)


def _take_spare(shape: RingShape) -> PinnedRing | None:
    """`prepare_ring`'s ring when it is of `shape` (waiting for it if it is still being made), else None."""
    for thread in _preparing:
        thread.join()
    with _lock:
        spare = _spare.pop() if _spare else None
    if spare is not None and spare.shape != shape:
        spare.release()
        return None
    return spare


class keep_ring(ContextDecorator):
    """Within this scope every GPU load shares one pinned ring, made on first use and freed at the scope's end.

    A pipeline's load wraps its component loads (transformer, autoencoder, text encoders) in one scope, so
    the ring's page-locking cost is paid once.
    """

    def __enter__(self) -> keep_ring:
        with _lock:
            _kept_depth[0] += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            _kept_depth[0] -= 1
            ring = _kept[0] if _kept_depth[0] == 0 else None
            if ring is not None:
                _kept[0] = None
        if ring is not None:
            ring.release()


@contextmanager
def ring(pinned: bool = True) -> Iterator[PinnedRing]:
    """The scope's ring (made now if this is its first GPU load), or a ring of this load's own (always
    for an unpinned one: a stream onto the CPU)."""
    shape = RingShape.default()
    spare = _take_spare(shape) if pinned and _kept_depth[0] > 0 and _kept[0] is None else None
    with _lock:
        shared = pinned and _kept_depth[0] > 0
        if shared and _kept[0] is None:
            _kept[0] = spare if spare is not None else PinnedRing(shape)
        elif spare is not None:
            _spare.append(spare)
        kept = _kept[0] if shared else None
    if kept is not None:
        yield kept
        return
    own = PinnedRing(shape, pinned)
    try:
        yield own
    finally:
        own.release()


@dataclass(frozen=True)
class Span:
    """One tensor's bytes: `nbytes` at absolute offset `offset` of `path`."""

    key: str
    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Window:
    """One read into one ring buffer: `length` bytes of `path` from absolute `offset`, holding the bytes of one
    or more planned tensors that lie back to back in the file (`keys`, with where each starts in the window)."""

    path: Path
    offset: int
    length: int
    keys: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class _Piece:
    window: int  # index into the windows
    start: int  # offset in the window's buffer
    length: int
    into: int  # offset in the tensor's bytes
    last: bool  # the window's last piece: its buffer is free once this copy has run


def plan_windows(plan: Sequence[Span], buffer_bytes: int) -> tuple[list[_Window], list[list[_Piece]]]:
    """The reads of a stream and each planned tensor's pieces of them.

    Tensors that lie back to back in one file, in plan order (a safetensors file read in file order), share
    full buffers: a buffer is filled with up to `buffer_bytes` of the file whatever the tensors' sizes, so a
    run of small tensors (biases, norms: most of a FLUX transformer's tensors by count) costs one read and one
    buffer, not one each. A tensor larger than a buffer spans several; a jump (another file, a gap, plan order
    against file order) starts a new read. An empty tensor has no pieces.
    """
    reads: list[list] = []  # [path, offset, length, [(start in the window, key), ...]]
    pieces: list[list[_Piece]] = []
    for s in plan:
        mine: list[_Piece] = []
        into = 0
        while into < s.nbytes:
            pos = s.offset + into
            last = reads[-1] if reads else None
            if last is None or last[0] != s.path or last[1] + last[2] != pos or last[2] == buffer_bytes:
                last = [s.path, pos, 0, []]
                reads.append(last)
            n = min(s.nbytes - into, buffer_bytes - last[2])
            last[3].append((last[2], s.key))
            mine.append(_Piece(len(reads) - 1, last[2], n, into, False))
            last[2] += n
            into += n
        pieces.append(mine)
    # a window's last piece frees its buffer
    seen: set[int] = set()
    for mine in reversed(pieces):
        for k in range(len(mine) - 1, -1, -1):
            piece = mine[k]
            if piece.window not in seen:
                seen.add(piece.window)
                mine[k] = _Piece(piece.window, piece.start, piece.length, piece.into, True)
    windows = [_Window(path, offset, length, tuple(keys)) for path, offset, length, keys in reads]
    return windows, pieces


class DeviceStream:
    """The planned tensors' bytes on `device`, read ahead through `ring` in the plan's order.

    `take(key)` returns a key's bytes as a 1-D uint8 tensor on `device`, ready for the caller's current
    stream. Keys are meant to be taken in plan order; one taken early makes the stream read (and hold)
    the keys before it. A key taken twice, or not planned, is not served here (`has`). The reads are
    `plan_windows`' (full buffers of back-to-back tensors). On a GPU the copies out of the ring run on a
    side stream; onto the CPU (tests of the same logic, no GPU needed) they run at once.
    """

    def __init__(self, plan: Sequence[Span], device: torch.device, ring: PinnedRing) -> None:
        self.device = device
        self.ring = ring
        self.plan = list(plan)
        self._index = {s.key: i for i, s in enumerate(self.plan)}
        if len(self._index) != len(self.plan):
            raise ValueError("a stream's plan names a key twice")
        self._windows, self._pieces = plan_windows(self.plan, ring.shape.buffer_bytes)
        self._fds: dict[Path, int] = {}
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(ring.shape.threads, thread_name_prefix="flux-load")
        self._reads: dict[int, Future[None]] = {}
        self._issued = 0  # plan entries whose copies have been issued
        self._ready: dict[str, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._taken: set[str] = set()
        try:
            for s in self.plan:
                if s.path not in self._fds:
                    self._fds[s.path] = os.open(s.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            self.close()
            raise WeightsError(f"{e.filename}: cannot open ({e.strerror})") from None
        for w in range(min(ring.shape.slots, len(self._windows))):
            self._submit(w)

    def has(self, key: str) -> bool:
        return key in self._index and key not in self._taken

    def take(self, key: str) -> torch.Tensor:
        """`key`'s bytes on the device, its copies ordered before the caller's current stream's next work."""
        want = self._index[key]
        while self._issued <= want:
            self._issue(self._issued)
            self._issued += 1
        data, done = self._ready.pop(key)
        self._taken.add(key)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return data

    def close(self) -> None:
        """Stop reading ahead, wait for the reads and copies in flight, close the files."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.ring.drain()
        self._ready.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # ----------------------------------------------------------------------------------------------

    def _submit(self, w: int) -> None:
        self._reads[w] = self._pool.submit(self._read, w)

    def _read(self, w: int) -> None:
        window = self._windows[w]
        slot = w % self.ring.shape.slots
        ev = self.ring.events[slot]
        if ev is not None:  # the buffer's previous copy must have run before it is overwritten
            ev.synchronize()
        view = memoryview(self.ring.buffers[slot].numpy())[: window.length]
        read_exactly(self._fds[window.path], view, window.offset, window.path, window.keys)

    def _issue(self, i: int) -> None:
        span = self.plan[i]
        data = torch.empty(span.nbytes, dtype=torch.uint8, device=self.device)
        if self._side is not None:
            # `data` may reuse memory the current stream freed with work still pending: copy after that work
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        done = None
        slots = self.ring.shape.slots
        for piece in self._pieces[i]:
            w, slot = piece.window, piece.window % slots
            self._reads[w].result()  # a read error surfaces here, naming the file and the tensor
            into = data[piece.into : piece.into + piece.length]
            src = self.ring.buffers[slot][piece.start : piece.start + piece.length]
            if self._side is None:
                into.copy_(src)
            else:
                with torch.cuda.stream(self._side):
                    into.copy_(src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._side)
                self.ring.events[slot] = done
            if piece.last:
                del self._reads[w]
                if w + slots < len(self._windows):
                    self._submit(w + slots)
        self._ready[span.key] = (data, done)


def read_exactly(
    fd: int, view: memoryview, offset: int, path: Path, keys: tuple[tuple[int, str], ...]
) -> None:
    """Fill `view` with the file's bytes from `offset`, or a WeightsError naming the tensor the file ends in
    (`keys`: the tensors the bytes hold, with where each starts in `view`)."""
    done, total = 0, len(view)
    while done < total:
        if hasattr(os, "preadv"):
            got = os.preadv(fd, [view[done:]], offset + done)
        else:  # no preadv on this platform: read, then copy into the buffer
            chunk = os.pread(fd, total - done, offset + done)
            got = len(chunk)
            view[done : done + got] = chunk
        if got == 0:
            key = next((k for start, k in reversed(keys) if start <= done), keys[0][1] if keys else "?")
            raise WeightsError(f"{path}: cannot read {key!r} (the file is shorter than its header says)")
        done += got


@contextmanager
def device_stream(plan: Sequence[Span], device: torch.device) -> Iterator[DeviceStream]:
    """A `DeviceStream` over `plan` for the length of the scope (its ring the scope's, or its own)."""
    with ring(pinned=device.type == "cuda") as r:
        stream = DeviceStream(plan, device, r)
        try:
            yield stream
        finally:
            stream.close()
