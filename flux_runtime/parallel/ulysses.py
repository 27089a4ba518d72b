"""Ulysses sequence parallelism for the FLUX.1 and FLUX.2 transformers.

The joint sequence `[txt | img]` (text tokens, then image tokens, then any reference tokens) is cut into
one contiguous piece per rank. Every projection, norm, modulation, MLP, RoPE rotation and gated residual
is per token, so each rank runs them, fused kernels and deferred residuals included, on its own tokens
only: the double blocks on the rank's text rows and image rows (a rank may hold no text rows, or no image
rows, and runs those streams empty), the single blocks on its joint rows. Around each attention an
all-to-all trades the token shards of q, k and v for head shards: rank r then holds all L tokens of heads
`[r H/n, (r+1) H/n)`, in the global order (the pieces are contiguous), and attends them whole, exactly
as one process attends those heads; a second all-to-all trades the output back to token shards. The RoPE
tables are built once per generation for the whole sequence and each rank keeps its rows. The
velocity is all-gathered at the end of each forward, so every rank holds the full latents and runs the
same Euler step.

What this does to bits: attention sees the same q, k, v rows in the same order and computes each head
whole, and every elementwise op is per token; a GEMM over fewer rows may still round differently where
the BLAS picks a blocking by the row count (the tests measure it on the CPU; the bench on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from flux_runtime import kernels
from flux_runtime.models.dit.layers import RoPE, attention, sdpa, write_heads
from flux_runtime.parallel.group import Group, ParallelError, World, collective


def split_sizes(length: int, parts: int) -> tuple[int, ...]:
    """`length` items in `parts` contiguous pieces differing by at most one, the longer ones first."""
    q, r = divmod(length, parts)
    return tuple(q + (i < r) for i in range(parts))


@dataclass(frozen=True)
class Shards:
    """The joint sequence of `n_txt` text and `n_img` image tokens, cut into `size` contiguous pieces."""

    n_txt: int
    n_img: int
    size: int

    @property
    def lengths(self) -> tuple[int, ...]:
        return split_sizes(self.n_txt + self.n_img, self.size)

    def span(self, rank: int) -> tuple[int, int]:
        """Rank `rank`'s tokens [start, stop) of the joint sequence."""
        start = sum(self.lengths[:rank])
        return start, start + self.lengths[rank]

    def txt_span(self, rank: int) -> tuple[int, int]:
        """Its text tokens [start, stop) of the text stream (possibly empty)."""
        start, stop = self.span(rank)
        return min(start, self.n_txt), min(stop, self.n_txt)

    def img_span(self, rank: int) -> tuple[int, int]:
        """Its image tokens [start, stop) of the image stream (possibly empty)."""
        start, stop = self.span(rank)
        return max(start - self.n_txt, 0), max(stop - self.n_txt, 0)


def check_heads(heads: int, world_size: int) -> None:
    """Ulysses splits the heads evenly over the ranks that share a sequence: all of them, or (CFG) half."""
    if heads % world_size:
        raise ParallelError(
            f"the transformer has {heads} attention heads, which {world_size} ranks cannot share evenly "
            f"(sequence parallelism splits the heads); use a number of GPUs that divides {heads}"
        )


