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
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.models.dit import FLUX1_DEV, Flux1Transformer
from flux_runtime.weights import flux1_layout

DEV = torch.device("cuda")
RESULTS: dict[str, object] = {}


def cuda_time(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median ms of `fn()` over `iters` runs after `warmup`, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def library_floor(cfg=FLUX1_DEV, n_img: int = 4096, n_txt: int = 512) -> tuple[float, float]:
    """Sum of the step's cuBLAS GEMMs (F.linear with bias, real shapes) and SDPA calls, each timed alone."""
    d, mlp, L = cfg.hidden_size, cfg.mlp_hidden_dim, n_img + n_txt
    gemms: Counter[tuple[int, int, int]] = Counter()
    for m in (n_img, n_txt):  # double blocks, per stream: q, k, v, out, mlp up, mlp down
        gemms[(m, d, d)] += 4 * cfg.depth
        gemms[(m, d, mlp)] += cfg.depth
        gemms[(m, mlp, d)] += cfg.depth
    gemms[(1, d, 6 * d)] += 2 * cfg.depth
    gemms[(L, d, d)] += 3 * cfg.depth_single_blocks
    gemms[(L, d, mlp)] += cfg.depth_single_blocks
    gemms[(L, d + mlp, d)] += cfg.depth_single_blocks
    gemms[(1, d, 3 * d)] += cfg.depth_single_blocks
    gemms[(n_img, cfg.in_channels, d)] += 1
    gemms[(n_txt, cfg.context_in_dim, d)] += 1
    gemms[(n_img, d, cfg.out_channels)] += 1
    gemms[(1, d, 2 * d)] += 1
    return gemm_floor_ms(gemms, bias=True), sdpa_floor_ms(cfg, [(L, cfg.depth + cfg.depth_single_blocks)])


def gemm_floor_ms(gemms: Counter[tuple[int, int, int]], bias: bool = False) -> float:
    """Summed ms of a step's GEMMs, `(M, K, N) -> calls`, each shape timed alone as a bf16 `F.linear`
    (with a bias when `bias`) on random operands, 20 timed runs."""
    total = 0.0
    for (m, k, n), count in gemms.items():
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
        if bias:
            b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
            total += count * cuda_time(lambda x=x, w=w, b=b: F.linear(x, w, b), iters=20)
        else:
            total += count * cuda_time(lambda x=x, w=w: F.linear(x, w), iters=20)
        del x, w
    return total


def sdpa_floor_ms(cfg, calls: list[tuple[int, int]]) -> float:
    """Summed ms of a step's SDPA calls, `(sequence length, calls)`, each length timed alone at `cfg`'s heads."""
    total = 0.0
    for length, count in calls:
        q, k, v = (
            torch.randn(1, cfg.num_heads, length, cfg.head_dim, device=DEV, dtype=torch.bfloat16)
            for _ in range(3)
        )
        total += count * cuda_time(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v), iters=20)
    return total


def share_weights(ref, cfg, layout, model_cls, flag: bool):
    """Our `model_cls(cfg)` on the very tensors of the diffusers model `ref`, renamed by `layout`'s rule table
    (`flag`: the table's third argument, guidance embedder or flow map); fused rules make new tensors."""
    sd = ref.state_dict()
    table = layout.rules(cfg.depth, cfg.depth_single_blocks, flag)
    ours_sd = {r.bfl: layout.diffusers_to_bfl(r, sd.__getitem__) for r in table}
    with torch.device("meta"):
        ours = model_cls(cfg)
    ours.load_state_dict(ours_sd, strict=True, assign=True)  # assign: share, do not copy
    return ours.eval()


