"""CUDA-graph capture of the denoiser per input signature: a replay runs the same kernels, so it is lossless.

A step's hundreds of small launches become one graph launch. The first call of a signature runs
eagerly (it warms up cuBLAS handles and compiles Triton kernels, and its result is the real step's);
the second captures and replays; later calls replay. Inputs (tensors, None, or tuples of them such as
FLUX.3's fixed text streams) are copied into static buffers each call; the output is a static buffer, valid
until the next call (the Euler loop consumes it at once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from flux_runtime.kernels import fused_ops_report
from flux_runtime.kernels.attention_backends import attention_record

log = logging.getLogger(__name__)


class CudaCapture:
    """What recording needs from CUDA, in one place (a test stands in for it on a CPU)."""

    def graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    @contextmanager
    def stream(self) -> Iterator[None]:
        """A side stream to record on (capture cannot run on the default stream), joined back afterwards; the
        allocator's free cached blocks go back to the driver first (as `torch.cuda.graph` does), so that the
        graphs' own pool has room."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def begin(self, graph: Any, pool: Any) -> None:
        graph.capture_begin(pool=pool)

    def end(self, graph: Any) -> None:
        graph.capture_end()


class GraphedDenoiser:
    """Wrap `fn(*inputs)`; eager on first use of a signature, captured on the second, replayed after."""

    def __init__(self, fn: Callable[..., Tensor], capture: CudaCapture | None = None) -> None:
        self.fn = fn
        self.capture = capture or CudaCapture()
        self.seen: set[tuple] = set()
        self.graphs: dict[tuple, tuple[Any, list[Tensor | None], Tensor]] = {}
        self.pool = None
        # replays run no Python, so the dispatch record stays empty: keep what the eager/captured call used
        self.tier_used: str | None = None
        self.attention: dict[str, str] = {}  # likewise the attention backend (`attention_record`)

    @staticmethod
    def signature(leaves: list[Any], spec: pytree.TreeSpec) -> tuple:
        shapes = tuple(None if x is None else (tuple(x.shape), x.stride(), x.dtype, x.device) for x in leaves)
        return (spec, shapes)  # tree specs hash and compare by structure

    def __call__(self, *xs: Any) -> Tensor:
        leaves, spec = pytree.tree_flatten(xs)
        key = self.signature(leaves, spec)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                self.seen.add(key)
                out = self.fn(*xs)
                self.tier_used, self.attention = fused_ops_report().tier_used, attention_record()
                return out
            entry = self.graphs[key] = self._capture(leaves, spec)
            self.tier_used, self.attention = fused_ops_report().tier_used, attention_record()
        graph, static_in, static_out = entry
        for buf, x in zip(static_in, leaves, strict=True):
            if buf is not None:
                buf.copy_(x)
        graph.replay()
        return static_out

    def _capture(self, leaves: list[Any], spec: pytree.TreeSpec):
        log.info(
            "capturing a CUDA graph of the denoiser for %s",
            [None if x is None else tuple(x.shape) for x in leaves],
        )
        capture = self.capture
        static_in = [None if x is None else x.clone() for x in leaves]
        graph = capture.graph()
        if self.pool is None:
            self.pool = capture.pool()
        with capture.stream():
            capture.begin(graph, self.pool)
            try:
                static_out = self.fn(*pytree.tree_unflatten(static_in, spec))
            finally:
                capture.end(graph)
        return graph, static_in, static_out


def kernels_used(graphed: Any) -> str:
    """Which kernels the last generation ran ("off", "lossless", "<tier>, partly reference").

    Read from the dispatch record; when every step was a graph replay the record is empty, and the
    graph's own record (`graphed`: a `GraphedDenoiser` or a cached branch's `SplitGraphs`) (taken when it ran eagerly or was captured) says it instead.
    """
    report = fused_ops_report()
    if report.fused_calls or report.fallbacks or graphed is None:
        return report.tier_used
    return getattr(graphed, "tier_used", None) or report.tier_used


# what the provenance says when no attention call was recorded (every family's blocks record theirs; this is
# the record of a denoiser that would not)
SDPA_ONLY = {"attention": "sdpa", "attention_reason": "the model's attention runs SDPA only"}


def attention_used(graphed: Any) -> dict[str, str]:
    """The attention backend the last generation ran (`attention_record`), from the graph's own record when every
    step was a replay, else `SDPA_ONLY`."""
    return attention_record() or (graphed.attention if graphed is not None else {}) or dict(SDPA_ONLY)
