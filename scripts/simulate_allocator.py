#!/usr/bin/env python3
"""A FLUX.1-dev `stream`-plan call replayed through a model of PyTorch's CUDA caching allocator, on a CPU.

The allocations are the real ones, in order, counted on the meta device (`memory_trace.LiveBytes`): the
text stage (T5-XXL and CLIP-L units, one device buffer each, then T5's encode), the transformer stage (its
resident units and the ring's slots as the plan places them, `--steps` forwards at 1024², the VAE decode).
They are replayed through `CachingAllocator`, a model of the allocator's default rules (PyTorch 2.x,
`PYTORCH_CUDA_ALLOC_CONF` unset): sizes rounded to 512 bytes; requests up to 1 MiB from 2 MiB segments,
up to 10 MiB from 20 MiB segments, larger ones from their own segment rounded to 2 MiB; a request takes
the smallest free block that holds it, split when more than 1 MiB is left; a freed block merges with its
free neighbours; past the cap (`set_per_process_memory_fraction`) every wholly free segment is released
and the request retried, and only then is it an out-of-memory. Streams, events and the CUDA context are
not modelled.

It prints, per budget, the peak reserved and allocated bytes with and without the segments handed back
when the text encoder leaves (`torch.cuda.empty_cache()` in `ModelPlacement`), and whether each run stays
under the cap: the model's answer to why the stream plan ran out of memory at 24 and 16 GB.

    python scripts/simulate_allocator.py --steps 2
"""

from __future__ import annotations

import argparse
import sys
from bisect import insort
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.models.dit.config import FLUX1_DEV
from flux_runtime.models.vae.flux1 import FLUX1_VAE, Flux1VAE
from flux_runtime.pipeline import memory
from flux_runtime.pipeline.memory import WORKSPACE, Footprint, GiB, plan_memory
from flux_runtime.pipeline.memory_trace import (
    META,
    clip_l_config,
    decode_peak,
    dit_model,
    dit_peak,
    encoder_peak,
    t5_xxl_config,
)
from flux_runtime.pipeline.placement import decode_bytes, denoise_bytes, encode_bytes
from flux_runtime.pipeline.streaming import part_of

MiB = 1 << 20
BF = torch.bfloat16


class OutOfMemory(Exception):
    pass