def born_bf16(cls, **kw):
    """`cls(**kw)` in eval mode, drawn under `torch.manual_seed(0)` directly on the GPU in bf16 (a full-size
    model in fp32 would not fit beside anything)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            return cls(**kw).eval()
    finally:
        torch.set_default_dtype(default)


def parity_then_time(
    variants: dict, expected: torch.Tensor, iters: int, report, peaks: dict[str, float] | None = None
) -> tuple[dict[str, float], dict[str, bool]]:
    """For each `label -> fn`: run it twice (a CUDA graph captures on the second call), compare with
    `expected` (`torch.equal`), `report(label, equal, diff)` (`diff`: "" or " (max abs diff ...)"), then time
    it with `cuda_time`; with `peaks`, also the peak allocated GiB while timing. Returns (ms, equal)."""
    times: dict[str, float] = {}
    equal: dict[str, bool] = {}
    for label, fn in variants.items():
        out = fn()
        out = fn()  # graphs: the first call runs eagerly, the second captures and replays
        equal[label] = torch.equal(out, expected)
        diff = (
            ""
            if equal[label]
            else f" (max abs diff {(out.float() - expected.float()).abs().max().item():.3g})"
        )
        report(label, equal[label], diff)
        del out
        if peaks is not None:
            torch.cuda.reset_peak_memory_stats()
        times[label] = cuda_time(fn, iters=iters)
        if peaks is not None:
            peaks[label] = torch.cuda.max_memory_allocated() / 2**30
    return times, equal


def print_step_table(
    title: str,
    floor: float,
    times: dict[str, float],
    equal: dict,
    equal_header: str = "torch.equal diffusers",
) -> None:
    """The per-step markdown table: the library floor, then each timed row (`times`, "diffusers eager" among
    them) in ms, / floor, / diffusers and its `equal` entry (blank where it has none)."""
    ref_ms = times["diffusers eager"]
    print()
    print(f"| {title} | ms | / floor | / diffusers | {equal_header} |")
    print("|---|---|---|---|---|")
    print(f"| library floor (GEMMs + SDPA) | {floor:.1f} | 1.00 | {floor / ref_ms:.2f} | |")
    for label, ms in times.items():
        cell = f" {equal[label]} " if label in equal else " "
        print(f"| {label} | {ms:.1f} | {ms / floor:.2f} | {ms / ref_ms:.2f} |{cell}|")


def build_pair(in_channels: int = 64):
    """Full-size FLUX.1-dev in diffusers (random init on the GPU) and ours with the same weights.

    `in_channels` 384 is FLUX.1 Fill's transformer (latents + masked-image latents + mask), 128 Depth/Canny's.
    """
    from dataclasses import replace

    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(DEV):
        ref = FluxTransformer2DModel(guidance_embeds=True, in_channels=in_channels, out_channels=64)
        ref = ref.to(torch.bfloat16).eval()
    cfg = replace(FLUX1_DEV, in_channels=in_channels, out_channels=64)
    return ref, share_weights(ref, cfg, flux1_layout, Flux1Transformer, cfg.guidance_embed)


def step_inputs(n_img: int = 4096, n_txt: int = 512, batch: int = 1, channels: int = 64):
    g = torch.Generator(device=DEV).manual_seed(1)
    bf = torch.bfloat16
    img = torch.randn(batch, n_img, channels, device=DEV, generator=g).to(bf)
    txt = torch.randn(batch, n_txt, 4096, device=DEV, generator=g).to(bf)
    y = torch.randn(batch, 768, device=DEV, generator=g).to(bf)
    side = int(n_img**0.5)
    ids = torch.zeros(side, side, 3, device=DEV)
    ids[..., 1] = torch.arange(side, device=DEV)[:, None]
    ids[..., 2] = torch.arange(side, device=DEV)[None, :]
    img_ids = ids.reshape(-1, 3).to(bf)
    txt_ids = torch.zeros(n_txt, 3, device=DEV, dtype=bf)
    t = torch.full((batch,), 988.0, device=DEV, dtype=bf) / 1000
    guidance = torch.full((batch,), 3.5, device=DEV)
    return img, img_ids, txt, txt_ids, t, y, guidance


@torch.no_grad()
def bench_dit(ref, ours, iters: int, profile: bool) -> None:
    from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
    from flux_runtime.pipeline.graphs import GraphedDenoiser

    gemm_ms, attn_ms = library_floor()
    floor = gemm_ms + attn_ms
    RESULTS["floor_ms"] = {"gemm": gemm_ms, "attention": attn_ms, "total": floor}
    print(f"library floor: {floor:.1f} ms/step (GEMMs {gemm_ms:.1f}, attention {attn_ms:.1f})", flush=True)
    img, img_ids, txt, txt_ids, t, y, g = step_inputs()

    def run_ref():
        return ref(
            hidden_states=img,
            encoder_hidden_states=txt,
            pooled_projections=y,
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=g,
            return_dict=False,
        )[0]

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
            err = (out.float() - expected.float()).abs().max().item()
            equal[name] = f"max abs diff {err:.3g}"
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

    def run_ref():
        return ref(
            hidden_states=img, encoder_hidden_states=txt, pooled_projections=y, timestep=t, img_ids=img_ids,
            txt_ids=txt_ids, guidance=g, return_dict=False,
        )[0]  # fmt: skip

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
    ref, ours = build_pair()
    img, img_ids, txt, txt_ids, t, y, g = step_inputs()
    ref_ids = img_ids.clone()
    ref_ids[:, 0] = 1  # Kontext's reference tokens: the same grid at index 1
    kontext = (torch.cat([img, img.flip(1)], dim=1), torch.cat([img_ids, ref_ids]), txt, txt_ids, t, y, g)
    bench_variant("kontext", ref, ours, kontext, iters)
    del ref, ours
    torch.cuda.empty_cache()
    ref, ours = build_pair(in_channels=384)
    bench_variant("fill", ref, ours, step_inputs(channels=384), iters)
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


def profile_step(fn) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


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
    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
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
    ref, ours = build_pair()
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
