#!/usr/bin/env python3
"""FP8 per-step speed, exactness and error at full size, against bf16 (ours and diffusers) in one run.

For FLUX.1-dev, FLUX.2-dev and FLUX.2-klein-4B (random weights, 1024², B=1): diffusers bf16 eager, ours
bf16 lossless + CUDA graph, then the same model quantized at load (`fp8=True`: per-channel e4m3 weights,
per-row activation scales) run as the FP8 eager reference, FP8 lossless (fused producers) eager and
+ graph (`torch.equal` to the FP8 reference), and FP8 high + graph (fast accumulation). The FP8 floor
is the step's `torch._scaled_mm` calls (and its remaining bf16 GEMMs) timed alone, plus cuDNN attention; the
floor in step order runs the same calls in the model's order as one CUDA graph, each GEMM with its own weights.
Error: relative L2 of one step against the float64 model (not for FLUX.2-dev, whose float64 copy does not
fit on one GPU). Peak memory while stepping.

FLUX.3 Image Klein (`flux3-klein`, the flow map, and `flux3-klein-base`; not in the default list): the same
rows for text to image and with one 1024² reference (`--flux3-cases t2i,ref`; 4096 image, 480 text tokens),
its FP8 floor counted from FLUX.3's own GEMMs (q, k, v, out, SwiGLU in/out of every per-mode and joint
block in e4m3; embedders, per-token modulation and the final layer in bf16), and the FP8 model's share of
the weights in memory.
FLUX.1 and FLUX.2 steps are also timed with the FP8 producers' e4m3 codes from integer operations instead of
the GPU's conversion instruction (`triton_utils.set_e4m3_hardware`; the same codes), a same-run A/B.
`--layout-ab` adds a same-run A/B of the attention inputs' layout (`kernels.set_head_major`): the FP8 step
(lossless + graph) with q, k and the joint V (B, L, H, Dh) contiguous as before, all three head-major, and k
and v only (the default: q, and so SDPA's output, as before), each a new graph, `torch.equal` to the old
layout's output.
Usage: python3 scripts/bench_fp8.py [--models flux1-dev,flux2-dev,klein-4b,flux3-klein] [--layout-ab] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (  # scripts/benchlib.py, beside this file
    DEV,
    FLUX2_MODELS,
    FLUX3_MODELS,
    FLUX3_N_IMG,
    cuda_time,
    diffusers_fn,
    fa3_floor_ms,
    flux1_pair,
    flux1_step_inputs,
    flux2_pair,
    flux2_step_inputs,
    flux3_pair,
    flux3_step_inputs,
    flux3_step_shapes,
    free_cuda,
    gemm_floor_ms,
    max_abs_diff,
    profile_step,
    require_cuda,
    sdpa_floor_ms,
)

from flux_runtime.kernels import fp8
from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.kernels.fp8 import E4M3
from flux_runtime.kernels.gelu import gelu_shortcut
from flux_runtime.kernels.qk_norm_rope import head_major_layout
from flux_runtime.kernels.triton_utils import e4m3_hardware
from flux_runtime.models.dit import FLUX1_DEV
from flux_runtime.pipeline.graphs import GraphedDenoiser
from flux_runtime.weights.fp8 import quantize_model

RESULTS: dict[str, object] = {}
PROFILE = False
LAYOUT_AB = False
# `--layout-ab`'s arms: `set_head_major`'s setting, its row label (FLUX.3 has no joint V: "kv" moves k only)
LAYOUT_ARMS: tuple[tuple[bool | str, str], ...] = (
    (False, "q, k, v (B, L, H, Dh) contiguous (the old layout)"),
    (True, "q, k, v head-major"),
    ("kv", "k, v head-major, q as before"),
)


def layout_ab(
    measure: Callable[..., torch.Tensor],
    step: Callable[[], Callable[[], torch.Tensor]],
    expected: torch.Tensor,
    times: dict[str, float],
) -> dict[str, bool]:
    """The same-run A/B of `--layout-ab`: `measure(label, step(), expected)` (a new FP8 lossless + graph step,
    its ms into `times[label]`) under each of `LAYOUT_ARMS`'s settings, then one line of the arms' ms against the
    old layout's. Returns whether each arm's output is `torch.equal` to the old layout's (SDPA's bits do not
    depend on its inputs' strides)."""
    outs, labels = {}, {}
    for flag, arm in LAYOUT_ARMS:
        labels[arm] = f"(ours fp8 lossless + graph, {arm})"
        with head_major_layout(flag):
            outs[arm] = measure(labels[arm], step(), expected)
    old_arm = LAYOUT_ARMS[0][1]
    same = {arm: bool(torch.equal(out, outs[old_arm])) for arm, out in outs.items()}
    old_ms = times[labels[old_arm]]
    print(
        "layout A/B: "
        + "; ".join(
            f"{arm} {times[labels[arm]]:.2f} ms ({times[labels[arm]] - old_ms:+.2f}), torch.equal {same[arm]}"
            for arm in outs
        ),
        flush=True,
    )
    return same


