"""Moving weights between pinned host memory and the GPU: whole models, or block by block while they run.

A model is cut into `Unit`s: each layer (a transformer block, a text-encoder layer) and the rest. All of a
model's units are packed into one host buffer (page-locked with `cudaHostRegister` on a CUDA machine, so
copies run at full bus speed and asynchronously) and their tensors rebound to views of it. From there:

- `Unit.load` gives a unit its own device buffer (a copy on the side stream) and rebinds to it;
  `Unit.release` rebinds to the host views and drops the device buffer (nothing is copied back: weights
  never change);
- `BlockRing` runs a model whose streamed layers share a ring of device slots: before layer j computes
  the compute stream waits for its copy; once it has computed, the copy of the next streamed layer that
  maps to its slot is issued on the side stream (which waits for that computation first). The ring wraps
  around from one forward to the next, so the first blocks of step i + 1 are copied while the last of
  step i compute.

Every tensor keeps its dtype, shape and bytes, and views are 1 KiB aligned as the allocator aligns its
own tensors, so kernels see what they see on a resident model: the bits do not change. On a CPU the same
code runs with plain copies (the tests check bits that way). `ModelPlacement` applies a `Plan`'s mode to
one model and `Placement` to a pipeline, stage by stage.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flux_runtime.pipeline.memory import Mode, Part

log = logging.getLogger(__name__)

ALIGN = 1024


@dataclass
class _Entry:
    """One tensor of a unit: where it lives in the unit's bytes and who holds it."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    param: nn.Parameter | None  # rebinding `.data` keeps ties (one Parameter in several modules)
    owners: list[tuple[nn.Module, str]]  # (module, buffer name) for buffers
    source: Tensor | None  # the tensor to pack; dropped once packed


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _gather(roots: Sequence[nn.Module], skip: set[int]) -> dict[int, _Entry]:
    """The parameters and buffers under `roots` not in `skip` (tensor ids), deduplicated, in module order."""
    found: dict[int, _Entry] = {}
    for root in roots:
        for module in root.modules():
            for p in module._parameters.values():
                if p is not None and id(p) not in skip and id(p) not in found:
                    found[id(p)] = _Entry(0, 0, p.dtype, p.shape, p, [], p.data)
            for name, b in module._buffers.items():
                if b is None or id(b) in skip:
                    continue
                entry = found.setdefault(id(b), _Entry(0, 0, b.dtype, b.shape, None, [], b))
                entry.owners.append((module, name))
    return found


class Unit:
    """The tensors of one layer (or of a model outside its layers), packed into one span of bytes."""

    def __init__(self, name: str, entries: list[_Entry]) -> None:
        self.name = name
        self.entries = entries
        offset = 0
        for e in entries:
            assert e.source is not None and e.source.is_contiguous(), f"{name}: a non-contiguous tensor"
            e.offset, e.nbytes = offset, e.source.numel() * e.source.element_size()
            offset = _round(offset + e.nbytes)
        self.nbytes = offset
        self.host: Tensor | None = None
        self.owned: Tensor | None = None  # its own device buffer, when loaded

    def pack_into(self, host: Tensor) -> None:
        """Copy the tensors into `host` (this unit's span of the model's host buffer) and bind them there."""
        self.host = host
        for e in self.entries:
            assert e.source is not None
            view = self._view(host, e)
            view.copy_(e.source)
            e.source = None
            self._bind_one(e, view)  # the original is freed here (unless someone else holds it)

    def bind(self, flat: Tensor) -> None:
        """Point every tensor of the unit at its view of `flat` (host buffer, own buffer or a ring slot)."""
        for e in self.entries:
            self._bind_one(e, self._view(flat, e))

    @staticmethod
    def _bind_one(e: _Entry, view: Tensor) -> None:
        if e.param is not None:
            e.param.data = view
        for module, name in e.owners:
            module._buffers[name] = view

    @staticmethod
    def _view(flat: Tensor, e: _Entry) -> Tensor:
        return flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)

    def load(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        """Copy to an own device buffer (on `stream` when given; the caller waits for it) and bind there."""
        if self.owned is None:
            assert self.host is not None
            self.owned = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            with torch.cuda.stream(stream) if stream is not None else _nothing():
                self.owned.copy_(self.host, non_blocking=stream is not None)
        self.bind(self.owned)

    def release(self) -> None:
        """Back to the host views; the device buffer is freed (in stream order)."""
        assert self.host is not None
        self.bind(self.host)
        self.owned = None


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class HostBuffer:
    """One model's host bytes, page-locked for the GPU's copy engine once filled (`pin`)."""

    def __init__(self, nbytes: int) -> None:
        # untouched pages of an empty tensor take no memory: the buffer fills as the originals are freed
        self.data = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.pinned = False

    def pin(self) -> None:
        """Page-lock the buffer with cudaHostRegister (exactly these pages; `pin_memory=True` allocations
        round up to a power of two, which can nearly double a model's host memory)."""
        err = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.data.numel(), 0)
        self.pinned = int(err) == 0
        if not self.pinned:
            log.warning(
                "could not page-lock %d MB of host memory; copies to the GPU will be slower and synchronous",
                self.data.numel() >> 20,
            )

        if self.pinned:  # unlocked when the buffer goes, before its memory is freed
            weakref.finalize(self, torch.cuda.cudart().cudaHostUnregister, self.data.data_ptr())


