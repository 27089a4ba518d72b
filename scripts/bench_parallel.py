#!/usr/bin/env python3
"""Several GPUs for one image: per-step ms of the sequence-parallel transformer against one GPU, one run.

Run under torchrun on a host with N GPUs (NVLink multicast stays off: this script and flux-gen set
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 before NCCL starts):

    torchrun --nproc-per-node 2 scripts/bench_parallel.py                      # FLUX.1-dev, FLUX.2-dev; 1024², 2048²
    torchrun --nproc-per-node 4 scripts/bench_parallel.py --models flux1-dev --sizes 1024 --cfg

Every rank builds the same full-size transformer with random bf16 weights on its GPU (seeded, so the ranks
hold the same weights). For each model and size, rank 0 first times one GPU alone (the plain model; the
other ranks wait), then all ranks time the sequence-parallel forward (Ulysses over all N GPUs); both with
the `lossless` fused kernels, eager (no CUDA graphs), median of `--iters` CUDA-event timings after
`--warmup`. With `--cfg` a step is the conditional and unconditional forward: one GPU runs both, N GPUs
run them on two halves of N/2 (Ulysses inside each half) and swap once. Rank 0 prints per step: ms on one
GPU, ms on N, speedup, scaling efficiency (speedup / N), the collectives' GPU time in one profiled step
(NCCL kernels: the attention all-to-alls, the velocity all-gather, the CFG exchange), whether the N-GPU
velocity is `torch.equal` to the one-GPU one (else its max |diff| and relative L2; with `--fp64`, both
steps' relative L2 against a float64 copy, where it fits: use `--depth` for the large models), and the
fused-kernel record (`lossless`: every fused op ran, verified bit-exact per signature, on the shards too).

None of these numbers has been measured yet: no machine with several GPUs was lent while this was written.
Targets (issue 17): FLUX.1-dev >= 1.8x on 2 GPUs at 2048², >= 1.6x at 1024²; FLUX.2-dev >= 1.8x at 1024².
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.parallel.launch import NO_MULTICAST_ENV

os.environ.update(NO_MULTICAST_ENV)  # before torch / NCCL start

import torch
import torch.distributed as dist
from benchlib import cuda_event_ms  # scripts/benchlib.py, beside this file

from flux_runtime.kernels import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.models.dit import (
    FLUX1_DEV,
    FLUX2_DEV,
    Flux1Transformer,
    Flux2Transformer,
)
from flux_runtime.models.dit.config import TINY_FLUX2_TRAINED, TINY_TRAINED
from flux_runtime.parallel.cfg import cfg_branches
from flux_runtime.parallel.group import ParallelConfig, World, join
from flux_runtime.parallel.ulysses import SequenceParallel
from flux_runtime.sampling import flux2_image_ids, flux2_text_ids, image_ids

MODELS = {
    "flux1-dev": (FLUX1_DEV, Flux1Transformer),
    "flux2-dev": (FLUX2_DEV, Flux2Transformer),
    # the built-in tiny architectures: a smoke run of this script on CPU processes (`--device cpu`)
    "tiny": (TINY_TRAINED, Flux1Transformer),
    "tiny-flux2": (TINY_FLUX2_TRAINED, Flux2Transformer),
}
N_TXT = 512


def build(name: str, depth: int | None, device: torch.device) -> torch.nn.Module:
    """The preset's transformer with seeded random bf16 weights, the same on every rank."""
    cfg, cls = MODELS[name]
    if depth is not None:  # a shallower copy for a quick look (`--depth`)
        cfg = replace(
            cfg, depth=min(depth, cfg.depth), depth_single_blocks=min(2 * depth, cfg.depth_single_blocks)
        )
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def inputs(model: torch.nn.Module, size: int, device: torch.device, seed: int) -> tuple[tuple, dict]:
    """One step's full inputs at size² pixels: (size / 16)² image tokens, 512 text tokens, batch 1."""
    cfg = model.config
    dtype = model.img_in.weight.dtype
    lat = size // 8  # the latent grid; tokens pack it 2x2
    gen = torch.Generator(device=device).manual_seed(seed)
    img = torch.randn(1, (lat // 2) ** 2, cfg.in_channels, generator=gen, device=device).to(dtype)
    txt = torch.randn(1, N_TXT, cfg.context_in_dim, generator=gen, device=device).to(dtype)
    t = torch.full((1,), 0.75, device=device, dtype=dtype)
    g = torch.full((1,), 3.5, device=device) if cfg.guidance_embed else None
    if cfg.family == "flux1":
        img_ids, txt_ids = (
            image_ids(lat, lat, dtype=dtype, device=device),
            torch.zeros(N_TXT, 3, device=device),
        )
        y = torch.randn(1, cfg.vec_in_dim, generator=gen, device=device).to(dtype)
        args: tuple = (img, img_ids, txt, txt_ids.to(dtype), t, y, g)
    else:
        img_ids, txt_ids = flux2_image_ids(lat, lat, device=device), flux2_text_ids(N_TXT, device=device)
        args = (img, img_ids, txt, txt_ids, t, g)
    return args, {"pe": model.rope(args[3], img_ids)}


def step_ms(fn, warmup: int, iters: int, sync_group: bool, device: torch.device) -> float:
    """Median ms of `fn()` over `iters` timings (CUDA events on a GPU) after `warmup` calls; with
    `sync_group` the ranks start each call together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if sync_group:
            dist.barrier()
        if device.type != "cuda":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
            continue
        torch.cuda.synchronize()
        times.append(cuda_event_ms(fn)[1])
    return statistics.median(times)


def collective_ms(fn, device: torch.device) -> float:
    """GPU time of the NCCL kernels in one call of `fn` (torch.profiler); NaN off the GPU."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if "nccl" in e.key.lower()) / 1000


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def bench(world: World, name: str, size: int, cfg_parallel: bool, args: argparse.Namespace) -> dict:
    dev = world.device
    model = build(name, args.depth, dev)
    pos, kw = inputs(model, size, dev, seed=1)
    other, _ = inputs(model, size, dev, seed=2)
    neg = (*pos[:2], other[2], *pos[3:])  # the unconditional branch: the same latents, other text states
    sharded = SequenceParallel(model, world)  # outside a parallel call `model` itself runs whole
    row: dict = {"model": name, "size": size, "gpus": world.size, "cfg": cfg_parallel}

    def one_gpu() -> tuple[torch.Tensor, ...]:
        return (model(*pos, **kw), model(*neg, **kw)) if cfg_parallel else (model(*pos, **kw),)

    plan = world.plan(cfg=cfg_parallel)

    def many_gpus() -> tuple[torch.Tensor, ...]:
        with world.running(plan):
            if plan.branch is None:
                return (sharded(*pos, **kw), sharded(*neg, **kw)) if cfg_parallel else (sharded(*pos, **kw),)
            cond, uncond = cfg_branches(
                plan, lambda: lambda *_: sharded(*pos, **kw), lambda: lambda *_: sharded(*neg, **kw)
            )
            first = cond(pos[0], pos[4], None)
            return first, uncond(pos[0], pos[4], None)

    with torch.no_grad(), use_fused("lossless"):
        if world.is_main:
            row["ms_1gpu"] = step_ms(one_gpu, args.warmup, args.iters, False, dev)
            ref = one_gpu()
        dist.barrier()
        reset_fused_ops_report()
        row["ms_ngpu"] = step_ms(many_gpus, args.warmup, args.iters, True, dev)
        row["kernels"] = fused_ops_report().tier_used
        out = many_gpus()
        row["collectives_ms"] = collective_ms(many_gpus, dev)
    if world.is_main:
        row["speedup"] = row["ms_1gpu"] / row["ms_ngpu"]
        row["efficiency"] = row["speedup"] / world.size
        row["equal"] = all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
        row["max_diff"] = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(out, ref, strict=True)
        )
        row["rel_l2"] = rel_l2(out[0], ref[0])
        if args.fp64:  # both against a float64 copy of the step (rank 0; needs 8 bytes a parameter)
            params = sum(p.numel() for p in model.parameters())
            room = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 2**34
            if params * 8 < 0.5 * room:
                m64 = build(name, args.depth, dev).double()
                p64 = tuple(a.double() if a is not None and a.is_floating_point() else a for a in pos)
                exact = m64(*p64, pe=kw["pe"])
                row["err_1gpu_vs_fp64"], row["err_ngpu_vs_fp64"] = (
                    rel_l2(ref[0], exact),
                    rel_l2(out[0], exact),
                )
                del m64
    return row  # the models go with this frame


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048])
    ap.add_argument(
        "--cfg", action="store_true", help="time a CFG step (two forwards), CFG-parallel on N >= 2"
    )
    ap.add_argument("--depth", type=int, default=None, help="fewer blocks (quick look; not the real model)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fp64", action="store_true", help="also both errors vs a float64 step (if it fits)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, a smoke run")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    world, _ = join(
        ParallelConfig(world_size=int(os.environ.get("WORLD_SIZE", "1"))), torch.device(args.device)
    )
    rows = []
    for m in args.models:
        for s in args.sizes:
            rows.append(bench(world, m, s, args.cfg, args))
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if world.is_main:
        print(f"{'model':10} {'size':>5} {'gpus':>4} {'1 GPU ms':>9} {'N GPU ms':>9} {'speedup':>7} {'eff':>5} "
              f"{'nccl ms':>7} {'equal':>5} {'max|diff|':>9} {'rel L2':>8}  kernels")  # fmt: skip
        for r in rows:
            print(f"{r['model']:10} {r['size']:>5} {r['gpus']:>4} {r['ms_1gpu']:9.1f} {r['ms_ngpu']:9.1f} "
                  f"{r['speedup']:7.2f} {r['efficiency']:5.2f} {r['collectives_ms']:7.1f} {r['equal']!s:>5} "
                  f"{r['max_diff']:9.3g} {r['rel_l2']:8.2g}  {r['kernels']}")  # fmt: skip
            if "err_1gpu_vs_fp64" in r:
                print(f"{'':10} relative L2 vs float64: one GPU {r['err_1gpu_vs_fp64']:.6f}, "
                      f"{r['gpus']} GPUs {r['err_ngpu_vs_fp64']:.6f}")  # fmt: skip
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
