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

It prints, per budget, for the plan the planner chose before this change (4% headroom, no workspace) and
now, with and without the segments handed back when a model leaves (`torch.cuda.empty_cache()` in
`ModelPlacement`): the peak allocated bytes, the least cap under which the call still runs (found by
bisection: what the placement really needs, fragmentation included) and whether it runs under the budget.
The model's answer to why the stream plan ran out of memory at 24 and 16 GB.

    python scripts/simulate_allocator.py --model flux1      # FLUX.1-dev bf16 at 24 and 16 GB
    python scripts/simulate_allocator.py --model flux2      # FLUX.2-dev FP8 at 80, 48, 24 GB
"""

from __future__ import annotations

import argparse
import sys
from bisect import insort
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.models.dit.config import FLUX1_DEV, FLUX2_DEV
from flux_runtime.models.vae.flux1 import FLUX1_VAE, Flux1VAE
from flux_runtime.models.vae.flux2 import FLUX2_VAE, Flux2VAE
from flux_runtime.pipeline import memory
from flux_runtime.pipeline.memory import WORKSPACE, Footprint, GiB, Part, Plan, plan_memory
from flux_runtime.pipeline.memory_trace import (
    META,
    clip_l_config,
    decode_peak,
    dit_model,
    dit_peak,
    encoder_peak,
    mistral_small_config,
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


def _units(
    name: str, part: Part, mode: str, streamed: tuple[int, ...], slots: int
) -> list[tuple[object, int]]:
    """(key, bytes) of what a model's stage puts on the device: its own buffers, then the ring's slots."""
    out: list[tuple[object, int]] = [((name, "rest"), part.rest)]
    ring = set(streamed) if mode == "streamed" else set()
    out += [((name, i), size) for i, size in enumerate(part.layers) if i not in ring]
    if ring:
        slot = max(part.layers[i] for i in ring)
        out += [((name, "slot", k), slot) for k in range(min(slots, len(ring)))]
    return out


def simulate(
    fp: Footprint, plan: Plan, calls: dict[str, list], steps: int, hand_back: bool, cap: int, kept: int
) -> tuple[CachingAllocator, str]:
    """One call under `plan` (the transformer resident from before the call where the plan keeps it so),
    replayed; `kept` bytes of prompt embeddings survive the encode. Returns the allocator and the verdict."""
    alloc = CachingAllocator(cap)
    text = _units("text", fp.text, plan.text, plan.streamed_text, plan.slots)
    dit = _units("dit", fp.dit, plan.dit, plan.streamed_dit, plan.slots)
    try:
        alloc.malloc("vae", fp.vae)
        if plan.together:
            for key, size in dit:
                alloc.malloc(key, size)
        for key, size in text:
            alloc.malloc(key, size)
        replay(alloc, calls["encode"], "encode")
        alloc.malloc("embeddings", kept)
        if plan.text != "resident":
            for key, _ in text:
                alloc.release(key)
            if hand_back:
                alloc.empty_cache()
        if not plan.together:
            for key, size in dit:
                alloc.malloc(key, size)
        for step in range(steps):
            replay(alloc, calls["forward"], f"step{step}")
        replay(alloc, calls["decode"], "decode")
    except OutOfMemory as e:
        return alloc, f"no: out of memory at {e}"
    return alloc, "yes"


def flux1() -> tuple[Footprint, dict[str, list], int]:
    from transformers import CLIPTextModel, T5EncoderModel

    dit = dit_model(FLUX1_DEV)
    with META:
        t5 = T5EncoderModel(t5_xxl_config()).to(BF).eval()
        clip = CLIPTextModel(clip_l_config()).to(BF).eval()
        vae = Flux1VAE(FLUX1_VAE).to(BF).eval()
    fp = Footprint(
        text=part_of([clip, t5], list(t5.encoder.block)), dit=part_of([dit], [*dit.double_blocks, *dit.single_blocks]),
        vae=part_of([vae], []).rest, act_encode=encode_bytes([clip, t5], 512, 1),
        act_denoise=denoise_bytes(FLUX1_DEV, BF, 1024, 1024, 512, 1, cfg=False),
        act_decode=decode_bytes(FLUX1_VAE, BF, 1024, 1024, 1, tiled=False),
        act_decode_tiled=decode_bytes(FLUX1_VAE, BF, 1024, 1024, 1, tiled=True), workspace=WORKSPACE,
    )  # fmt: skip
    calls = {
        "encode": [
            *encoder_peak(clip, 1, 77, record=True).events,
            *encoder_peak(t5, 1, 512, record=True).events,
        ],
        "forward": dit_peak(dit, 1, record=True).events,
        "decode": decode_peak(vae, 1, record=True).events,
    }
    return fp, calls, 512 * 4096 * 2


def flux2() -> tuple[Footprint, dict[str, list], int]:
    """FLUX.2-dev with FP8 transformer and Mistral (reference quantization on meta: fp32 temporaries)."""
    from transformers import Mistral3ForConditionalGeneration

    import flux_runtime.text.fp8 as text_fp8

    dit = dit_model(FLUX2_DEV, fp8=True)
    with META:
        mistral = Mistral3ForConditionalGeneration(mistral_small_config()).to(BF).eval()
        vae = Flux2VAE(FLUX2_VAE).to(BF).eval()
    saved, text_fp8.check_fp8_gemm = text_fp8.check_fp8_gemm, lambda device: None  # meta runs no GEMM
    try:
        text_fp8.quantize_text_layers(text_fp8.decoder_layers(mistral), BF)
    finally:
        text_fp8.check_fp8_gemm = saved
    fp = Footprint(
        text=part_of([mistral], text_fp8.decoder_layers(mistral)),
        dit=part_of([dit], [*dit.double_blocks, *dit.single_blocks]), vae=part_of([vae], []).rest,
        act_encode=encode_bytes([mistral], 512, 1),
        act_denoise=denoise_bytes(FLUX2_DEV, BF, 1024, 1024, 512, 1, cfg=False),
        act_decode=decode_bytes(FLUX2_VAE, BF, 1024, 1024, 1, tiled=False),
        act_decode_tiled=decode_bytes(FLUX2_VAE, BF, 1024, 1024, 1, tiled=True), workspace=WORKSPACE,
    )  # fmt: skip
    calls = {
        "encode": encoder_peak(
            mistral, 1, 512, record=True, attention_mask=True, output_hidden_states=True, use_cache=False
        ).events,
        "forward": dit_peak(dit, 1, record=True).events,
        "decode": decode_peak(vae, 1, record=True).events,
    }
    return fp, calls, 512 * 15360 * 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["flux1", "flux2"], default="flux1")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budgets", type=int, nargs="+", default=None, help="GB (default: the bench's)")
    args = ap.parse_args()
    fp, calls, kept = flux1() if args.model == "flux1" else flux2()
    budgets = args.budgets or ([24, 16] if args.model == "flux1" else [80, 48, 24])
    print("| budget | planner: plan, streamed blocks (est. peak) | segments handed back | peak allocated | least cap that runs | fits the budget |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    old = replace(fp, workspace=0)  # the planner before: 4% headroom, no workspace
    for budget in budgets:
        for planner, hand_back in (("before", False), ("before", True), ("now", False), ("now", True)):
            if planner == "before":
                memory.HEADROOM, saved = 0.04, memory.HEADROOM
                plan = plan_memory(old, budget * GiB)
                memory.HEADROOM = saved
            else:
                plan = plan_memory(fp, budget * GiB)
            alloc, verdict = simulate(fp, plan, calls, args.steps, hand_back, budget * GiB, kept)
            lo, hi = alloc.peak_allocated, 2 * budget * GiB  # the least cap this placement runs under
            while hi - lo > 16 * MiB:
                mid = (lo + hi) // 2
                lo, hi = (
                    (lo, mid)
                    if simulate(fp, plan, calls, args.steps, hand_back, mid, kept)[1] == "yes"
                    else (mid, hi)
                )
            blocks = f"text {len(plan.streamed_text)}/{len(fp.text.layers)}, transformer {len(plan.streamed_dit)}/{len(fp.dit.layers)}"
            print(
                f"| {budget} GB | {planner}: {plan.name}, {blocks} ({plan.peak / GiB:.1f} GiB) | {'yes' if hand_back else 'no'} "
                f"| {alloc.peak_allocated / GiB:.2f} GiB | {hi / GiB:.2f} GiB | {verdict} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