def split_units(name: str, roots: Sequence[nn.Module], layers: Sequence[nn.Module]) -> list[Unit]:
    """`[rest, layer 0, layer 1, ...]`: the layers' tensors each in a unit, everything else under `roots` in
    the first one (gathered once, before anything is rebound)."""
    per_layer = [_gather([layer], set()) for layer in layers]
    skip = {k for found in per_layer for k in found}
    units = [Unit(f"{name} (outside its blocks)", list(_gather(roots, skip).values()))]
    units += [Unit(f"{name} block {i}", list(found.values())) for i, found in enumerate(per_layer)]
    return units


def part_of(roots: Sequence[nn.Module], layers: Sequence[nn.Module]) -> Part:
    """The planner's view of a model: bytes outside its layers and of each layer (no tensors moved)."""

    def size(found: dict[int, _Entry]) -> int:
        return sum(_round(e.source.numel() * e.source.element_size()) for e in found.values())  # type: ignore[union-attr]

    per_layer = [_gather([layer], set()) for layer in layers]
    skip = {k for found in per_layer for k in found}
    return Part(size(_gather(roots, skip)), tuple(size(f) for f in per_layer))


class BlockRing:
    """Streamed layers cycling through `slots` device buffers, copies one step ahead on a side stream."""

    def __init__(
        self, units: list[Unit], modules: list[nn.Module], slots: int, device: torch.device,
        stream: torch.cuda.Stream | None,
    ) -> None:  # fmt: skip
        self.units, self.device, self.stream = units, device, stream
        self.k = min(slots, len(units))
        self.slots = [
            torch.empty(max(u.nbytes for u in units), dtype=torch.uint8, device=device) for _ in range(self.k)
        ]
        for j, unit in enumerate(units):
            unit.bind(self.slots[j % self.k])
        self.hooks = []
        for j, module in enumerate(modules):
            self.hooks.append(module.register_forward_pre_hook(lambda m, a, j=j: self._before(j)))
            self.hooks.append(module.register_forward_hook(lambda m, a, o, j=j: self._after(j)))
        self._reset()

    def _reset(self) -> None:
        """Nothing in flight, every slot free; the next copy is layer 0's."""
        if self.stream is not None:
            self.stream.synchronize()
        self.busy = [False] * self.k  # holds a layer copied (or being copied) but not yet computed
        self.freed: list[torch.cuda.Event | None] = [None] * self.k
        self.ready: dict[int, torch.cuda.Event | None] = {}
        self.next_copy = 0
        self.expected = 0

    def _issue(self) -> None:
        """Copy upcoming layers into their slots while the slots are free."""
        n = len(self.units)
        while True:
            j = self.next_copy
            s = j % self.k
            if self.busy[s] or j in self.ready:
                return
            unit = self.units[j]
            assert unit.host is not None
            if self.stream is None:
                self.slots[s][: unit.nbytes].copy_(unit.host)
                self.ready[j] = None
            else:
                with torch.cuda.stream(self.stream):
                    freed = self.freed[s]
                    if freed is not None:
                        self.stream.wait_event(freed)  # its previous layer has computed
                    self.slots[s][: unit.nbytes].copy_(unit.host, non_blocking=True)
                    self.ready[j] = torch.cuda.Event()
                    self.ready[j].record(self.stream)
            self.busy[s] = True
            self.next_copy = (j + 1) % n

    def _before(self, j: int) -> None:
        if j != self.expected:  # a forward ended early (an error): start the ring over from here
            self._reset()
            self.next_copy = self.expected = j
        self._issue()
        event = self.ready.get(j)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self.expected = (j + 1) % len(self.units)

    def _after(self, j: int) -> None:
        s = j % self.k
        self.ready.pop(j, None)
        self.busy[s] = False
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.freed[s] = event
        self._issue()

    def close(self) -> None:
        """Wait for copies in flight, remove the hooks and free the slots (units go back to host views)."""
        if self.stream is not None:
            self.stream.synchronize()
        for h in self.hooks:
            h.remove()
        for unit in self.units:
            unit.release()
        self.slots = []