def print_fp8_table(
    title: str, floor: dict[str, float], times: dict[str, float], equal: dict, peaks: dict[str, float]
) -> None:
    """The per-step markdown table: the FP8 floor (its parts), then each timed row in ms, / FP8 floor,
    / ours bf16 (lossless + graph), / diffusers bf16 (eager), its `equal` entry (blank where none) and peak GiB."""
    print()
    print(f"| {title} | ms | / FP8 floor | / ours bf16 | / diffusers bf16 | equal | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| FP8 floor (e4m3 GEMMs {floor['fp8_gemm']:.1f} [fast accum {floor['fp8_gemm_fast_accum']:.1f}] + bf16 GEMMs "
        f"{floor['bf16_gemm']:.1f} + attention {floor['attention']:.1f}) | {floor['total']:.1f} | 1.00 | | | | |"
    )
    if "high_total" in floor:
        print(
            f"| `high` floor with FP8 attention (fast-accum e4m3 GEMMs {floor['fp8_gemm_fast_accum']:.1f} + bf16 GEMMs "
            f"{floor['bf16_gemm']:.1f} + FA3 e4m3 attention {floor['attention_fa3_e4m3']:.1f}) | "
            f"{floor['high_total']:.1f} | {floor['high_total'] / floor['total']:.2f} | | | | |"
        )
    if "sequence" in floor:
        seq = floor["sequence"]
        print(
            f"| FP8 floor in step order (the same calls, one CUDA graph, each GEMM its own weights) | {seq:.1f} | "
            f"{seq / floor['total']:.2f} | | | | |"
        )
    for key, label in (
        ("step_layout", "the step's strided q, k, v"),
        ("qk_bhld", "q, k contiguous (B, H, L, Dh), v strided"),
        ("all_bhld", "q, k, v contiguous"),
    ):
        if f"attention_{key}" in floor:
            same = "same bits" if floor[f"attention_{key}_equal"] else "different bits"
            same += " run to run" if key == "step_layout" else " as the step's"
            print(
                f"| (attention, {label}: {floor[f'attention_{key}']:.1f}, {same}; not in the floor) | | | | | | |"
            )
    d_ms, b_ms = times["diffusers bf16 eager"], times["ours bf16 lossless + graph"]

    def seq_ratio(ms: float) -> str:
        return f" ({ms / floor['sequence']:.2f} in step order)" if "sequence" in floor else ""

    for label, ms in times.items():
        print(
            f"| {label} | {ms:.1f} | {ms / floor['total']:.2f}{seq_ratio(ms)} | {ms / b_ms:.2f} | {ms / d_ms:.2f} | "
            f"{equal.get(label, '')} | {peaks[label]:.1f} |"
        )


