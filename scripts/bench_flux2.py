#!/usr/bin/env python3
"""FLUX.2 transformer speed and parity on one GPU, against diffusers and the library floor in one run.

For each model (`--models`, default `dev klein-4b`): build the full-size `Flux2Transformer2DModel` in
diffusers with random weights directly on the GPU in bf16 (QK-norm weights perturbed too), hand its
tensors to our `Flux2Transformer` through weights/flux2_layout.py, run one bf16 step at 1024² (4096 image +
512 text tokens) through both and require `torch.equal`, then print per-step ms for the library floor
(the step's GEMMs and SDPA calls timed alone), diffusers eager and ours eager, with reference ops and, where
the checkout has `kernels/dispatch.py`, with the lossless fused kernels (median of >= 10 after warm-up).

Memory: the layout's renames hand over the very tensors diffusers holds, so both models share one copy of
the weights; only the fused double-block `qkv` and the swapped final adaLN are new tensors (FLUX.2 [dev]:
64.4 GB of weights + 3.6 GB). Models are freed before the next one is built. Modelled on `bench_dit` in
bench.py (the timing, floor and table helpers are benchlib.py's). Exit status 1 if any step differs. Writes every number to --json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (  # scripts/benchlib.py, beside this file
    FLUX2_MODELS,
    diffusers_fn,
    finish_run,
    flux2_library_floor,
    flux2_pair,
    flux2_step_inputs,
    free_cuda,
    parity_then_time,
    print_step_table,
    require_cuda,
)

RESULTS: dict[str, object] = {}


@torch.no_grad()
def _step_at(ours, tier, img, img_ids, txt, txt_ids, t, g, pe):
    from flux_runtime.kernels.dispatch import use_fused

    with use_fused(tier):
        return ours(img, img_ids, txt, txt_ids, t, g, pe=pe)


@torch.no_grad()
def bench_model(name: str, iters: int) -> bool:
    cfg, diffusers_kw = FLUX2_MODELS[name]
    res: dict[str, object] = {}
    RESULTS[name] = res
    gemm_ms, attn_ms = flux2_library_floor(cfg)
    floor = gemm_ms + attn_ms
    res["floor_ms"] = {"gemm": gemm_ms, "attention": attn_ms, "total": floor}
    print(
        f"[{name}] library floor: {floor:.1f} ms/step (GEMMs {gemm_ms:.1f}, attention {attn_ms:.1f})",
        flush=True,
    )

    t0 = time.perf_counter()
    ref, ours = flux2_pair(cfg, diffusers_kw)
    n_params = sum(p.numel() for p in ours.parameters())
    res["params"] = n_params
    res["weights_gib_resident"] = torch.cuda.memory_allocated() / 2**30
    print(
        f"[{name}] built FLUX.2-{name} ({n_params / 1e9:.2f} B params, {res['weights_gib_resident']:.1f} GiB "
        f"resident for both models) in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    img, img_ids, txt, txt_ids, t, g = flux2_step_inputs(cfg)
    diffusers_step = diffusers_fn(ref, txt, img_ids, txt_ids, guidance=g)

    def run_ref():
        return diffusers_step(img, t)

    pe = ours.rope(txt_ids, img_ids)

    def tiered(tier: str | None):
        """Our step with the kernel ops at `tier` (None: no dispatch module yet, references only)."""

        def run():
            if tier is None:
                return ours(img, img_ids, txt, txt_ids, t, g, pe=pe)
            with use_fused(tier):
                return ours(img, img_ids, txt, txt_ids, t, g, pe=pe)

        return run

    try:  # the fused-kernel dispatcher, where this checkout has it
        from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
    except ImportError:
        variants = {"ours eager (reference ops)": tiered(None)}
    else:
        from flux_runtime.pipeline.graphs import GraphedDenoiser

        variants = {
            "ours eager, reference ops": tiered("off"),
            "ours eager, lossless fused kernels": tiered("lossless"),
        }
        for tier in ("lossless", "high"):
            graphed = GraphedDenoiser(
                lambda x, tt, gg, tier=tier: _step_at(ours, tier, x, img_ids, txt, txt_ids, tt, gg, pe)
            )
            variants[f"ours {tier} + CUDA graph"] = lambda graphed=graphed: graphed(img, t, g)
        reset_fused_ops_report()

    expected = run_ref()
    peaks: dict[str, float] = {}

    def report(label: str, same: bool, diff: str) -> None:
        print(
            f"[{name}] one bf16 step at 1024², {label} vs diffusers: torch.equal = {same}{diff}", flush=True
        )

    times, equal = parity_then_time({"diffusers eager": run_ref, **variants}, expected, iters, report, peaks)
    if "ours eager, lossless fused kernels" in variants:
        print(fused_ops_report(), flush=True)
    res["step_ms"], res["equal_to_diffusers"], res["peak_gib_incl_weights"] = times, equal, peaks

    print_step_table(f"FLUX.2-{name}, 1024², bf16, B=1, per step", floor, times, equal)
    print(
        "peak allocated while stepping (shared weights included): "
        + ", ".join(f"{label} {gib:.1f} GiB" for label, gib in peaks.items())
    )
    print(flush=True)

    return all(v for k, v in equal.items() if "high" not in k)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(FLUX2_MODELS), default=["dev", "klein-4b"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not require_cuda("bench_flux2.py"):
        return 2
    t0 = time.perf_counter()
    equal = []
    for name in args.models:
        equal.append(bench_model(name, args.iters))
        free_cuda()  # the models died with bench_model's frame; hand their memory back before the next
    finish_run(RESULTS, t0, args.json)
    if not all(equal):
        failed = [n for n, ok in zip(args.models, equal, strict=True) if not ok]
        print(
            f"PARITY FAILED for {', '.join(failed)}: ours is not bit-identical to diffusers", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
