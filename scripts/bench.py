#!/usr/bin/env python3
"""FLUX speed and parity on one GPU, measured against diffusers and the library floor in one run.

Sections (pick with flags; default: all that exist):
  --dit       full-size FLUX.1-dev, random weights, one bf16 step at 1024²: torch.equal with diffusers,
              per-step ms for the library floor, diffusers eager and ours (median of >= 10 after warm-up).
  --variants  a FLUX.1 Kontext step (8192 image + reference tokens) and a Fill step (384 input channels)
              at 1024², ours lossless (eager and + CUDA graph) vs diffusers, torch.equal.
  --fp8       the FP8 bench (bench_fp8.py): FLUX.1-dev, klein-4B, FLUX.2-dev quantized at load, against
              our bf16 step, diffusers' and the FP8 floor; with --profile, each FP8 step's kernel table.
  --flux2     the FLUX.2 bench (bench_flux2.py).
Writes a JSON of every number to --json. Never a test: run it on the device, quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (  # scripts/benchlib.py, beside this file
    DEV,
    cuda_time,
    diffusers_fn,
    flux1_library_floor,
    flux1_pair,
    flux1_step_inputs,
    max_abs_diff,
    print_step_table,
    profile_step,
    require_cuda,
)

RESULTS: dict[str, object] = {}


@torch.no_grad()
def bench_dit(ref, ours, iters: int, profile: bool) -> None:
    from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
    from flux_runtime.pipeline.graphs import GraphedDenoiser

    gemm_ms, attn_ms = flux1_library_floor()
    floor = gemm_ms + attn_ms
    RESULTS["floor_ms"] = {"gemm": gemm_ms, "attention": attn_ms, "total": floor}
    print(f"library floor: {floor:.1f} ms/step (GEMMs {gemm_ms:.1f}, attention {attn_ms:.1f})", flush=True)
    img, img_ids, txt, txt_ids, t, y, g = flux1_step_inputs()
    diffusers_step = diffusers_fn(ref, txt, img_ids, txt_ids, pooled_projections=y, guidance=g)

    def run_ref():
        return diffusers_step(img, t)

    pe = ours.rope(txt_ids, img_ids)

    # high tier: the adaLN projections of a 50-step generation in one batched GEMM each (the pipeline does this
    # once per image), this step's row passed in; lossless projects them live every step as diffusers does
    steps_t = torch.linspace(1.0, 0.02, 50, device=DEV)
    steps_t[0] = t[0].float()
    with torch.no_grad():
        table = ours.modulation_table(ours.conditioning(steps_t.to(t.dtype), y.expand(50, -1), g.expand(50)))
    high_mods = table[:1]

    def step(x, tt, gg, mods=None):
        return ours(x, img_ids, txt, txt_ids, tt, y, gg, pe=pe, mods=mods)

    def tiered(tier):
        def run(x=img, tt=t, gg=g):
            with use_fused(tier):
                return step(x, tt, gg, high_mods if tier == "high" else None)

        return run

    expected = run_ref()
    variants = {
        "ours eager, reference ops": tiered("off"),
        "ours eager, lossless fused kernels": tiered("lossless"),
        "ours lossless + CUDA graph": None,
        "ours eager, high tier": tiered("high"),
        "ours high + CUDA graph": None,
    }
    graphed = {
        "ours lossless + CUDA graph": GraphedDenoiser(lambda x, tt, gg: tiered("lossless")(x, tt, gg)),
        "ours high + CUDA graph": GraphedDenoiser(lambda x, tt, gg: tiered("high")(x, tt, gg)),
    }
    for name, gd in graphed.items():
        variants[name] = lambda gd=gd: gd(img, t, g)

    reset_fused_ops_report()
    times, equal = {}, {}
    ref_ms = cuda_time(run_ref, iters=iters)
    times["diffusers eager"] = ref_ms
    for name, fn in variants.items():
        out = fn()
        out = fn()  # graphs: the second call captures and replays
        equal[name] = torch.equal(out, expected)
        times[name] = cuda_time(fn, iters=iters)
        if not equal[name]:
            equal[name] = f"max abs diff {max_abs_diff(out, expected):.3g}"
    RESULTS["step_ms"] = times
    RESULTS["step_equal_to_diffusers"] = equal
    RESULTS["dit_equal"] = all(v is True for k, v in equal.items() if "high" not in k)
    print(fused_ops_report(), flush=True)

    # accuracy of lossless vs high against a float64 reference of the same step
    acc = step_error_vs_fp64(ours, expected, tiered, (img, img_ids, txt, txt_ids, t, y, g))
    RESULTS["error_vs_fp64"] = acc

    print_step_table("FLUX.1-dev, 1024², bf16, B=1, per step", floor, times, equal)
    print(f"relative L2 error vs float64: {acc}")

    if profile:
        profile_step(tiered("lossless"))


@torch.no_grad()
def bench_variant(name: str, ref, ours, inputs, iters: int) -> None:
    """One step of a FLUX.1 variant at 1024²: diffusers eager vs ours lossless (eager and + CUDA graph)."""
    from flux_runtime.kernels.dispatch import use_fused
    from flux_runtime.pipeline.graphs import GraphedDenoiser

    img, img_ids, txt, txt_ids, t, y, g = inputs
    diffusers_step = diffusers_fn(ref, txt, img_ids, txt_ids, pooled_projections=y, guidance=g)

    def run_ref():
        return diffusers_step(img, t)

    pe = ours.rope(txt_ids, img_ids)

    def lossless(x=img, tt=t, gg=g):
        with use_fused("lossless"):
            return ours(x, img_ids, txt, txt_ids, tt, y, gg, pe=pe)

    graphed = GraphedDenoiser(lambda x, tt, gg: lossless(x, tt, gg))
    expected = run_ref()
    row: dict[str, object] = {"tokens": img.shape[1] + txt.shape[1], "in_channels": img.shape[2]}
    row["diffusers_ms"] = cuda_time(run_ref, iters=iters)
    for label, fn in (("lossless", lossless), ("lossless_graph", lambda: graphed(img, t, g))):
        fn()
        out = fn()
        row[f"{label}_equal"] = bool(torch.equal(out, expected))
        row[f"{label}_ms"] = cuda_time(fn, iters=iters)
        row[f"{label}_vs_diffusers"] = row[f"{label}_ms"] / row["diffusers_ms"]
    RESULTS.setdefault("variants", {})[name] = row
    print(name, json.dumps(row, indent=1), flush=True)


def bench_variants(iters: int) -> bool:
    """Kontext (4096 image + 4096 reference tokens with index 1, 512 text) and Fill (384 input channels)."""
    ref, ours = flux1_pair()
    img, img_ids, txt, txt_ids, t, y, g = flux1_step_inputs()
    ref_ids = img_ids.clone()
    ref_ids[:, 0] = 1  # Kontext's reference tokens: the same grid at index 1
    kontext = (torch.cat([img, img.flip(1)], dim=1), torch.cat([img_ids, ref_ids]), txt, txt_ids, t, y, g)
    bench_variant("kontext", ref, ours, kontext, iters)
    del ref, ours
    torch.cuda.empty_cache()
    ref, ours = flux1_pair(in_channels=384)
    bench_variant("fill", ref, ours, flux1_step_inputs(channels=384), iters)
    rows = RESULTS["variants"].values()
    return all(r["lossless_equal"] and r["lossless_graph_equal"] for r in rows)


def step_error_vs_fp64(ours, expected, tiered, inputs) -> dict[str, float]:
    """‖out − ref64‖ / ‖ref64‖ for diffusers/lossless and high, ref64 = our model in float64 on the GPU."""
    import copy

    img, img_ids, txt, txt_ids, t, y, g = inputs
    m64 = copy.deepcopy(ours).to(torch.float64)
    cast = lambda x: x.to(torch.float64)  # noqa: E731
    with torch.no_grad():
        ref64 = m64(cast(img), img_ids, cast(txt), txt_ids, cast(t), cast(y), g.double(), pe=None)
    del m64
    torch.cuda.empty_cache()
    out = {}
    for name, result in (("lossless", expected), ("high", tiered("high")())):
        out[name] = ((result.double() - ref64).norm() / ref64.norm()).item()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dit", action="store_true", help="per-step parity and timings at full size")
    ap.add_argument("--pipeline", action="store_true", help="end-to-end 50-step generation vs FluxPipeline")
    ap.add_argument("--profile", action="store_true", help="kernel table of one lossless step")
    ap.add_argument("--variants", action="store_true", help="a Kontext step and a Fill step vs diffusers")
    ap.add_argument(
        "--flux2", action="store_true", help="FLUX.2-dev and klein-4B per step instead (runs bench_flux2.py)"
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="FLUX.1-dev, klein-4B and FLUX.2-dev in FP8 against bf16 and the FP8 floor (runs bench_fp8.py)",
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not require_cuda("bench.py"):
        return 2
    if args.fp8:
        import bench_fp8

        sys.argv = [
            sys.argv[0],
            *(["--json", str(args.json)] if args.json else []),
            *(["--profile"] if args.profile else []),
        ]
        return bench_fp8.main()
    if args.flux2:
        import bench_flux2

        sys.argv = [sys.argv[0], *(["--json", str(args.json)] if args.json else [])]
        return bench_flux2.main()
    if args.variants:
        try:
            return 0 if bench_variants(args.iters) else 1
        finally:
            if args.json:
                args.json.write_text(json.dumps(RESULTS, indent=2, default=str))
    run_all = not (args.dit or args.pipeline)
    t0 = time.perf_counter()
    ref, ours = flux1_pair()
    print(f"built both FLUX.1-dev transformers in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        if args.dit or run_all:
            bench_dit(ref, ours, args.iters, args.profile)
        if args.pipeline or run_all:
            from bench_pipeline import bench_pipeline

            bench_pipeline(ref, ours, args.steps, RESULTS)
    finally:
        if args.json:
            args.json.write_text(json.dumps(RESULTS, indent=2, default=str))
    ok = RESULTS.get("dit_equal", True) and RESULTS.get("pipeline_equal", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
