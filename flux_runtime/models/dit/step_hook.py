"""The transformers' side of step caching: where a call may stop early and what it hands over.

A transformer with `step_hook` set runs its first `probe_blocks` blocks, then asks the hook
`at_probe(probe_in, probe_out, finish)` with the image tokens before and after them and `finish`, the rest of
its forward after the blocks (the final layer): a tensor back is the call's output (the hook ran `finish` on the
image tokens it chose, and the other blocks are skipped); None means run them and report the image tokens they
end with through `after_rest(out)`. Handing over `finish` lets a hook that records CUDA graphs cut one forward
into the probe, the skipped step's finish and the rest, each reading the others' tensors where they lie. The policies (what to skip, what to reuse) live in
`flux_runtime.sampling.step_cache`; nothing here decides anything. Without a hook (the default) a forward is
exactly what it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor


class StepHook(Protocol):
    """One sampling branch's step cache, as the transformer sees it."""

    @property
    def probe_blocks(self) -> int: ...

    def at_probe(
        self, probe_in: Tensor, probe_out: Tensor, finish: Callable[[Tensor], Tensor]
    ) -> Tensor | None: ...

    def after_rest(self, out: Tensor) -> None: ...
