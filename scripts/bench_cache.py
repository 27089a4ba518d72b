#!/usr/bin/env python3
"""Step caching at full size on the GPU: what a cache costs when it skips nothing, and what skipping buys.

Device only. Opens a full-size FLUX.1 [dev] folder (random weights: `bench_cold_start.py build ROOT` writes
one) and times 28-step 1024² calls, the denoising loop alone (from the pipeline's progress reports, the GPU
synchronized at its start and end) and the whole call:

- eager and with CUDA graphs (where a cached call replays its probe's graph, then the rest's or the reuse's):
- no cache;
- `first-block:threshold=0`: the probe, the decision and the bookkeeping on every step, nothing skipped (the
  overhead), and its latents against the uncached ones (`torch.equal`);
- forced skip patterns computing 75 % and 50 % of the steps (random weights show no real redundancy, so the
  pattern is imposed: a policy that reuses on fixed steps), whose loop time should scale with the computed
  fraction, the graphed latents against the eager cached ones (`torch.equal`);
- the same with the transformer in FP8 and `quality="high"`.

Usage: python3 scripts/bench_cache.py /tmp/cold/flux1-dev [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from flux_runtime.pipeline import Pipeline
from flux_runtime.sampling.step_cache import BranchCache, FirstBlockCache

STEPS = 28
PROMPT = "a red fox in the snow, golden hour, photograph"


@dataclass(frozen=True)
class Skips(FirstBlockCache):
    """Reuse on exactly the steps in `skip`."""

    name: ClassVar[str] = "skips"
    skip: tuple[int, ...] = ()

    def reuse(self, cache: BranchCache, probe_residual: torch.Tensor) -> bool:
        return cache.step in self.skip


def pattern(computed: float) -> Skips:
    """A pattern that computes about `computed` of the steps: warm-up and last steps, then evenly spread."""
    middle = list(range(1, STEPS - 1))
    keep = round(computed * STEPS) - 2
    kept = (
        {middle[round(k * (len(middle) - 1) / max(keep - 1, 1))] for k in range(keep)} if keep > 0 else set()
    )
    return Skips(skip=tuple(i for i in middle if i not in kept))


def timed(pipe: Pipeline, cache: object) -> tuple[dict, torch.Tensor]:
    marks: dict[tuple[str, int], float] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "denoise" and done in (0, total):
            torch.cuda.synchronize()
            marks[(stage, done)] = time.perf_counter()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = pipe(PROMPT, height=1024, width=1024, num_steps=STEPS, seed=0, cache=cache, progress=progress,
               output_type="latent")  # fmt: skip
    torch.cuda.synchronize()
    record = out.info["cache"]
    computed = len(record["computed_steps"]) if isinstance(record, dict) else STEPS
    loop = marks[("denoise", STEPS)] - marks[("denoise", 0)]
    row = {"loop_s": round(loop, 4), "call_s": round(time.perf_counter() - t0, 4), "computed": computed,
           "ms_per_step": round(1000 * loop / STEPS, 2)}  # fmt: skip
    return row, out.latents


def run(folder: Path, fp8: bool, quality: str) -> dict:
    """Eager and under CUDA graphs (a cached call's split at the probe): no cache, nothing skipped, and two forced
    patterns; each against the uncached loop of the same mode, the graphed cached latents against the eager."""
    results: dict = {}
    eager_latents: dict[str, torch.Tensor] = {}
    for graphs in (False, True):
        mode = "CUDA graphs" if graphs else "eager"
        pipe = Pipeline.from_pretrained(folder, device="cuda", fp8=fp8, quality=quality, cuda_graphs=graphs)
        timed(pipe, "off")  # warm: kernels, graphs, the prompt's encoding
        base, want = timed(pipe, "off")
        results[f"no cache, {mode}"] = base
        print(f"{'fp8' if fp8 else 'bf16'} {quality}, no cache, {mode}: {json.dumps(base)}", flush=True)
        cases = [("first-block:threshold=0", "first-block:threshold=0 (nothing skipped)")]
        cases += [(pattern(frac), f"forced {frac:.0%}") for frac in (0.75, 0.5)]
        cases += [("first-block", "first-block at its default")]  # the image time users get (random weights)
        for policy, label in cases:
            timed(pipe, policy)  # warm: a cached call's own graphs
            row, got = timed(pipe, policy)
            if label.startswith("first-block:threshold=0"):
                row["equal to no cache"] = bool(torch.equal(got, want))
                row["overhead"] = round(row["loop_s"] / base["loop_s"] - 1, 4)
            else:
                row["loop / uncached"] = round(row["loop_s"] / base["loop_s"], 3)
                row["computed fraction"] = round(row["computed"] / STEPS, 3)
            if graphs:
                row["equal to eager cached"] = bool(torch.equal(got, eager_latents[label]))
            else:
                eager_latents[label] = got
            name = f"{label}, {mode}: {row['computed']} of {STEPS} steps computed"
            results[name] = row
            print(f"{'fp8' if fp8 else 'bf16'} {quality}, {name}: {json.dumps(row)}", flush=True)
        del pipe
        torch.cuda.empty_cache()
    return results


def host_ms_per_step(pipe: Pipeline, cache: object) -> float:
    """The host's time to issue one eager denoising step, the GPU held back meanwhile: a long `torch.cuda._sleep`
    is queued after the first step (whose set-up, the modulation table and the fixed conditioning, may read from
    the GPU), so the second step's launches are timed without waiting on the GPU (at or above the GPU's own step
    time, an eager loop is bound by the host). A policy whose decision reads the GPU would wait out the sleep."""
    marks: list[float] = []

    def progress(stage: str, done: int, total: int) -> None:
        if stage != "denoise" or done not in (1, 2):
            return
        if done == 1:
            torch.cuda.synchronize()
            torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU clock cycles: longer than one step's launches
        marks.append(time.perf_counter())

    pipe(PROMPT, height=1024, width=1024, num_steps=STEPS, seed=0, cache=cache, progress=progress,
         output_type="latent")  # fmt: skip
    torch.cuda.synchronize()
    return round(1000 * (marks[1] - marks[0]), 2)


def diagnose(folder: Path, rounds: int) -> dict:
    """FP8 `high`, eager: the rows of `run` interleaved over `rounds` rounds (is a gap a cache's cost or the
    loop's noise?), and the host's time to issue one step, uncached and cached, against the GPU's step."""
    pipe = Pipeline.from_pretrained(folder, device="cuda", fp8=True, quality="high", cuda_graphs=False)
    cases: list[tuple[object, str]] = [("off", "no cache"), ("first-block:threshold=0", "nothing skipped")]
    cases += [(pattern(0.5), "forced 50%"), ("first-block", "first-block at its default")]
    for policy, _ in cases:
        timed(pipe, policy)  # warm
    rows: dict[str, list[float]] = {label: [] for _, label in cases}
    for _ in range(rounds):
        for policy, label in cases:
            rows[label].append(timed(pipe, policy)[0]["ms_per_step"])
    host = {label: host_ms_per_step(pipe, policy) for policy, label in cases[:2]}
    del pipe
    torch.cuda.empty_cache()
    pipe = Pipeline.from_pretrained(folder, device="cuda", fp8=True, quality="high", cuda_graphs=True)
    timed(pipe, "off")  # warm: the capture
    graphed = timed(pipe, "off")[0]["ms_per_step"]  # the GPU's step, no host in the way
    out = {"ms_per_step by round": rows, "host ms to issue a step": host, "graphed ms_per_step": graphed}
    for label, ms in rows.items():
        print(f"fp8 high eager, {label}: ms/step by round {ms}", flush=True)
    print(f"fp8 high eager, host ms to issue one step: {host}; the graphed step {graphed} ms", flush=True)
    del pipe
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--diagnose", type=int, default=0, metavar="ROUNDS",
        help="instead: FP8 high's eager rows interleaved over ROUNDS rounds, and the host's time to issue a step",
    )  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_cache.py needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.diagnose:
        report = {"fp8 high eager": diagnose(args.folder, args.diagnose)}
    else:
        report = {
            "bf16 lossless": run(args.folder, False, "lossless"),
            "fp8 high": run(args.folder, True, "high"),
        }
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