def time_gemms(
    fp8: Counter[tuple[int, int, int]], bf16: Counter[tuple[int, int, int]], bias: bool
) -> dict[str, float]:
    """Summed ms of a step's GEMMs, `(M, K, N) -> calls`, each shape timed alone: `fp8` as e4m3 row-wise
    `_scaled_mm` (plain and fast accumulation), `bf16` as `F.linear`; with a bf16 bias each when `bias` (FLUX.1)."""
    out = {"fp8_gemm": 0.0, "fp8_gemm_fast_accum": 0.0, "bf16_gemm": 0.0}
    for (m, k, n), count in fp8.items():
        a = torch.randn(m, k, device=DEV).to(E4M3)
        w = torch.randn(n, k, device=DEV).to(E4M3)
        sa, sb = torch.rand(m, 1, device=DEV), torch.rand(1, n, device=DEV)
        b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
        for key, fast in (("fp8_gemm", False), ("fp8_gemm_fast_accum", True)):
            out[key] += count * cuda_time(
                lambda a=a, w=w, sa=sa, sb=sb, b=b, fast=fast: torch._scaled_mm(
                    a, w.t(), scale_a=sa, scale_b=sb, bias=b, out_dtype=torch.bfloat16, use_fast_accum=fast
                ),
                iters=20,
            )
        del a, w
    out["bf16_gemm"] = gemm_floor_ms(bf16, bias=bias)
    return out


def mlp_in(cfg, flux1: bool) -> int:
    """Width of the MLP's first projection: FLUX.1's GELU input, FLUX.2's SwiGLU `[gate | up]`."""
    return cfg.mlp_hidden_dim if flux1 else 2 * cfg.mlp_hidden_dim


def step_calls(cfg, flux1: bool, n_img: int = 4096, n_txt: int = 512) -> list[tuple[str, int, int, int]]:
    """The step's GEMMs and attentions in the order the model runs them: `("fp8" | "bf16", M, K, N)` for a
    GEMM (e4m3 block projections; bf16 embedders, modulation and final layer), `("attention", L, 0, 0)` for
    one joint attention. FLUX.1 projects each block's modulation itself; FLUX.2 shares three projections."""
    d, mlp, up, L = cfg.hidden_size, cfg.mlp_hidden_dim, mlp_in(cfg, flux1), n_img + n_txt
    calls: list[tuple[str, int, int, int]] = [
        ("bf16", n_img, cfg.in_channels, d),
        ("bf16", n_txt, cfg.context_in_dim, d),
    ]
    if not flux1:
        calls += [("bf16", 1, d, 6 * d)] * 2 + [("bf16", 1, d, 3 * d)]
    for _ in range(cfg.depth):
        if flux1:
            calls += [("bf16", 1, d, 6 * d)] * 2
        calls += [("fp8", m, d, 3 * d) for m in (n_img, n_txt)] + [("attention", L, 0, 0)]
        calls += [("fp8", m, d, d) for m in (n_img, n_txt)]
        for m in (n_img, n_txt):
            calls += [("fp8", m, d, up), ("fp8", m, mlp, d)]
    for _ in range(cfg.depth_single_blocks):
        if flux1:
            calls.append(("bf16", 1, d, 3 * d))
        calls += [("fp8", L, d, 3 * d + up), ("attention", L, 0, 0), ("fp8", L, d + mlp, d)]
    return [*calls, ("bf16", 1, d, 2 * d), ("bf16", n_img, d, cfg.out_channels)]


