#!/usr/bin/env python3
"""The FLUX autoencoders' decode at full size on one GPU: ours against diffusers, and what `high` could change.

For each family (FLUX.1 `AutoencoderKL`, FLUX.2 `AutoencoderKLFlux2`), random full-size weights in bf16,
one latent of a 1024² image (B=1): diffusers' decode, ours (`torch.equal` checked), our `high` decode (the
fused GroupNorm + SiLU), and other candidates, each with its ms and its PSNR against our lossless decode
(images in [0, 1]): channels-last convolutions, cuDNN autotuning, fp16, torch.compile of the decoder. With
--profile, a kernel table of our lossless decode. Never a test: run it on the device, quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (  # scripts/benchlib.py, beside this file
    DEV,
    cuda_time,
    diffusers_vae_kwargs,
    profile_step,
)

from flux_runtime.kernels import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.models.vae import FLUX1_VAE, FLUX2_VAE
from flux_runtime.weights import vae2_layout, vae_layout
from flux_runtime.weights.random_init import init_random
from flux_runtime.weights.vae import _random_stats, build_vae

RESULTS: dict[str, object] = {}


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two decodes mapped to images in [0, 1]."""
    x, y = ((t.float().clamp(-1, 1) + 1) / 2 for t in (a, b))
    mse = (x - y).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def diffusers_twin(ours: torch.nn.Module, family: str) -> torch.nn.Module:
    """diffusers' autoencoder of the same config, holding our weights under its names."""
    from diffusers import AutoencoderKL, AutoencoderKLFlux2

    cfg = ours.config
    kw = diffusers_vae_kwargs(cfg)
    cls = AutoencoderKLFlux2 if family == "flux2" else AutoencoderKL
    layout = vae2_layout if family == "flux2" else vae_layout
    with torch.device("meta"):
        ref = cls(**kw)
    sd = ours.state_dict()
    table = list(layout.rules(cfg.ch_mult, cfg.num_res_blocks))
    mapped = {r.diffusers: vae_layout.bfl_to_diffusers(r, sd[r.bfl]) for r in table}
    extra = {k: v for k, v in sd.items() if k not in {r.bfl for r in table}}
    ref.load_state_dict({**mapped, **extra}, strict=False, assign=True)
    missing = [k for k, p in ref.state_dict().items() if p.is_meta]
    if missing:
        raise SystemExit(f"diffusers twin has unset tensors: {missing[:5]}")
    return ref.to(DEV).eval()


@torch.no_grad()
def bench_family(family: str, iters: int, profile: bool, compile_: bool) -> None:
    cfg = FLUX2_VAE if family == "flux2" else FLUX1_VAE
    # full-size random weights, as the loader gives a built-in random preset
    with torch.device("meta"):
        ours = build_vae(cfg)
    init_random(ours, 0, DEV, torch.bfloat16)
    if family == "flux2":
        _random_stats(ours, 0, DEV, torch.bfloat16)
    ours.eval()
    ref = diffusers_twin(ours, family)
    gen = torch.Generator(device=DEV).manual_seed(0)
    z = torch.randn(1, cfg.z_channels, 128, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
    row: dict[str, object] = {}

    torch.backends.cudnn.benchmark = False
    base = ours.decode(z)
    row["equal_diffusers"] = bool(torch.equal(base, ref.decode(z).sample))
    row["diffusers_ms"] = cuda_time(lambda: ref.decode(z), iters=iters)
    row["ours_ms"] = cuda_time(lambda: ours.decode(z), iters=iters)
    row["peak_gib_ours"] = torch.cuda.max_memory_allocated() / 2**30

    def variant(name: str, fn) -> None:
        out = fn()
        ms = cuda_time(fn, iters=iters)
        row[name] = {"ms": ms, "psnr_db": psnr(out, base), "equal": bool(torch.equal(out, base))}

    def high(model, latent):
        with use_fused("high"):
            return model.decode(latent)

    reset_fused_ops_report()
    # what the pipeline's high tier runs: NCHW weights, a channels-last latent (so NHWC convolutions)
    variant("high", lambda: high(ours, z.contiguous(memory_format=torch.channels_last)))
    variant("high_nchw", lambda: high(ours, z))
    row["high_kernels"] = str(fused_ops_report())
    torch.backends.cudnn.benchmark = True
    variant("cudnn_benchmark", lambda: ours.decode(z))
    torch.backends.cudnn.benchmark = False
    ours_cl = ours.to(memory_format=torch.channels_last)
    z_cl = z.contiguous(memory_format=torch.channels_last)
    variant("channels_last", lambda: ours_cl.decode(z_cl))
    torch.backends.cudnn.benchmark = True
    variant("channels_last_benchmark", lambda: ours_cl.decode(z_cl))
    variant("high_channels_last_benchmark", lambda: high(ours_cl, z_cl))
    torch.backends.cudnn.benchmark = False
    variant("high_channels_last", lambda: high(ours_cl, z_cl))
    torch.backends.cudnn.benchmark = True
    variant("fp16_channels_last", lambda: _fp16(ours_cl)(z_cl.half()))
    if compile_:
        t0 = time.perf_counter()
        dec = torch.compile(ours_cl.decoder, dynamic=False)
        dec(z_cl)
        torch.cuda.synchronize()
        row["compile_s"] = time.perf_counter() - t0
        variant("channels_last_compiled", lambda: dec(z_cl))
    torch.backends.cudnn.benchmark = False
    ours.to(memory_format=torch.contiguous_format)
    if profile:
        for name, fn in (("lossless", lambda: ours.decode(z)), ("high", lambda: high(ours, z))):
            profile_step(fn, rows=14, warmup=False, title=f"{family} {name} decode kernels")
    RESULTS[family] = row
    print(family, json.dumps(row, indent=1))


_FP16: dict[int, torch.nn.Module] = {}


def _fp16(model: torch.nn.Module):
    """An fp16 copy of `model`'s decoder (made once), returning bf16 like the others."""
    if id(model) not in _FP16:
        import copy

        _FP16[id(model)] = copy.deepcopy(model.decoder).half()
    dec = _FP16[id(model)]
    return lambda z: dec(z).to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=["flux1", "flux2"], choices=["flux1", "flux2"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    for fam in args.families:
        bench_family(fam, args.iters, args.profile, args.compile)
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
