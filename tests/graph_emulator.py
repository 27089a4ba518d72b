"""A CPU stand-in for CUDA-graph recording, for tests of code that records and replays graphs.

`EmulatedCapture` has the interface of `flux_runtime.pipeline.cached_graphs.CudaCapture`. While a graph records,
a dispatch mode notes every aten op with its arguments and results; a replay runs the noted ops again on the
same tensors and writes each result into the tensor the recording produced, so later ops (and later graphs)
read it where it lies, as on a GPU. What a CUDA graph does not do, the stand-in does not either:

- Python between the ops does not run again on replay: a host decision taken while recording is frozen;
- a host read of a tensor (`.item()`, a truth value) while recording is an error, as stream capture's is;
- recording computes nothing that may be read before a replay: every tensor the recording made is poisoned
  with NaN (integers with -1) when it ends, so code reading a graph's outputs without replaying it fails.

It differs in one way: tensors the recording allocates are never reused by later recordings (a CUDA memory pool
may reuse a freed block), so a test here cannot show a pool hazard.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"{func} reads a tensor on the host while a graph records")
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


class EmulatedGraph:
    """The ops noted while recording, run again by `replay`."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.recorder: _Recorder | None = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            if func._overloadpacket in (aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty):
                continue  # an allocation, no kernel
            fresh = func(*args, **kwargs)
            for old, new in zip(pytree.tree_leaves(out), pytree.tree_leaves(fresh), strict=True):
                if isinstance(old, torch.Tensor) and _storage(old) != _storage(new):
                    old.copy_(new)

    def poison(self) -> None:
        """What a real recording leaves in its tensors: nothing computed."""
        for _, args, kwargs, out in self.ops:
            inputs = {_storage(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and _storage(t) not in inputs and t.numel():
                    t.fill_(float("nan") if t.is_floating_point() else -1)


class EmulatedCapture:
    """`CudaCapture` on a CPU: graphs are `EmulatedGraph`s; `made` counts them."""

    def __init__(self) -> None:
        self.made: list[EmulatedGraph] = []

    def graph(self) -> EmulatedGraph:
        self.made.append(EmulatedGraph())
        return self.made[-1]

    def pool(self) -> None:
        return None

    def stream(self) -> nullcontext:
        return nullcontext()

    def begin(self, graph: EmulatedGraph, pool: Any) -> None:
        assert graph.recorder is None and not graph.ops, "a graph records once"
        graph.recorder = _Recorder(graph)
        graph.recorder.__enter__()

    def end(self, graph: EmulatedGraph) -> None:
        assert graph.recorder is not None
        graph.recorder.__exit__(None, None, None)
        graph.poison()