def fp8_floor(cfg, flux1: bool, n_img: int = 4096, n_txt: int = 512) -> dict[str, float]:
    """The FP8 model's GEMMs timed alone: e4m3 row-wise `_scaled_mm` for the block projections (plain and fast
    accumulation), bf16 `F.linear` for the rest; plus one cuDNN attention per block. `sequence`: the same
    calls in the step's order, each GEMM with weights of its own, replayed as one CUDA graph."""
    calls = step_calls(cfg, flux1, n_img, n_txt)
    fp8 = Counter((m, k, n) for kind, m, k, n in calls if kind == "fp8")
    bf16 = Counter((m, k, n) for kind, m, k, n in calls if kind == "bf16")
    L = n_img + n_txt
    out = time_gemms(fp8, bf16, bias=flux1)
    out["attention"] = sdpa_floor_ms(cfg, [(L, cfg.depth + cfg.depth_single_blocks)])
    layouts = step_layout_attention(cfg, L, 3 * cfg.hidden_size + mlp_in(cfg, flux1))
    for key, (ms, same) in layouts.items():
        out[f"attention_{key}"] = (cfg.depth + cfg.depth_single_blocks) * ms
        out[f"attention_{key}_equal"] = same
    out["total"] = out["fp8_gemm"] + out["bf16_gemm"] + out["attention"]
    # what `high` with FP8 attention could reach: fast-accumulation e4m3 GEMMs and FA3's e4m3 attention
    fa3 = fa3_floor_ms(cfg, [(L, cfg.depth + cfg.depth_single_blocks)])
    if fa3 is not None:
        out["attention_fa3_e4m3"] = fa3
        out["high_total"] = out["fp8_gemm_fast_accum"] + out["bf16_gemm"] + fa3
    out["sequence"] = sequence_floor(cfg, calls, flux1)
    return out


def step_ops(
    cfg, calls: list[tuple[str, int, int, int]], flux1: bool, device=DEV
) -> list[Callable[[], object]]:
    """`calls` as zero-argument callables on random tensors (see `sequence_floor`); FLUX.1's GEMMs add a bias."""
    h, dh, bias = cfg.num_heads, cfg.head_dim, flux1
    width = 3 * h * dh + mlp_in(cfg, flux1)  # the single block's linear1 output
    acts: dict[tuple[str, int, int], list] = {}
    ops: list[Callable[[], object]] = []
    for kind, m, k, n in calls:  # two buffers per activation shape, used in turn
        if kind == "attention":  # q, k (B, L, H, Dh) as QK norm + RoPE writes them; v inside the projection
            if kind not in acts:
                acts[kind] = []
                for _ in range(2):
                    q, kk = (torch.randn(1, m, h, dh, device=device, dtype=torch.bfloat16) for _ in range(2))
                    packed = torch.randn(1, m, width, device=device, dtype=torch.bfloat16)
                    v = packed[..., 2 * h * dh : 3 * h * dh].unflatten(-1, (h, dh))
                    acts[kind].append([t.transpose(1, 2) for t in (q, kk, v)])
            ops.append(partial(F.scaled_dot_product_attention, *acts[kind][len(ops) % 2]))
            continue
        dtype = E4M3 if kind == "fp8" else torch.bfloat16
        if (kind, m, k) not in acts:
            acts[(kind, m, k)] = [torch.randn(m, k, device=device).to(dtype) for _ in range(2)]
        a = acts[(kind, m, k)][len(ops) % 2]
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16).to(dtype)
        b = torch.randn(n, device=device, dtype=torch.bfloat16) if bias else None
        if kind == "bf16":
            ops.append(partial(F.linear, a, w, b))
            continue
        scales = {"scale_a": torch.rand(m, 1, device=device), "scale_b": torch.rand(1, n, device=device)}
        ops.append(partial(torch._scaled_mm, a, w.t(), **scales, bias=b, out_dtype=torch.bfloat16))
    return ops


def sequence_floor(cfg, calls: list[tuple[str, int, int, int]], flux1: bool) -> float:
    """ms of `calls` replayed as one CUDA graph, as the step runs them: every GEMM reads weights of its own
    (the step's GEMMs do; a shape timed alone re-reads the same weights, which may stay in L2), activations
    alternate between two buffers per shape, and each attention reads q, k and v in the step's layout (q, k
    (B, L, H, Dh); v a column slice of the single block's projection). No elementwise kernel runs."""
    ops = step_ops(cfg, calls, flux1)

    def run() -> None:
        for op in ops:
            op()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up: cuBLAS and cuDNN pick their kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = cuda_time(graph.replay, iters=10)
    ops.clear()
    del graph
    torch.cuda.empty_cache()
    return ms


