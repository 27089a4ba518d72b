"""The transformers' side of step caching: where a call may stop early and what it hands over.

A transformer with `step_hook` set runs its first `probe_blocks` blocks, then asks the hook
`before_rest(probe_in, probe_out)` with the image tokens before and after them: a tensor back means "use these
image tokens for the final layer and skip the other blocks"; None means run them and report the image tokens
they end with through `after_rest(out)`. The policies (what to skip, what to reuse) live in
`flux_runtime.sampling.step_cache`; nothing here decides anything. Without a hook (the default) a forward is
exactly what it was.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class StepHook(Protocol):
    """One sampling branch's step cache, as the transformer sees it."""

    @property
    def probe_blocks(self) -> int: ...

    def before_rest(self, probe_in: Tensor, probe_out: Tensor) -> Tensor | None: ...

    def after_rest(self, out: Tensor) -> None: ...