class ModelPlacement:
    """One model under a plan's mode: resident (on the device for good), offloaded (all units in for its
    stage, out after), or streamed (the listed layers through a `BlockRing`, the rest in for the stage).

    The model is packed into pinned host memory the first time a mode other than resident is asked for;
    after that, changing modes moves no weights between host buffers.
    """

    def __init__(
        self, name: str, roots: Sequence[nn.Module], layers: Sequence[nn.Module], device: torch.device
    ) -> None:
        self.name, self.device = name, device
        self.roots, self.layer_modules = list(roots), list(layers)
        self.mode: Mode = "resident"
        self.streamed: tuple[int, ...] = ()
        self.slots = 2
        self.units: list[Unit] = []
        self.host: HostBuffer | None = None
        self.ring: BlockRing | None = None
        self.on_device = False
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def set_mode(self, mode: Mode, streamed: Sequence[int] = (), slots: int = 2) -> None:
        """Switch to `mode` (a resident model is put on the device now; the others at their stage)."""
        self._off()
        self.mode, self.streamed, self.slots = mode, tuple(streamed), slots
        if mode != "resident" and not self.units:
            self._pack()
        if mode == "resident":
            self.enter()

    def _pack(self) -> None:
        """Copy every tensor into one host buffer (tensor by tensor, each original freed as it is copied),
        then page-lock it."""
        self.units = split_units(self.name, self.roots, self.layer_modules)
        self.host = HostBuffer(sum(u.nbytes for u in self.units))
        offset = 0
        for unit in self.units:
            unit.pack_into(self.host.data[offset : offset + unit.nbytes])
            offset += unit.nbytes
        self.on_device = False
        if self.device.type == "cuda":
            self.host.pin()
            torch.cuda.empty_cache()  # the device copies just dropped

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def enter(self) -> None:
        """Make the model runnable on the device for its stage (a no-op when it is already)."""
        if self.on_device:
            return
        if not self.units:  # never packed: ordinary modules
            for root in self.roots:
                root.to(self.device)
            self.on_device = True
            return
        streamed = set(self.streamed) if self.mode == "streamed" else set()
        for i, unit in enumerate(self.units):
            if i == 0 or (i - 1) not in streamed:
                unit.load(self.device, self.stream)
        if streamed:
            order = sorted(streamed)
            self.ring = BlockRing(
                [self.units[i + 1] for i in order], [self.layer_modules[i] for i in order], self.slots,
                self.device, self.stream,
            )  # fmt: skip
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.on_device = True

    def leave(self) -> None:
        """Off the device (host views only), unless resident."""
        if self.mode != "resident":
            self._off()

    def _off(self) -> None:
        if not self.units:  # plain modules stay where they are (packing moves them)
            return
        # an `enter` cut short (out of memory part way through its copies) leaves some units loaded
        if not self.on_device and all(u.owned is None for u in self.units):
            return
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        for unit in self.units:
            unit.release()
        self.on_device = False
        if self.device.type == "cuda":
            # hand the freed segments back to the driver: left cached, the next model's weights would be
            # carved out of them (the caching allocator splits a free block for any smaller request), and
            # the remainders, too small for most activations, stay reserved (T5's 386 MB layers split for
            # FLUX.1-dev's 283 MB single blocks leave 24 holes of 103 MB: 2.3 GiB of a 24 GB budget)
            torch.cuda.empty_cache()
