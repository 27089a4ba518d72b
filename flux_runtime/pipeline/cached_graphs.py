"""CUDA graphs for step-cached calls: one forward recorded as three graphs, the host choosing between two.

A cached step runs the transformer's probe, asks the step cache whether to reuse, then runs either the rest of
the blocks or only the final layer on the reused image tokens. That choice is the host's, made between two
amounts of work, so one graph of the whole step cannot hold it. `SplitGraphs` records, in one forward under
capture, three graphs of one input signature:

- `probe`: the step's head (embeddings, modulation, any ControlNet) and the probe blocks, ending with the
  probe's input and output image tokens;
- `reuse`: the forward's finish (the final layer) on a static buffer of image tokens, which the cache fills
  with the probe's output plus its cached (or forecast) remainder;
- `rest`: every other block and the finish, ending with the image tokens the cache keeps.

A replay runs `probe`, hands its tokens to the branch's `BranchCache` (the same decision and bookkeeping as an
eager call, a few element-wise kernels on the static tensors), then `rest` or `reuse`. The kernels are the
eager call's, so the result is bit-identical to the eager cached call. As with `GraphedDenoiser`, the first call
of a signature runs eagerly, the second records and replays, later ones replay; the output is a static buffer,
valid until the next call.

The three graphs read each other's tensors where they lie: the probe's outputs (its image and text streams,
the modulation, the RoPE tables) are freed by Python once the recording forward returns, so each signature
records into a memory pool of its own that no other graph allocates from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from flux_runtime.kernels import fused_ops_report
from flux_runtime.kernels.attention_backends import attention_record
from flux_runtime.pipeline.graphs import CudaCapture, GraphedDenoiser
from flux_runtime.sampling.step_cache import BranchCache

log = logging.getLogger(__name__)

PARTS = ("probe", "reuse", "rest")


@dataclass
class Split:
    """One signature's three graphs and the static tensors they read and write."""

    graphs: dict[str, Any]
    inputs: list[Tensor | None]  # the call's inputs, copied in before each replay
    probe_in: Tensor  # the probe's image tokens in and out (the cache's decision reads them)
    probe_out: Tensor
    tokens: Tensor  # what `reuse` finishes: filled by the cache on a reused step
    reuse_out: Tensor
    rest_tokens: Tensor  # the image tokens after the last block (the cache keeps their remainder)
    rest_out: Tensor


class CaptureHook:
    """The transformer's step hook while a forward is recorded: at the probe it closes the `probe` graph,
    records `reuse` (the finish on a static token buffer) and opens `rest`, into which the forward runs on."""

    def __init__(self, capture: CudaCapture, probe_blocks: int, graphs: dict[str, Any], pool: Any) -> None:
        self.capture, self.graphs, self.pool = capture, graphs, pool
        self._probe_blocks = probe_blocks
        self.open: str | None = None  # the graph being recorded
        self.tensors: dict[str, Tensor] = {}

    @property
    def probe_blocks(self) -> int:
        return self._probe_blocks

    def switch(self, name: str | None) -> None:
        """End the graph being recorded (if any) and begin `name` (None: none)."""
        if self.open is not None:
            self.capture.end(self.graphs[self.open])
        self.open = name
        if name is not None:
            self.capture.begin(self.graphs[name], self.pool)

    def at_probe(self, probe_in: Tensor, probe_out: Tensor, finish: Callable[[Tensor], Tensor]) -> None:
        tokens = torch.empty_like(probe_out)
        self.tensors.update(probe_in=probe_in, probe_out=probe_out, tokens=tokens)
        self.switch("reuse")
        self.tensors["reuse_out"] = finish(tokens)
        self.switch("rest")
        return None  # the forward runs on: the rest of the blocks, recorded into `rest`

    def after_rest(self, out: Tensor) -> None:
        self.tensors["rest_tokens"] = out


class SplitGraphs:
    """`fn(*inputs)`, the velocity of one sampling branch on `transformer`, under a step cache: eager on the first
    use of a signature, recorded as `probe` / `reuse` / `rest` on the second, replayed after."""

    def __init__(
        self, fn: Callable[..., Tensor], transformer: Any, capture: CudaCapture | None = None
    ) -> None:
        self.fn, self.transformer = fn, transformer
        self.capture = capture or CudaCapture()
        self.seen: set[tuple] = set()
        self.splits: dict[tuple, Split] = {}
        # replays run no Python: what the eager or recording call ran, as `GraphedDenoiser` keeps it
        self.tier_used: str | None = None
        self.attention: dict[str, str] = {}
        self.replays = {"rest": 0, "reuse": 0}  # how each replayed step ended (for tests and benches)

    def __call__(self, cache: BranchCache, *xs: Any) -> Tensor:
        leaves, spec = pytree.tree_flatten(xs)
        key = (cache.probe_blocks, GraphedDenoiser.signature(leaves, spec))
        split = self.splits.get(key)
        if split is None:
            if key not in self.seen:
                self.seen.add(key)
                out = self._hooked(cache, xs)
                self.tier_used, self.attention = fused_ops_report().tier_used, attention_record()
                return out
            split = self.splits[key] = self._record(cache.probe_blocks, leaves, spec)
            self.tier_used, self.attention = fused_ops_report().tier_used, attention_record()
        for buf, x in zip(split.inputs, leaves, strict=True):
            if buf is not None:
                buf.copy_(x)
        split.graphs["probe"].replay()
        tokens = cache.before_rest(split.probe_in, split.probe_out)
        if tokens is None:
            split.graphs["rest"].replay()
            cache.after_rest(split.rest_tokens)
            self.replays["rest"] += 1
            return split.rest_out
        split.tokens.copy_(tokens)
        split.graphs["reuse"].replay()
        self.replays["reuse"] += 1
        return split.reuse_out

    def _hooked(self, hook: Any, xs: tuple) -> Tensor:
        self.transformer.step_hook = hook
        try:
            return self.fn(*xs)
        finally:
            self.transformer.step_hook = None

    def _record(self, probe_blocks: int, leaves: list[Any], spec: pytree.TreeSpec) -> Split:
        log.info(
            "recording the CUDA graphs of a step-cached denoiser for %s",
            [None if x is None else tuple(x.shape) for x in leaves],
        )
        capture = self.capture
        inputs = [None if x is None else x.clone() for x in leaves]
        graphs = {name: capture.graph() for name in PARTS}
        hook = CaptureHook(capture, probe_blocks, graphs, capture.pool())
        with capture.stream():
            hook.switch("probe")
            try:
                out = self._hooked(hook, pytree.tree_unflatten(inputs, spec))
            finally:
                hook.switch(None)
        if "rest_tokens" not in hook.tensors:
            raise RuntimeError(
                f"{type(self.transformer).__name__} never called its step hook: nothing to split"
            )
        t = hook.tensors
        return Split(
            graphs, inputs, t["probe_in"], t["probe_out"], t["tokens"], t["reuse_out"], t["rest_tokens"], out
        )