class CachingAllocator:
    """The default rules of PyTorch's CUDA caching allocator (see the module docstring), one stream."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.segments: dict[int, list[list[int]]] = {}  # id -> blocks [offset, size, used]
        self.free: dict[bool, list[tuple[int, int, int]]] = {
            True: [],
            False: [],
        }  # small? -> (size, seg, off)
        self.where: dict[object, tuple[int, int]] = {}  # allocation key -> (segment, offset)
        self.small: dict[int, bool] = {}  # segment -> from the small pool
        self.next_segment = 0

    @staticmethod
    def _round(n: int) -> int:
        return max(512, (n + 511) // 512 * 512)

    def malloc(self, key: object, nbytes: int) -> None:
        size = self._round(nbytes)
        small = size <= MiB
        found = self._best_fit(small, size)
        if found is None:
            seg_size = (
                2 * MiB
                if small
                else 20 * MiB
                if size < 10 * MiB
                else (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)
            )
            if self.reserved + seg_size > self.cap:
                self.empty_cache()
                if self.reserved + seg_size > self.cap:
                    raise OutOfMemory(
                        f"{size / MiB:.0f} MiB with {self.allocated / GiB:.2f} GiB allocated, {self.reserved / GiB:.2f} reserved"
                    )
            seg = self.next_segment
            self.next_segment += 1
            self.segments[seg] = [[0, seg_size, 0]]
            self.small[seg] = small
            self.reserved += seg_size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            insort(self.free[small], (seg_size, seg, 0))
            found = self._best_fit(small, size)
            assert found is not None
        seg, off = found
        blocks = self.segments[seg]
        i = next(j for j, b in enumerate(blocks) if b[0] == off)
        block = blocks[i]
        self.free[small].remove((block[1], seg, off))
        rest = block[1] - size
        if rest > (512 if small else MiB):
            blocks.insert(i + 1, [off + size, rest, 0])
            insort(self.free[small], (rest, seg, off + size))
            block[1] = size
        block[2] = 1
        self.where[key] = (seg, off)
        self.allocated += block[1]
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _best_fit(self, small: bool, size: int) -> tuple[int, int] | None:
        pool = self.free[small]
        lo, hi = 0, len(pool)
        while lo < hi:  # the first free block of at least `size`
            mid = (lo + hi) // 2
            if pool[mid][0] < size:
                lo = mid + 1
            else:
                hi = mid
        return None if lo == len(pool) else (pool[lo][1], pool[lo][2])

    def release(self, key: object) -> None:
        seg, off = self.where.pop(key)
        blocks = self.segments[seg]
        small = self.small[seg]
        i = next(j for j, b in enumerate(blocks) if b[0] == off)
        self.allocated -= blocks[i][1]
        blocks[i][2] = 0
        for j in (i + 1, i - 1):  # merge with free neighbours
            if 0 <= j < len(blocks) and not blocks[j][2]:
                a, b = sorted((i, j))
                self.free[small].remove((blocks[j][1], seg, blocks[j][0]))
                blocks[a][1] += blocks[b][1]
                del blocks[b]
                i = a
        insort(self.free[small], (blocks[i][1], seg, blocks[i][0]))

    def empty_cache(self) -> None:
        for seg, blocks in list(self.segments.items()):
            if len(blocks) == 1 and not blocks[0][2]:
                small = self.small.pop(seg)
                self.free[small].remove((blocks[0][1], seg, 0))
                self.reserved -= blocks[0][1]
                del self.segments[seg]


def replay(alloc: CachingAllocator, events: list[tuple[int, int, int]], tag: str) -> None:
    for sign, key, size in events:
        if sign > 0:
            alloc.malloc((tag, key), size)
        else:
            alloc.release((tag, key))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budgets", type=int, nargs="+", default=[24, 16])
    args = ap.parse_args()
    from transformers import CLIPTextModel, T5EncoderModel

    dit = dit_model(FLUX1_DEV)
    with META:
        t5 = T5EncoderModel(t5_xxl_config()).to(BF).eval()
        clip = CLIPTextModel(clip_l_config()).to(BF).eval()
        vae = Flux1VAE(FLUX1_VAE).to(BF).eval()
    text = part_of([clip, t5], list(t5.encoder.block))
    fp = Footprint(
        text=text, dit=part_of([dit], [*dit.double_blocks, *dit.single_blocks]), vae=part_of([vae], []).rest,
        act_encode=encode_bytes([clip, t5], 512, 1),
        act_denoise=denoise_bytes(FLUX1_DEV, BF, 1024, 1024, 512, 1, cfg=False),
        act_decode=decode_bytes(FLUX1_VAE, BF, 1024, 1024, 1, tiled=False),
        act_decode_tiled=decode_bytes(FLUX1_VAE, BF, 1024, 1024, 1, tiled=True), workspace=WORKSPACE,
    )  # fmt: skip
    encode = [*encoder_peak(clip, 1, 77, record=True).events, *encoder_peak(t5, 1, 512, record=True).events]
    forward = dit_peak(dit, 1, record=True).events
    decode = decode_peak(vae, 1, record=True).events
    print(
        "| budget | plan (planner's est. peak) | handing segments back | peak allocated | peak reserved | fits |"
    )
    print("|---|---|---|---|---|---|")
    old = replace(fp, workspace=0)  # the planner before: 4% headroom, no workspace
    for budget in args.budgets:
        for planner, hand_back in (("before", False), ("before", True), ("now", False), ("now", True)):
            if planner == "before":
                memory.HEADROOM, saved = 0.04, memory.HEADROOM
                plan = plan_memory(old, budget * GiB)
                memory.HEADROOM = saved
            else:
                plan = plan_memory(fp, budget * GiB)
            streamed = set(plan.streamed_dit)
            alloc = CachingAllocator(budget * GiB)
            alloc.malloc("vae", fp.vae)
            result = "yes"
            try:
                units = [("text", i, s) for i, s in enumerate((text.rest, *text.layers))]
                for u in units:
                    alloc.malloc(u, u[2])
                replay(alloc, encode, "encode")
                alloc.malloc("embeddings", 512 * 4096 * 2)  # the encode's outputs, kept for the DiT
                alloc.malloc("pooled", 768 * 2)
                for u in units:
                    alloc.release(u)
                if hand_back:
                    alloc.empty_cache()
                alloc.malloc(("dit", "rest"), fp.dit.rest)
                for i, size in enumerate(fp.dit.layers):
                    if i not in streamed:
                        alloc.malloc(("dit", i), size)
                slot = max(fp.dit.layers[i] for i in streamed)
                for k in range(min(plan.slots, len(streamed))):
                    alloc.malloc(("slot", k), slot)
                for step in range(args.steps):
                    replay(alloc, forward, f"step{step}")
                replay(alloc, decode, "decode")
            except OutOfMemory as e:
                result = f"no: out of memory at {e}"
            print(
                f"| {budget} GB | {planner}: {plan.name}, {len(streamed)} of {len(fp.dit.layers)} blocks streamed "
                f"({plan.peak / GiB:.1f} GiB) | {'yes' if hand_back else 'no'} | {alloc.peak_allocated / GiB:.2f} GiB "
                f"| {alloc.peak_reserved / GiB:.2f} GiB | {result} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