def step_layout_attention(cfg, length: int, width: int) -> dict[str, tuple[float, bool]]:
    """One SDPA call as the single block makes it (and diffusers does): q and k (B, L, H, Dh) tensors and v a
    column slice of `linear1`'s (B, L, `width`) output, each seen as (B, H, L, Dh); then the same values with
    q and k contiguous in (B, H, L, Dh) (what a RoPE kernel could write), and with all three contiguous.
    Each entry is (ms, whether its output is `torch.equal` to a first call on the step layout; for the step
    layout itself, whether SDPA repeats its bits): a layout change can only enter `lossless` if it keeps the
    bits. Not part of the floor's total."""
    shape = (1, length, cfg.num_heads, cfg.head_dim)
    q, k = (torch.randn(shape, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    packed = torch.randn(1, length, width, device=DEV, dtype=torch.bfloat16)
    d = cfg.num_heads * cfg.head_dim
    v = packed[..., 2 * d : 3 * d].unflatten(-1, (cfg.num_heads, cfg.head_dim))
    step = [t.permute(0, 2, 1, 3) for t in (q, k, v)]
    qk_bhld = [step[0].contiguous(), step[1].contiguous(), step[2]]
    all_bhld = [t.contiguous() for t in step]
    ref = F.scaled_dot_product_attention(*step)
    out = {}
    for key, args in (("step_layout", step), ("qk_bhld", qk_bhld), ("all_bhld", all_bhld)):
        ms = cuda_time(lambda args=args: F.scaled_dot_product_attention(*args), iters=20)
        out[key] = (ms, bool(torch.equal(F.scaled_dot_product_attention(*args), ref)))
    return out


def measure_step(
    rows: dict[str, dict], tag: str, iters: int, label: str, fn: Callable[[], torch.Tensor], expected=None
) -> torch.Tensor:
    """Run `fn` twice (a CUDA graph captures on the second call), then note in `rows` under `label`: "equal"
    (`torch.equal` to `expected`, or its max abs diff; only with `expected`), "step_ms" (`cuda_time`) and
    "peak_gib" (the peak allocated while timing); print them on one line tagged `[tag]`. Returns the output."""
    out = fn()
    out = fn()  # graphs: the first call runs eagerly, the second captures and replays
    if expected is not None:
        rows["equal"][label] = torch.equal(out, expected) or f"max abs diff {max_abs_diff(out, expected):.3g}"
    torch.cuda.reset_peak_memory_stats()
    rows["step_ms"][label] = cuda_time(fn, iters=iters)
    rows["peak_gib"][label] = torch.cuda.max_memory_allocated() / 2**30
    print(
        f"[{tag}] {label}: {rows['step_ms'][label]:.1f} ms, peak {rows['peak_gib'][label]:.1f} GiB, "
        f"equal {rows['equal'].get(label, '-')}",
        flush=True,
    )
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@torch.no_grad()
def bench_model(name: str, iters: int) -> bool:
    flux1 = name == "flux1-dev"
    res: dict[str, object] = {}
    RESULTS[name] = res
    if flux1:
        cfg = FLUX1_DEV
        ref, ours = flux1_pair()
        img, img_ids, txt, txt_ids, t, y, g = flux1_step_inputs()
        extra = (y,)
    else:
        cfg, kw = FLUX2_MODELS[name.removeprefix("flux2-")]
        ref, ours = flux2_pair(cfg, kw)
        img, img_ids, txt, txt_ids, t, g = flux2_step_inputs(cfg)
        extra = ()
    pe = ours.rope(txt_ids, img_ids)
    models = {"diffusers": ref}
    del ref

    def ours_step(model, tier):
        def run(x=img, tt=t, gg=g):
            with use_fused(tier):
                return model(x, img_ids, txt, txt_ids, tt, *extra, gg, pe=pe)

        return run

    def graphed(model, tier):
        gd = GraphedDenoiser(lambda x, tt, gg: ours_step(model, tier)(x, tt, gg))
        return lambda: gd(img, t, g)

    times: dict[str, float] = {}
    equal: dict[str, object] = {}
    peaks: dict[str, float] = {}
    measure = partial(measure_step, {"step_ms": times, "equal": equal, "peak_gib": peaks}, name, iters)

    def block_ab(act: str, what: str, model, expected) -> None:
        """The FP8 lossless step again with `act`'s per-row producer in each other column block (whole rows,
        1024- or 2048-wide blocks: `fp8.set_act_block`), each a new graph, for a same-run A/B."""
        default = fp8.ACT_BLOCK_DEFAULTS[act]
        for block in (None, 1024, 2048):
            if block != default:
                label = "whole rows" if block is None else f"{block}-wide blocks"
                with fp8.act_block(act, block):
                    measure(
                        f"(ours fp8 lossless + graph, {what} in {label})",
                        graphed(model, "lossless"),
                        expected,
                    )

    pooled = {"pooled_projections": y} if flux1 else {}
    # diffusers' step, held only while measured: `models.clear()` below frees the model
    run_ref = diffusers_fn(models["diffusers"], txt, img_ids, txt_ids, guidance=g, **pooled)
    expected_bf16 = measure("diffusers bf16 eager", partial(run_ref, img, t))
    del run_ref
    out_bf16 = measure("ours bf16 lossless + graph", graphed(ours, "lossless"), expected_bf16)
    models.clear()  # diffusers' model goes; ours keeps the weights it shares
    torch.cuda.empty_cache()

    # float64 reference of the bf16 model (not FLUX.2-dev: its float64 copy, 258 GB, does not fit)
    ref64 = None
    if name != "flux2-dev":
        m64 = copy.deepcopy(ours).to(torch.float64)
        ref64 = m64(
            img.double(), img_ids, txt.double(), txt_ids, t.double(), *(e.double() for e in extra),
            None if g is None else g.double(), pe=None,
        )  # fmt: skip
        del m64
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    res["precision"] = quantize_model(ours, torch.bfloat16)
    torch.cuda.empty_cache()
    res["quantize_s"] = time.perf_counter() - t0
    res["weights_gib_fp8_model"] = torch.cuda.memory_allocated() / 2**30
    print(
        f"[{name}] quantized at load in {res['quantize_s']:.1f} s; {res['weights_gib_fp8_model']:.1f} GiB allocated",
        flush=True,
    )

    reset_fused_ops_report()
    expected_fp8 = measure("ours fp8 eager reference", ours_step(ours, "off"))
    measure("ours fp8 lossless eager", ours_step(ours, "lossless"), expected_fp8)
    out_fp8 = measure("ours fp8 lossless + graph", graphed(ours, "lossless"), expected_fp8)
    if (
        flux1
    ):  # the same step with tanh-GELU evaluated in both of attention_act_fp8's sweeps (no max shortcut)
        with gelu_shortcut(False):
            measure(
                "(ours fp8 lossless + graph, GELU in both sweeps)", graphed(ours, "lossless"), expected_fp8
            )
        block_ab("gelu_tanh", "double-block GELU", ours, expected_fp8)
    if name == "klein-4b":
        block_ab("swiglu", "double-block SwiGLU", ours, expected_fp8)
    with e4m3_hardware(False):  # the producers' e4m3 codes from integer operations, not the GPU's cvt
        measure(
            "(ours fp8 lossless + graph, integer e4m3 conversion)", graphed(ours, "lossless"), expected_fp8
        )
    if LAYOUT_AB:
        same = layout_ab(measure, partial(graphed, ours, "lossless"), expected_fp8, times)
        equal["(layout A/B: every arm torch.equal to the old layout's)"] = all(same.values())
        res["layout_ab"] = {
            label: {"ms": times[f"(ours fp8 lossless + graph, {label})"], "equal_to_old": same[label]}
            for _, label in LAYOUT_ARMS
        }
    print(fused_ops_report(), flush=True)
    if PROFILE:
        profile_step(ours_step(ours, "lossless"))
    out_fp8_high = measure("ours fp8 high + graph", graphed(ours, "high"), expected_fp8)

    floor = fp8_floor(cfg, flux1)
    res["fp8_floor_ms"] = floor
    if ref64 is not None:
        res["error_vs_fp64"] = {
            "bf16 lossless": rel(out_bf16, ref64),
            "fp8 lossless": rel(out_fp8, ref64),
            "fp8 high": rel(out_fp8_high, ref64),
        }
    res["step_ms"], res["equal"], res["peak_gib"] = times, equal, peaks
    ratio_bf16 = times["ours fp8 lossless + graph"] / times["ours bf16 lossless + graph"]
    res["fp8_over_bf16"] = ratio_bf16
    res["fp8_over_floor"] = times["ours fp8 lossless + graph"] / floor["total"]
    res["fp8_over_sequence_floor"] = times["ours fp8 lossless + graph"] / floor["sequence"]
    print_fp8_table(f"{name}, 1024², B=1, per step", floor, times, equal, peaks)
    if "error_vs_fp64" in res:
        print(f"relative L2 error of one step vs float64: {res['error_vs_fp64']}")
    print(flush=True)
    del ours
    torch.cuda.empty_cache()
    return all(v is True for k, v in equal.items() if "high" not in k)


def fp8_floor_flux3(cfg, n_ref: int) -> dict[str, float]:
    """FLUX.3's FP8 step floor: e4m3 row-wise `_scaled_mm` for every block projection (plain and fast
    accumulation), bf16 `F.linear` for the embedders, per-token modulation and final layer, cuDNN attention."""
    gemms, attention = flux3_step_shapes(cfg, n_ref)
    fp8: Counter[tuple[int, int, int]] = Counter()
    bf16: Counter[tuple[int, int, int]] = Counter()
    for block, shape, count in gemms:
        (fp8 if block else bf16)[shape] += count
    out = time_gemms(fp8, bf16, bias=False)
    out["attention"] = sdpa_floor_ms(cfg, attention)
    out["total"] = out["fp8_gemm"] + out["bf16_gemm"] + out["attention"]
    return out


@torch.no_grad()
def bench_flux3_model(name: str, cases: list[str], iters: int) -> bool:
    """`bench_model`'s rows for one FLUX.3 Klein model, per case (text to image, one 1024² reference)."""
    cfg = FLUX3_MODELS["flow-map" if name == "flux3-klein" else "base"]
    n_refs = {case: FLUX3_N_IMG if case == "ref" else 0 for case in cases}
    pair = dict(zip(("diffusers", "ours"), flux3_pair(cfg), strict=True))
    inputs = {case: flux3_step_inputs(cfg, n_refs[case]) for case in cases}
    pes = {case: pair["ours"].rope(x[3], x[1], x[6]) for case, x in inputs.items()}

    def ours_step(case: str, tier: str):
        img, img_ids, txt, txt_ids, t, rf, rf_ids, target = inputs[case]
        model, pe = pair["ours"], pes[case]

        def run(x=img, tt=t, tg=target):
            with use_fused(tier):
                return model(x, img_ids, txt, txt_ids, tt, ref=rf, ref_ids=rf_ids, target_timesteps=tg, pe=pe)

        return run

    def graphed(case: str, tier: str):
        img, t, target = inputs[case][0], inputs[case][4], inputs[case][7]
        gd = GraphedDenoiser(ours_step(case, tier))
        return lambda: gd(img, t, target)

    def diffusers_step(case: str):
        img, img_ids, txt, txt_ids, t, rf, rf_ids, target = inputs[case]
        step = diffusers_fn(
            pair["diffusers"], txt, img_ids, txt_ids, image_cond_hidden_states=rf, image_cond_ids=rf_ids
        )
        return lambda: step(img, t, target_timestep=target)

    results = {case: {"step_ms": {}, "equal": {}, "peak_gib": {}} for case in cases}

    def measure(case, label, fn, expected=None):
        return measure_step(results[case], f"{name}/{case}", iters, label, fn, expected)

    outs: dict[tuple[str, str], torch.Tensor] = {}
    for case in cases:
        expected = measure(case, "diffusers bf16 eager", diffusers_step(case))
        outs[case, "bf16"] = measure(case, "ours bf16 lossless + graph", graphed(case, "lossless"), expected)
    del pair["diffusers"]  # ours keeps the weights it shares
    free_cuda()
    weights_bf16 = torch.cuda.memory_allocated() / 2**30

    # the float64 copy of the bf16 model (its QK norm and RoPE run in fp32, as the model computes them)
    ref64 = {}
    m64 = copy.deepcopy(pair["ours"]).to(torch.float64)
    for case, (img, img_ids, txt, txt_ids, t, rf, rf_ids, target) in inputs.items():
        ref64[case] = m64(
            img.double(), img_ids, txt.double(), txt_ids, t.double(),
            ref=None if rf is None else rf.double(), ref_ids=rf_ids,
            target_timesteps=None if target is None else target.double(),
        )  # fmt: skip
    del m64
    free_cuda()

    t0 = time.perf_counter()
    precision = quantize_model(pair["ours"], torch.bfloat16)
    free_cuda()
    quantize_s = time.perf_counter() - t0
    weights_fp8 = torch.cuda.memory_allocated() / 2**30
    print(
        f"[{name}] {precision}: quantized in {quantize_s:.1f} s; {weights_bf16:.1f} GiB -> {weights_fp8:.1f} GiB allocated",
        flush=True,
    )
    for case in cases:
        reset_fused_ops_report()
        expected = measure(case, "ours fp8 eager reference", ours_step(case, "off"))
        measure(case, "ours fp8 lossless eager", ours_step(case, "lossless"), expected)
        outs[case, "fp8"] = measure(case, "ours fp8 lossless + graph", graphed(case, "lossless"), expected)
        if LAYOUT_AB:
            step_ms = results[case]["step_ms"]
            same = layout_ab(partial(measure, case), partial(graphed, case, "lossless"), expected, step_ms)
            results[case]["equal"]["(layout A/B: every arm torch.equal to the old layout's)"] = all(
                same.values()
            )
        print(fused_ops_report(), flush=True)
        outs[case, "fp8 high"] = measure(case, "ours fp8 high + graph", graphed(case, "high"), expected)

    ok = True
    for case in cases:
        res = results[case]
        floor = fp8_floor_flux3(cfg, n_refs[case])
        times = res["step_ms"]
        res.update(
            fp8_floor_ms=floor,
            error_vs_fp64={k: rel(outs[case, k], ref64[case]) for k in ("bf16", "fp8", "fp8 high")},
            fp8_over_bf16=times["ours fp8 lossless + graph"] / times["ours bf16 lossless + graph"],
            fp8_over_floor=times["ours fp8 lossless + graph"] / floor["total"],
            precision=precision,
            allocated_gib={"bf16 model": weights_bf16, "fp8 model": weights_fp8},
        )
        RESULTS[f"{name}/{case}"] = res
        what = "one 1024² reference" if case == "ref" else "text to image"
        print_fp8_table(f"{name} {what}, 1024², B=1, per step", floor, times, res["equal"], res["peak_gib"])
        print(f"relative L2 error of one step vs float64: {res['error_vs_fp64']}")
        print(flush=True)
        ok &= all(v is True for k, v in res["equal"].items() if "high" not in k)
    pair.clear()
    free_cuda()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="flux1-dev,klein-4b,flux2-dev")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="kernel table of one FP8 lossless step per model")
    ap.add_argument(
        "--flux3-cases", default="t2i,ref", help="FLUX.3: t2i (text to image), ref (one reference)"
    )
    ap.add_argument(
        "--layout-ab",
        action="store_true",
        help="same-run A/B of the FP8 lossless + graph step over the attention inputs' layout (set_head_major)",
    )
    args = ap.parse_args()
    global PROFILE, LAYOUT_AB
    PROFILE, LAYOUT_AB = args.profile, args.layout_ab
    if not require_cuda("bench_fp8.py"):
        return 2
    ok = True
    try:
        for name in args.models.split(","):
            if name.startswith("flux3"):
                ok &= bench_flux3_model(name, args.flux3_cases.split(","), args.iters)
            else:
                ok &= bench_model(name, args.iters)
    finally:
        if args.json:
            args.json.write_text(json.dumps(RESULTS, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
