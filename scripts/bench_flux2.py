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
bench.py (whose timing, floor and table helpers it uses). Exit status 1 if any step differs. Writes every number to --json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import (  # scripts/bench.py, beside this file
    born_bf16,
    gemm_floor_ms,
    parity_then_time,
    print_step_table,
    sdpa_floor_ms,
    share_weights,
)

from flux_runtime.models.dit import FLUX2_DEV, FLUX2_KLEIN_4B, FLUX2_KLEIN_9B, DiTConfig, Flux2Transformer
from flux_runtime.weights import flux2_layout

DEV = torch.device("cuda")
RESULTS: dict[str, object] = {}
# name -> (our preset, diffusers Flux2Transformer2DModel kwargs); diffusers' defaults are FLUX.2 [dev]
MODELS: dict[str, tuple[DiTConfig, dict]] = {
    "dev": (FLUX2_DEV, {}),
    "klein-4b": (
        FLUX2_KLEIN_4B,
        dict(
            num_layers=5,
            num_single_layers=20,
            num_attention_heads=24,
            joint_attention_dim=7680,
            guidance_embeds=False,
        ),
    ),
    "klein-9b": (
        FLUX2_KLEIN_9B,
        dict(
            num_layers=8,
            num_single_layers=24,
            num_attention_heads=32,
            joint_attention_dim=12288,
            guidance_embeds=False,
        ),
    ),
}


def library_floor(cfg: DiTConfig, n_img: int = 4096, n_txt: int = 512) -> tuple[float, float]:
    """Sum of the step's cuBLAS GEMMs (F.linear, no bias, real shapes) and SDPA calls, each timed alone."""
    d, mlp, L = cfg.hidden_size, cfg.mlp_hidden_dim, n_img + n_txt
    gemms: Counter[tuple[int, int, int]] = Counter()  # (M, K, N) -> calls per step
    for m in (n_img, n_txt):  # double blocks, per stream: q, k, v, out, SwiGLU in (2 * mlp), out
        gemms[(m, d, d)] += 4 * cfg.depth
        gemms[(m, d, 2 * mlp)] += cfg.depth
        gemms[(m, mlp, d)] += cfg.depth
    gemms[(L, d, 3 * d + 2 * mlp)] += cfg.depth_single_blocks  # linear1
    gemms[(L, d + mlp, d)] += cfg.depth_single_blocks  # linear2
    # shared modulation (once per step), time (+ guidance) embedders, input/output projections, final adaLN
    gemms[(1, d, 6 * d)] += 2
    gemms[(1, d, 3 * d)] += 1
    gemms[(1, 256, d)] += 1 + cfg.guidance_embed
    gemms[(1, d, d)] += 1 + cfg.guidance_embed
    gemms[(n_img, cfg.in_channels, d)] += 1
    gemms[(n_txt, cfg.context_in_dim, d)] += 1
    gemms[(n_img, d, cfg.out_channels)] += 1
    gemms[(1, d, 2 * d)] += 1
    return gemm_floor_ms(gemms), sdpa_floor_ms(cfg, [(L, cfg.depth + cfg.depth_single_blocks)])


def build_pair(cfg: DiTConfig, diffusers_kw: dict):
    """Full-size FLUX.2 in diffusers (random bf16 init on the GPU) and ours on the same weights."""
    from diffusers import Flux2Transformer2DModel

    ref = born_bf16(Flux2Transformer2DModel, **diffusers_kw)  # [dev] in fp32 would not fit beside anything
    with torch.no_grad():  # QK-norm weights start at 1; make them matter
        for p in ref.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return ref, share_weights(ref, cfg, flux2_layout, Flux2Transformer, cfg.guidance_embed)


def step_inputs(cfg: DiTConfig, n_img: int = 4096, n_txt: int = 512, batch: int = 1):
    """What the pipelines feed one step at 1024²: packed latents, text states, int64 ids, t/1000, guidance."""
    g = torch.Generator(device=DEV).manual_seed(1)
    bf = torch.bfloat16
    img = torch.randn(batch, n_img, cfg.in_channels, device=DEV, generator=g).to(bf)
    txt = torch.randn(batch, n_txt, cfg.context_in_dim, device=DEV, generator=g).to(bf)
    side = int(n_img**0.5)
    zero = torch.zeros(1, dtype=torch.long, device=DEV)
    img_ids = torch.cartesian_prod(zero, torch.arange(side, device=DEV), torch.arange(side, device=DEV), zero)
    txt_ids = torch.cartesian_prod(zero, zero, zero, torch.arange(n_txt, device=DEV))
    t = torch.full((batch,), 988.0, device=DEV, dtype=bf) / 1000
    guidance = torch.full((batch,), 4.0, device=DEV) if cfg.guidance_embed else None
    return img, img_ids, txt, txt_ids, t, guidance


@torch.no_grad()
def _step_at(ours, tier, img, img_ids, txt, txt_ids, t, g, pe):
    from flux_runtime.kernels.dispatch import use_fused

    with use_fused(tier):
        return ours(img, img_ids, txt, txt_ids, t, g, pe=pe)


@torch.no_grad()
def bench_model(name: str, iters: int) -> bool:
    cfg, diffusers_kw = MODELS[name]
    res: dict[str, object] = {}
    RESULTS[name] = res
    gemm_ms, attn_ms = library_floor(cfg)
    floor = gemm_ms + attn_ms
    res["floor_ms"] = {"gemm": gemm_ms, "attention": attn_ms, "total": floor}
    print(
        f"[{name}] library floor: {floor:.1f} ms/step (GEMMs {gemm_ms:.1f}, attention {attn_ms:.1f})",
        flush=True,
    )

    t0 = time.perf_counter()
    ref, ours = build_pair(cfg, diffusers_kw)
    n_params = sum(p.numel() for p in ours.parameters())
    res["params"] = n_params
    res["weights_gib_resident"] = torch.cuda.memory_allocated() / 2**30
    print(
        f"[{name}] built FLUX.2-{name} ({n_params / 1e9:.2f} B params, {res['weights_gib_resident']:.1f} GiB "
        f"resident for both models) in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    img, img_ids, txt, txt_ids, t, g = step_inputs(cfg)

    def run_ref():
        return ref(
            hidden_states=img,
            encoder_hidden_states=txt,
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=g,
            return_dict=False,
        )[0]

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
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=["dev", "klein-4b"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_flux2.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    equal = []
    for name in args.models:
        equal.append(bench_model(name, args.iters))
        gc.collect()  # the models died with bench_model's frame; hand their memory back before the next
        torch.cuda.empty_cache()
    RESULTS["wall_s"] = time.perf_counter() - t0
    print(f"total {RESULTS['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=2))
    if not all(equal):
        failed = [n for n, ok in zip(args.models, equal, strict=True) if not ok]
        print(
            f"PARITY FAILED for {', '.join(failed)}: ours is not bit-identical to diffusers", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
