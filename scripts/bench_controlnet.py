#!/usr/bin/env python3
"""One FLUX.1-dev step with one ControlNet at 1024², against diffusers, on the GPU (random bf16 weights).

The ControlNet has InstantX's shape (5 double + 10 single blocks, latents in); a step is the ControlNet's
forward, then the transformer's with its residuals, as FluxControlNetPipeline runs them. Ours: eager with the
reference ops, eager with the lossless fused kernels, and lossless + CUDA graph (one graph for both models),
each `torch.equal` to diffusers' step or not; then the library floor (the GEMMs and attention of both models).
Usage: python3 scripts/bench_controlnet.py [--iters 10] [--json out.json]. Never a test: quote the ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (  # scripts/benchlib.py, beside this file
    DEV,
    cuda_time,
    finish_run,
    flux1_library_floor,
    flux1_pair,
    flux1_step_inputs,
    gemm_floor_ms,
    max_abs_diff,
    print_step_table,
    require_cuda,
)

from flux_runtime.models.dit import FLUX1_DEV
from flux_runtime.models.dit.controlnet import ControlNetConfig, Flux1ControlNet
from flux_runtime.weights import controlnet as controlnet_layout
from flux_runtime.weights import flux1_layout

DOUBLE, SINGLE = 5, 10  # InstantX FLUX.1-dev ControlNets (Canny, Depth, Union's 5 + 10)


def controlnet_pair():
    """An InstantX-shaped ControlNet in diffusers (random, on the GPU, bf16) and ours on its very tensors."""
    from diffusers import FluxControlNetModel

    torch.manual_seed(2)
    with torch.device(DEV):
        ref = FluxControlNetModel(guidance_embeds=True, num_layers=DOUBLE, num_single_layers=SINGLE)
        ref = ref.to(torch.bfloat16).eval()
    with torch.no_grad():  # the zero-initialised projections would add nothing
        for name, p in ref.named_parameters():
            if "controlnet_" in name:
                p.normal_(0, 0.02)
    cfg = ControlNetConfig(replace(FLUX1_DEV, depth=DOUBLE, depth_single_blocks=SINGLE))
    sd = ref.state_dict()
    ours_sd = {r.bfl: flux1_layout.diffusers_to_bfl(r, sd.__getitem__) for r in controlnet_layout.rules(cfg)}
    with torch.device("meta"):
        ours = Flux1ControlNet(cfg)
    ours.load_state_dict(ours_sd, strict=True, assign=True)
    return ref, ours.eval()


def controlnet_floor(n_img: int = 4096, n_txt: int = 512) -> float:
    """The ControlNet's GEMMs and attention alone: its blocks and embedders as a FLUX.1 model of its depth
    (whose final layer, one small GEMM, it lacks), plus the control latents in and the per-block projections."""
    cfg = replace(FLUX1_DEV, depth=DOUBLE, depth_single_blocks=SINGLE)
    gemm, attn = flux1_library_floor(cfg, n_img, n_txt)
    d = cfg.hidden_size
    extra = Counter({(n_img, d, d): DOUBLE + SINGLE, (n_img, cfg.in_channels, d): 1})
    return gemm + attn + gemm_floor_ms(extra, bias=True)


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not require_cuda("bench_controlnet.py"):
        return 0
    from flux_runtime.kernels.dispatch import use_fused
    from flux_runtime.pipeline.graphs import GraphedDenoiser

    t0 = time.perf_counter()
    ref_t, ours_t = flux1_pair()
    ref_c, ours_c = controlnet_pair()
    img, img_ids, txt, txt_ids, t, y, g = flux1_step_inputs()
    cond = torch.randn(img.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(3)).to(img.dtype)
    scale = 0.7

    def diffusers_step():
        double, single = ref_c(
            hidden_states=img, controlnet_cond=cond, conditioning_scale=scale, encoder_hidden_states=txt,
            pooled_projections=y, timestep=t, img_ids=img_ids, txt_ids=txt_ids, guidance=g, return_dict=False,
        )  # fmt: skip
        return ref_t(
            hidden_states=img, encoder_hidden_states=txt, pooled_projections=y, timestep=t, img_ids=img_ids,
            txt_ids=txt_ids, guidance=g, controlnet_block_samples=double, controlnet_single_block_samples=single,
            return_dict=False,
        )[0]  # fmt: skip

    pe = ours_t.rope(txt_ids, img_ids)

    def ours_step(x, tt, gg):
        residuals = ours_c(x, cond, None, txt, y, tt, gg, pe, scale)
        return ours_t(x, img_ids, txt, txt_ids, tt, y, gg, pe=pe, control=residuals)

    def tiered(tier):
        def run(x=img, tt=t, gg=g):
            with use_fused(tier):
                return ours_step(x, tt, gg)

        return run

    graphed = GraphedDenoiser(lambda x, tt, gg: tiered("lossless")(x, tt, gg))
    variants = {
        "ours eager, reference ops": tiered("off"),
        "ours eager, lossless fused kernels": tiered("lossless"),
        "ours lossless + CUDA graph": lambda: graphed(img, t, g),
    }
    expected = diffusers_step()
    times = {"diffusers eager": cuda_time(diffusers_step, iters=args.iters)}
    equal: dict[str, object] = {}
    for name, fn in variants.items():
        out = fn()
        out = fn()  # the graph captures on the second call
        equal[name] = (
            True if torch.equal(out, expected) else f"max abs diff {max_abs_diff(out, expected):.3g}"
        )
        times[name] = cuda_time(fn, iters=args.iters)
    base_gemm, base_attn = flux1_library_floor()
    floor = base_gemm + base_attn + controlnet_floor()
    print_step_table(
        "FLUX.1-dev + InstantX-shaped ControlNet, 1024², bf16, B=1, per step", floor, times, equal
    )
    finish_run({"step_ms": times, "equal": equal, "floor_ms": floor}, t0, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
