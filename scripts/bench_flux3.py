#!/usr/bin/env python3
"""FLUX.3 Image Klein transformer speed and parity on one GPU, against diffusers and the library floor in one run.

For each model (`--models`, default `base flow-map`) and each case (`--cases`, default `t2i ref`: text to image,
and with one 1024² reference image): build the full-size `Flux3Transformer2DModel` in diffusers with random
weights directly on the GPU in bf16 (QK-norm weights perturbed and held in fp32, as `from_pretrained` keeps
them), hand its tensors to our `Flux3Transformer` through weights/flux3_layout.py (shared, not copied), run one
bf16 step at 1024² (4096 image tokens, 480 text tokens, a 4096-token reference in `ref`) through both and
require `torch.equal`, then print per-step ms for the library floor (the step's GEMMs, per-token modulation
included, and SDPA calls timed alone), diffusers eager, ours eager with reference ops and with the lossless
fused kernels, and ours lossless + CUDA graph (median of >= 10 after warm-up), then the fused-ops report (which
kernels ran, which fell back and why); with `--high`, bf16 `high` + CUDA graph with SDPA and with FP8 attention
(its ratio to the lossless graphed step, its error against diffusers' step). Exit status 1 if any step differs. Writes every number to --json;
`--profile` adds a kernel table of one lossless eager step per case.

`--per-image` adds, for the base model, the whole denoising of one image (`--image-steps`, default 50, with CFG
3.5: a conditional and an unconditional forward per step, the empty negative prompt's 80 text tokens), through
the same Euler loop for all: diffusers eager; ours lossless + CUDA graph recomputing the text and reference
streams every step; and ours as the pipeline runs it, those streams run once per generation
(`Flux3Transformer.fixed_streams`). The final latents must be `torch.equal` to diffusers'. The text encoder and
the VAE are not in it (the same work for every runtime). Writes every number to --json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (  # scripts/benchlib.py, beside this file
    DEV,
    FLUX3_MODELS,
    FLUX3_N_IMG,
    FLUX3_N_TXT,
    cuda_event_ms,
    cuda_time,
    diffusers_fn,
    finish_run,
    flux3_library_floor,
    flux3_pair,
    flux3_step_inputs,
    free_cuda,
    parity_then_time,
    print_step_table,
    profile_step,
    require_cuda,
)

from flux_runtime.text.flux3 import text_ids

RESULTS: dict[str, object] = {}


def high_arms(label_case: str, step, img, t, target, expected, lossless_ms: float, iters: int) -> dict:
    """bf16 `high` + CUDA graph with SDPA and with FP8 attention (where the GPU and fa3-fwd allow it): ms per step,
    the ratio to the lossless graphed step (issue 36: at most 0.94) and the relative L2 error of the step's output
    against diffusers' (lossless: 0)."""
    from flux_runtime.kernels.attention_backends import (
        attention_backend,
        attention_record,
        reset_attention_record,
    )
    from flux_runtime.kernels.attention_quant import relative_error
    from flux_runtime.pipeline.graphs import GraphedDenoiser

    rows = {}
    for label, backend in (("high + CUDA graph, SDPA", "sdpa"), ("high + CUDA graph, FP8 attention", "auto")):

        def run(x, tt, tg, backend=backend):
            with attention_backend(backend):
                return step("high", x, tt, tg)

        graphed = GraphedDenoiser(run)
        reset_attention_record()
        out = graphed(img, t, target)
        out = graphed(img, t, target).clone()  # captured
        ms = cuda_time(lambda g=graphed: g(img, t, target), iters=iters)
        rows[label] = {
            "step_ms": ms, "x_lossless": ms / lossless_ms, "error_vs_diffusers": relative_error(out, expected),
            "attention": graphed.attention or attention_record(),
        }  # fmt: skip
        print(
            f"[{label_case}] {label}: {ms:.1f} ms ({ms / lossless_ms:.3f}x lossless), {rows[label]}",
            flush=True,
        )
    return rows