class SequenceParallel:
    """A FLUX transformer (FLUX.1 or FLUX.2) whose forward splits the tokens over the ranks of a group.

    Called as the model is (`model(img, img_ids, txt, txt_ids, ..., pe=...)`, full inputs, the same on
    every rank) and returns the full velocity on every rank. The group is the active plan's `seq` group
    (`World.running`); with one rank it is the plain model. Other attributes (`config`, `rope`, `img_in`,
    `conditioning`, ...) are the model's. Installs its attention in every block of `model`.
    """

    def __init__(self, model: Any, world: World) -> None:
        check_heads(model.config.num_heads, world.size)
        self.model, self.world = model, world
        for block in [*model.double_blocks, *model.single_blocks]:
            block.attend = self._attend
        self._layout: tuple[Group, Shards] | None = None
        self._pe: tuple[tuple, RoPE] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    @property
    def step_hook(self) -> Any:
        """The model's step cache hook (`models.dit.step_hook`): set on the model, which calls it on this rank's
        tokens."""
        return self.model.step_hook

    @step_hook.setter
    def step_hook(self, hook: Any) -> None:
        self.model.step_hook = hook

    def __call__(
        self, img: Tensor, img_ids: Tensor, txt: Tensor, txt_ids: Tensor, *args: Any, pe: RoPE | None = None,
        **kwargs: Any,
    ) -> Tensor:  # fmt: skip
        group = self.world.active.seq
        if group.size == 1:
            return self.model(img, img_ids, txt, txt_ids, *args, pe=pe, **kwargs)
        shards = Shards(txt.shape[1], img.shape[1], group.size)
        if pe is None:
            pe = self.model.rope(txt_ids, img_ids)
        (t0, t1), (i0, i1) = shards.txt_span(group.rank), shards.img_span(group.rank)
        self._layout = (group, shards)
        try:
            out = self.model(
                img[:, i0:i1].contiguous(), img_ids[..., i0:i1, :], txt[:, t0:t1].contiguous(),
                txt_ids[..., t0:t1, :], *args, pe=self._local_pe(pe, shards, group), **kwargs,
            )  # fmt: skip
        finally:
            self._layout = None
        return self._gather(out, shards, group)

    def _local_pe(self, pe: RoPE, shards: Shards, group: Group) -> RoPE:
        """This rank's rows of the RoPE tables, cut once per tables and layout (the tables live a generation)."""
        key = (pe[0].data_ptr(), tuple(pe[0].shape), shards, group.rank)
        if self._pe is None or self._pe[0] != key:
            start, stop = shards.span(group.rank)
            self._pe = (key, (pe[0][start:stop], pe[1][start:stop]))
        return self._pe[1]

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor | None = None,
        quant: kernels.Fp8Quant | None = None,
    ) -> Tensor:
        """Joint attention of this rank's tokens (B, L_r, H, D): all-to-all to (B, L, H/n, D), whole-head
        attention, all-to-all back; (B, L_r, H*D), into `out` as `layers.attention` writes it."""
        if self._layout is None:
            return attention(q, k, v, out, quant)
        group, shards = self._layout
        qkv = zip("qkv", (q, k, v), strict=True)
        o = sdpa(*(_to_heads(t, shards, group, kernels.is_head_major(role)) for role, t in qkv))
        return write_heads(_to_tokens(o, shards, group), out, quant)

    def _gather(self, out: Tensor, shards: Shards, group: Group) -> Tensor:
        """The full velocity (B, L_img, C) from each rank's image rows, on every rank."""
        lens = [b - a for a, b in (shards.img_span(r) for r in range(group.size))]
        longest = max(lens)
        buf = out.new_zeros(out.shape[0], longest, out.shape[2])
        buf[:, : out.shape[1]] = out
        parts = [buf.new_empty(buf.shape) for _ in lens]
        with collective(self.world.rank, "the velocity all-gather"):
            dist.all_gather(parts, buf, group=group.pg)
        return torch.cat([p[:, :n] for p, n in zip(parts, lens, strict=True)], dim=1)


def _to_heads(t: Tensor, shards: Shards, group: Group, head_major: bool) -> Tensor:
    """(B, L_r, H, D) token shard → (B, L, H/n, D): every token of this rank's heads, in the global order,
    stored head-major ((B, H/n, L, D) contiguous, what SDPA reads best) when `head_major`, else contiguous.

    `t` may be stored either way (`kernels.empty_heads`): splitting its heads is a view in both, and the send
    buffer is one copy as before. The received pieces are copied once either way, into the layout asked for.
    """
    n = group.size
    b, rows, h, d = t.shape
    # (n, L_r, B, H/n, D): piece j (the heads of rank j) is contiguous, tokens outermost
    send = t.reshape(b, rows, n, h // n, d).permute(2, 1, 0, 3, 4).contiguous()
    recv = t.new_empty(shards.n_txt + shards.n_img, b, h // n, d)
    with collective(dist.get_rank(), "the attention all-to-all"):
        dist.all_to_all_single(
            recv, send.view(n * rows, b, h // n, d), list(shards.lengths), [rows] * n, group=group.pg
        )
    # pieces arrive in rank order = the global token order; (B, L, H/n, D) stored as one process stores it
    if head_major:
        return recv.permute(1, 2, 0, 3).contiguous().permute(0, 2, 1, 3)
    return recv.permute(1, 0, 2, 3).contiguous()


def _to_tokens(o: Tensor, shards: Shards, group: Group) -> Tensor:
    """(B, L, H/n, D) head shard → (B, L_r, n, H/n, D): this rank's tokens with every head."""
    n = group.size
    b, _, hn, d = o.shape
    rows = shards.lengths[group.rank]
    send = o.permute(1, 0, 2, 3).contiguous()  # (L, B, H/n, D): piece j = the tokens of rank j
    recv = o.new_empty(n * rows, b, hn, d)
    with collective(dist.get_rank(), "the attention all-to-all"):
        dist.all_to_all_single(recv, send, [rows] * n, list(shards.lengths), group=group.pg)
    return recv.view(n, rows, b, hn, d).permute(2, 1, 0, 3, 4)
