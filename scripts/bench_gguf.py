#!/usr/bin/env python3
"""GGUF dequantization on the GPU: the torch reference against the fused Triton kernel, beside the bf16 GEMM
each weight feeds, at FLUX.1-dev's projection shapes; then one FLUX.1-dev step (1024²) with a GGUF transformer
against the bf16 step of the same weights.

Part 1, per GGML type (random blocks with weight-sized scales): each block projection shape dequantized to bf16
by the reference (`dequantize(raw, qtype).to(bf16)`, what `GgufLinear.weight` runs in tier `off`) and by the
kernel, `torch.equal` checked, and the GEMM (`F.linear` with bias) at the tokens that weight multiplies at
1024² (4096 image, 512 text, 4608 joint tokens; 1 for the adaLN projections); then the sums over one step of
FLUX.1-dev's block projections (each weight is dequantized once per forward).

Part 2, per `--step-types` type: FLUX.1-dev (random, built on meta and filled on the GPU) with its projections in
that type as a GGUF load makes them (city96's rule: whole blocks of it, else Q8_0, else bf16), one step
in tier `off` (the reference dequantization), `lossless` (the kernel) and `lossless` + CUDA graph, against a
bf16 twin whose weights are the dequantized ones (`off` and `lossless`); every output `torch.equal` to the twin's
`off` step or not. Usage: python3 scripts/bench_gguf.py [--types Q8_0,Q4_K] [--step-types Q4_K,Q8_0]
[--iters 10] [--json out.json]. Never a test: quote the ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import DEV, cuda_time, finish_run, flux1_step_inputs, free_cuda, max_abs_diff, require_cuda
from random_fill import fill_module  # scripts/random_fill.py, beside this file

from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.kernels.gguf_dequant import BY_NAME, QUANT_TYPES, GgmlType, dequantize
from flux_runtime.kernels.gguf_dequant_triton import HALF_FIELDS, dequantize_triton
from flux_runtime.models.dit import FLUX1_DEV, DiTConfig, Flux1Transformer
from flux_runtime.models.dit.layers import GgufLinear, Linear

BF = torch.bfloat16
N_IMG, N_TXT = 4096, 512  # 1024², a 512-token prompt
# the second fp16 field over the first (the minimum over the scale), so that a block's values centre near zero:
# the unsigned codes' mean (Q4_1/Q5_1 add m, the K-quants subtract dmin times a sub-block minimum of the
# same mean as the sub-block scale)
MIN_OVER_SCALE = {"Q4_1": -7.5, "Q5_1": -15.5, "Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}


@torch.no_grad()
def random_blocks(qtype: GgmlType, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """(rows, bytes) uint8 blocks on the GPU: random codes and sub-block scales, the fp16 scales set so that the
    weight's std is about 1/sqrt(cols) (as `random_fill`'s matrices), each block's jittered by U(0.5, 1.5)."""
    raw = torch.randint(0, 256, (rows, cols // qtype.block, qtype.type_size), generator=gen, device=DEV)
    raw = raw.to(torch.uint8)
    fields = HALF_FIELDS[qtype.name]
    ratios = (1.0, MIN_OVER_SCALE.get(qtype.name, 0.0))[: len(fields)]

    def set_fields(scale: torch.Tensor) -> None:
        for off, ratio in zip(fields, ratios, strict=True):
            raw[..., off : off + 2] = (scale * ratio).half().unsqueeze(-1).view(torch.uint8)

    set_fields(torch.ones(rows, cols // qtype.block, device=DEV))
    unit_std = dequantize(raw[:64].reshape(-1, qtype.type_size), qtype).float().std()
    jitter = torch.rand(rows, cols // qtype.block, generator=gen, device=DEV) + 0.5
    set_fields(jitter * (cols**-0.5 / unit_std))
    return raw.reshape(rows, -1)


def step_projections(cfg=FLUX1_DEV) -> Counter[tuple[tuple[int, int], int]]:
    """FLUX.1-dev's block projections in one step: ((out, in), tokens of its GEMM) -> weights of that kind."""
    d, mlp = cfg.hidden_size, cfg.mlp_hidden_dim
    n = Counter()
    for m in (N_IMG, N_TXT):  # double blocks, per stream: qkv, out proj, MLP up, MLP down
        for shape in ((3 * d, d), (d, d), (mlp, d), (d, mlp)):
            n[(shape, m)] += cfg.depth
    n[((6 * d, d), 1)] += 2 * cfg.depth  # img_mod, txt_mod
    n[((3 * d, d), 1)] += cfg.depth_single_blocks  # the single blocks' modulation
    n[((3 * d + mlp, d), N_IMG + N_TXT)] += cfg.depth_single_blocks  # linear1
    n[((d, d + mlp), N_IMG + N_TXT)] += cfg.depth_single_blocks  # linear2
    return n


def bench_dequant(names: list[str], iters: int) -> dict[str, dict]:
    """Part 1: per type, per shape and per step, reference vs kernel vs the GEMMs; prints the tables."""
    projections = step_projections()
    shapes = sorted({shape for shape, _ in projections})
    gemm_ms: dict[tuple[tuple[int, int], int], float] = {}
    for (out_f, in_f), m in projections:
        x = torch.randn(m, in_f, device=DEV, dtype=BF)
        w = torch.randn(out_f, in_f, device=DEV, dtype=BF) * in_f**-0.5
        b = torch.randn(out_f, device=DEV, dtype=BF)
        gemm_ms[((out_f, in_f), m)] = cuda_time(lambda x=x, w=w, b=b: F.linear(x, w, b), iters=iters)
        del x, w, b
    gemm_step = sum(n * gemm_ms[key] for key, n in projections.items())
    weights_per_shape = Counter()
    for (shape, _), n in projections.items():
        weights_per_shape[shape] += n
    gen = torch.Generator(device=DEV).manual_seed(0)
    results: dict[str, dict] = {}
    print("\n| type | (out, in) | reference ms | kernel ms | kernel GB/s | / reference | torch.equal |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        qtype = BY_NAME[name]
        per_shape = {}
        for shape in shapes:
            raw = random_blocks(qtype, *shape, gen)
            ref = dequantize(raw, qtype).to(BF)
            equal = torch.equal(dequantize_triton(raw, qtype, BF), ref)
            ref_ms = cuda_time(lambda raw=raw, qtype=qtype: dequantize(raw, qtype).to(BF), iters=iters)
            ker_ms = cuda_time(lambda raw=raw, qtype=qtype: dequantize_triton(raw, qtype, BF), iters=iters)
            gbs = (raw.numel() + ref.numel() * ref.element_size()) / ker_ms / 1e6
            per_shape[str(shape)] = {"reference_ms": ref_ms, "kernel_ms": ker_ms, "equal": equal}
            print(
                f"| {name} | {shape} | {ref_ms:.3f} | {ker_ms:.3f} | {gbs:.0f} | {ker_ms / ref_ms:.2f} | {equal} |"
            )
            del raw, ref
        ref_step = sum(n * per_shape[str(s)]["reference_ms"] for s, n in weights_per_shape.items())
        ker_step = sum(n * per_shape[str(s)]["kernel_ms"] for s, n in weights_per_shape.items())
        equal_all = all(v["equal"] for v in per_shape.values())
        results[name] = {
            "shapes": per_shape,
            "step_reference_ms": ref_step,
            "step_kernel_ms": ker_step,
            "equal": equal_all,
        }
    print(f"\nper FLUX.1-dev step at 1024² ({sum(weights_per_shape.values())} block projections):")
    print(
        "| type | reference dequant ms | kernel dequant ms | kernel / reference | GEMMs ms | kernel / GEMMs | all equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ref_step, ker_step = r["step_reference_ms"], r["step_kernel_ms"]
        print(
            f"| {name} | {ref_step:.1f} | {ker_step:.1f} | {ker_step / ref_step:.2f} | {gemm_step:.1f} | "
            f"{ker_step / gemm_step:.2f} | {r['equal']} |"
        )
    return {"types": results, "step_gemm_ms": gemm_step, "gemm_ms": {str(k): v for k, v in gemm_ms.items()}}


def city96_type(name: str, in_features: int) -> GgmlType | None:
    """A projection's type as city96's FLUX files store it: `name` where its rows hold whole blocks of it, else
    Q8_0 where they hold whole blocks of 32, else None (kept in bf16)."""
    main = BY_NAME[name]
    if in_features % main.block == 0:
        return main
    return BY_NAME["Q8_0"] if in_features % 32 == 0 else None


@torch.no_grad()
def gguf_flux1(name: str, seed: int, cfg: DiTConfig = FLUX1_DEV) -> Flux1Transformer:
    """FLUX.1-dev (or `cfg`) with its projections as `GgufLinear`s of random blocks (`city96_type`), the rest
    random bf16."""
    with torch.device("meta"):
        model = Flux1Transformer(cfg).to(BF)
        for module_name, module in list(model.named_modules()):
            qtype = city96_type(name, module.in_features) if type(module) is Linear else None
            if qtype is not None:
                parent, _, child = module_name.rpartition(".")
                new = GgufLinear(module.in_features, module.out_features, module.bias is not None, qtype, BF)
                model.get_submodule(parent).register_module(child, new)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    fill_module(model, DEV, gen, position_buffers=False)
    for module in model.modules():
        if isinstance(module, GgufLinear):
            module.qweight.copy_(
                random_blocks(module.ggml_type, module.out_features, module.in_features, gen)
            )
    return model.eval()


@torch.no_grad()
def bf16_twin(model: Flux1Transformer) -> Flux1Transformer:
    """The same transformer with plain bf16 projections holding `model`'s dequantized weights (tier off)."""
    sd: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith(".qweight"):
            module = model.get_submodule(name.rpartition(".")[0])
            sd[name.rpartition(".")[0] + ".weight"] = module.weight.clone()
        else:
            sd[name] = t
    with torch.device("meta"):
        twin = Flux1Transformer(model.config).to(BF)
    twin.load_state_dict(sd, strict=True, assign=True)
    return twin.eval()


@torch.no_grad()
def bench_step(name: str, iters: int) -> dict[str, object]:
    """Part 2 for one type: prints and returns the step times and parity."""
    from flux_runtime.pipeline.graphs import GraphedDenoiser

    model = gguf_flux1(name, seed=1)
    quantized_gib = sum(m.qweight.numel() for m in model.modules() if isinstance(m, GgufLinear)) / 2**30
    with use_fused("off"):
        twin = bf16_twin(model)
    inputs = flux1_step_inputs(N_IMG, N_TXT)

    def tiered(net: nn.Module, tier: str):
        def run(*xs: torch.Tensor) -> torch.Tensor:
            with use_fused(tier):  # type: ignore[arg-type]
                return net(*(xs or inputs))

        return run

    graphed = GraphedDenoiser(tiered(model, "lossless"))
    variants = {
        "bf16 twin, off": tiered(twin, "off"),
        "bf16 twin, lossless": tiered(twin, "lossless"),
        f"GGUF {name}, off (torch dequant)": tiered(model, "off"),
        f"GGUF {name}, lossless (kernel)": tiered(model, "lossless"),
        f"GGUF {name}, lossless + CUDA graph": partial(graphed, *inputs),
    }
    expected = variants["bf16 twin, off"]()
    times: dict[str, float] = {}
    equal: dict[str, object] = {}
    reset_fused_ops_report()
    for label, fn in variants.items():
        out = fn()
        out = fn()  # the graph captures on the second call
        equal[label] = (
            True if torch.equal(out, expected) else f"max abs diff {max_abs_diff(out, expected):.3g}"
        )
        times[label] = cuda_time(fn, iters=iters)
        del out
    report = fused_ops_report()
    print(
        f"\nFLUX.1-dev step, 1024², B=1, projections {name} ({quantized_gib:.1f} GiB of blocks), eager unless noted"
    )
    print("| variant | ms | / bf16 twin lossless | torch.equal bf16 twin off |")
    print("|---|---|---|---|")
    base = times["bf16 twin, lossless"]
    for label, ms in times.items():
        print(f"| {label} | {ms:.1f} | {ms / base:.2f} | {equal[label]} |")
    gguf_fallbacks = {k[1]: v for k, v in report.fallbacks.items() if k[0] == "gguf_dequant"}
    print(
        f"gguf_dequant: {report.fused_calls.get('gguf_dequant', 0)} fused calls, fallbacks {gguf_fallbacks}"
    )
    if report.mismatches:
        print("MISMATCHES:", *report.mismatches, sep="\n  ")
    del model, twin, variants, graphed
    free_cuda()
    return {
        "step_ms": times,
        "equal": equal,
        "quantized_gib": quantized_gib,
        "mismatches": list(report.mismatches),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    quant = ",".join(t.name for t in QUANT_TYPES.values())
    ap.add_argument("--types", default=quant, help=f"types of part 1 (default all: {quant})")
    ap.add_argument("--step-types", default="Q4_K,Q8_0", help="types of part 2's step ('' skips it)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not require_cuda("bench_gguf.py"):
        return 0
    t0 = time.perf_counter()
    results: dict[str, object] = {
        "dequant": bench_dequant([t for t in args.types.split(",") if t], args.iters)
    }
    free_cuda()
    results["steps"] = {name: bench_step(name, args.iters) for name in args.step_types.split(",") if name}
    finish_run(results, t0, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