@torch.no_grad()
def bench_case(
    name: str, case: str, ref, ours, iters: int, profile: bool = False, high: bool = False
) -> bool:
    from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
    from flux_runtime.pipeline.graphs import GraphedDenoiser

    cfg = ours.config
    n_ref = FLUX3_N_IMG if case == "ref" else 0
    label_case = f"{name}, {'one 1024² reference' if n_ref else 'text to image'}"
    res: dict[str, object] = {}
    RESULTS[f"{name}/{case}"] = res
    gemm_ms, attn_ms = flux3_library_floor(cfg, n_ref)
    floor = gemm_ms + attn_ms
    res["floor_ms"] = {"gemm": gemm_ms, "attention": attn_ms, "total": floor}
    print(f"[{label_case}] library floor: {floor:.1f} ms/step (GEMMs {gemm_ms:.1f}, attention {attn_ms:.1f})")
    img, img_ids, txt, txt_ids, t, rf, rf_ids, target = flux3_step_inputs(cfg, n_ref)
    diffusers_step = diffusers_fn(
        ref, txt, img_ids, txt_ids, image_cond_hidden_states=rf, image_cond_ids=rf_ids
    )

    def run_ref():
        return diffusers_step(img, t, target_timestep=target)

    pe = ours.rope(txt_ids, img_ids, rf_ids)

    def step(tier: str, x, tt, tg):
        with use_fused(tier):
            return ours(x, img_ids, txt, txt_ids, tt, ref=rf, ref_ids=rf_ids, target_timesteps=tg, pe=pe)

    graphed = GraphedDenoiser(lambda x, tt, tg: step("lossless", x, tt, tg))
    variants = {
        "ours eager, reference ops": lambda: step("off", img, t, target),
        "ours eager, lossless fused kernels": lambda: step("lossless", img, t, target),
        "ours lossless + CUDA graph": lambda: graphed(img, t, target),
    }
    reset_fused_ops_report()
    expected = run_ref()

    def report(label: str, same: bool, diff: str) -> None:
        print(f"[{label_case}] one bf16 step, {label} vs diffusers: torch.equal = {same}{diff}", flush=True)

    times, equal = parity_then_time({"diffusers eager": run_ref, **variants}, expected, iters, report)
    print(fused_ops_report(), flush=True)
    if profile:  # where the lossless step's time goes, kernel by kernel
        profile_step(variants["ours eager, lossless fused kernels"])
    res["step_ms"], res["equal_to_diffusers"] = times, equal
    if high:
        res["high"] = high_arms(
            label_case, step, img, t, target, expected, times["ours lossless + CUDA graph"], iters
        )
    print_step_table(
        f"FLUX.3 Klein {label_case}, 1024², bf16, B=1, per step", floor, times, equal, "torch.equal"
    )
    print(flush=True)
    return all(equal.values())


@torch.no_grad()
def bench_image(case: str, ref, ours, steps: int) -> bool:
    """One base-model image's denoising with CFG: diffusers vs ours with and without the fixed streams."""
    from flux_runtime.kernels.dispatch import use_fused
    from flux_runtime.pipeline.graphs import GraphedDenoiser
    from flux_runtime.sampling.flux3 import FLUX3_SCHEDULE, flux3_denoise
    from flux_runtime.sampling.schedule import get_schedule

    cfg = ours.config
    n_ref = FLUX3_N_IMG if case == "ref" else 0
    label_case = f"base, {steps} steps CFG 3.5, {'one 1024² reference' if n_ref else 'text to image'}"
    img, img_ids, txt, txt_ids, _, rf, rf_ids, _ = flux3_step_inputs(cfg, n_ref)
    n_neg = 80  # the empty negative prompt fills one 80-token window
    neg = torch.randn(1, n_neg, cfg.context_in_dim, device=DEV, generator=torch.Generator(DEV).manual_seed(2))
    neg = neg.to(torch.bfloat16)
    neg_ids = text_ids(n_neg, DEV)
    sched = get_schedule(steps, FLUX3_N_IMG, config=FLUX3_SCHEDULE, device=DEV)
    pe = {n: ours.rope(text_ids(n, DEV), img_ids, rf_ids) for n in (FLUX3_N_TXT, n_neg)}

    def diffusers_denoiser(text, ids):
        step = diffusers_fn(ref, text, img_ids, ids, image_cond_hidden_states=rf, image_cond_ids=rf_ids)
        return lambda x, tt, _g: step(x, tt)

    def ours_fn(text, ids, fixed: bool):
        n = text.shape[1]
        if fixed:
            with use_fused("lossless"):
                streams = ours.fixed_streams(text, ids, img_ids, ref=rf, ref_ids=rf_ids, pe=pe[n])

            def step(x, tt, s):
                with use_fused("lossless"):
                    return ours(x, img_ids, None, ids, tt, ref_ids=rf_ids, pe=pe[n], fixed=s)

            graphed = GraphedDenoiser(step)
            return lambda x, tt, _g: graphed(x, tt, streams)

        def step_full(x, tt):
            with use_fused("lossless"):
                return ours(x, img_ids, text, ids, tt, ref=rf, ref_ids=rf_ids, pe=pe[n])

        graphed = GraphedDenoiser(step_full)
        return lambda x, tt, _g: graphed(x, tt)

    variants = {
        "diffusers eager": lambda: (diffusers_denoiser(txt, txt_ids), diffusers_denoiser(neg, neg_ids)),
        "ours lossless + CUDA graph, streams every step": lambda: (
            ours_fn(txt, txt_ids, False),
            ours_fn(neg, neg_ids, False),
        ),
        "ours lossless + CUDA graph, streams once (the pipeline)": lambda: (
            ours_fn(txt, txt_ids, True),
            ours_fn(neg, neg_ids, True),
        ),
    }

    def image(make):
        cond, uncond = make()  # the fixed streams are built here: inside the timed image
        return flux3_denoise(
            cond, img, sched.sigmas, sched.timesteps, flow_map=False, negative_model_fn=uncond,
            guidance_scale=3.5,
        )  # fmt: skip

    return time_images(f"base/{case}/image", label_case, steps, variants, image)


def bench_flow_map_image(case: str, ref, ours, steps: int) -> bool:
    """One distilled (flow-map) image's denoising, `steps` steps without CFG: diffusers vs ours."""
    from flux_runtime.kernels.dispatch import use_fused
    from flux_runtime.pipeline.graphs import GraphedDenoiser
    from flux_runtime.sampling.flux3 import FLUX3_SCHEDULE, flux3_denoise
    from flux_runtime.sampling.schedule import get_schedule

    cfg = ours.config
    n_ref = FLUX3_N_IMG if case == "ref" else 0
    label_case = f"flow map, {steps} steps, {'one 1024² reference' if n_ref else 'text to image'}"
    img, img_ids, txt, txt_ids, _, rf, rf_ids, _ = flux3_step_inputs(cfg, n_ref)
    sched = get_schedule(steps, FLUX3_N_IMG, config=FLUX3_SCHEDULE, device=DEV)
    pe = ours.rope(txt_ids, img_ids, rf_ids)

    def diffusers_denoiser():
        step = diffusers_fn(ref, txt, img_ids, txt_ids, image_cond_hidden_states=rf, image_cond_ids=rf_ids)
        return lambda x, tt, tg: step(x, tt, target_timestep=tg)

    def step(x, tt, tg):
        with use_fused("lossless"):
            return ours(x, img_ids, txt, txt_ids, tt, ref=rf, ref_ids=rf_ids, target_timesteps=tg, pe=pe)

    # one graph for both images, as the pipeline keeps its graphs across calls: the warm-up image captures
    # it, the timed one replays every step
    graphed = GraphedDenoiser(step)
    variants = {"diffusers eager": diffusers_denoiser, "ours lossless + CUDA graph": lambda: graphed}

    def image(make):
        return flux3_denoise(make(), img, sched.sigmas, sched.timesteps, flow_map=True)

    return time_images(f"flow-map/{case}/image", label_case, steps, variants, image)


def time_images(key: str, label_case: str, steps: int, variants: dict, image) -> bool:
    """`image(make)` per variant: a warm-up image (graphs run eagerly, then are captured), then one timed;
    each image compared `torch.equal` to the first variant's (diffusers'). Prints the table."""
    times: dict[str, float] = {}
    equal: dict[str, bool] = {}
    expected = None
    for label, make in variants.items():
        out = image(make)  # warm-up
        torch.cuda.synchronize()
        out, ms = cuda_event_ms(lambda make=make: image(make))
        times[label] = ms / 1000
        expected = out if expected is None else expected
        equal[label] = torch.equal(out, expected)
        print(f"[{label_case}] {label}: {times[label]:.2f} s, torch.equal = {equal[label]}", flush=True)
    RESULTS[key] = {"steps": steps, "seconds": times, "equal_to_diffusers": equal}
    ref_s = times["diffusers eager"]
    print()
    print(f"| FLUX.3 Klein {label_case}, 1024², bf16, denoising | s / image | / diffusers | torch.equal |")
    print("|---|---|---|---|")
    for label, sec in times.items():
        print(f"| {label} | {sec:.2f} | {sec / ref_s:.2f} | {equal[label]} |")
    print(flush=True)
    return all(equal.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(FLUX3_MODELS), default=["base", "flow-map"])
    ap.add_argument("--cases", nargs="+", choices=["t2i", "ref"], default=["t2i", "ref"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--per-image", action="store_true", help="also time whole images: base (CFG) and flow map (distilled)"
    )
    ap.add_argument("--image-steps", type=int, default=50, help="the base image's steps")
    ap.add_argument("--flow-map-steps", type=int, default=16, help="the distilled image's steps")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="kernel table of one lossless eager step per case")
    ap.add_argument(
        "--high", action="store_true", help="also bf16 high + CUDA graph, SDPA and FP8 attention (issue 36)"
    )
    args = ap.parse_args()
    if not require_cuda("bench_flux3.py"):
        return 2
    t0 = time.perf_counter()
    ok = []
    for name in args.models:
        ref, ours = flux3_pair(FLUX3_MODELS[name])
        print(f"[{name}] {sum(p.numel() for p in ours.parameters()):,} parameters", flush=True)
        for case in args.cases:
            ok.append(bench_case(name, case, ref, ours, args.iters, args.profile, args.high))
            if args.per_image and name == "base":
                ok.append(bench_image(case, ref, ours, args.image_steps))
            if args.per_image and name == "flow-map":
                ok.append(bench_flow_map_image(case, ref, ours, args.flow_map_steps))
        del ref, ours
        free_cuda()
    finish_run(RESULTS, t0, args.json)
    if not all(ok):
        print("PARITY FAILED: ours is not bit-identical to diffusers", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
