#!/usr/bin/env python3
"""FP8 attention on Hopper (issue 36): one attention call at FLUX shapes, then the FLUX step with and without it.

Op (`--ops`): at FLUX.1 / FLUX.2-dev 1024² and 2048² (24 / 48 heads of 128, 512 text + 4096 / 16384 image tokens,
B=1), from a double block's QKV projection outputs (strided views, per-head magnitudes, random RMSNorm weights,
random rotations):
- the attention alone: cuDNN SDPA bf16 (`layers.sdpa`, the runtime's), FA3 bf16, FA3 e4m3 (per-head descales),
  FlashInfer's e4m3 prefill (`backend="fa3"`, if `flashinfer` imports);
- the chains from the projections: bf16 (`qk_norm_rope` x2, joint V, SDPA: lossless), FP8 with the producers
  (`qk_norm_rope_fp8` x2, `heads_fp8`, FA3 e4m3: high), FP8 with eager quantization (the bf16 producers, then
  `quantize_heads_reference` x3, FA3 e4m3), and the producers alone, bf16 and e4m3; the FP8 chain again with the
  e4m3 q, k, v all token-major and all head-major (the default stores k and v head-major: `HEAD_MAJOR`);
- the error of each attention against float64 attention of the bf16 q, k, v (relative L2), with K smoothing
  (eager) and the e4m3 reference with e4m3 probabilities beside it; whether the producers' codes are
  `torch.equal` to the eager chain's.
Step (`--steps`): FLUX.1-dev (and `--models flux2-dev`) at 1024² (and `--sizes 1024,2048`), random weights, B=1, + CUDA graph: bf16 lossless;
bf16 high with SDPA (`attention_backend("sdpa")`), with FP8 attention, and with FP8 attention but in the first
double and last single block (`keep_bf16_attention`); the model quantized at load (FP8 GEMMs) in high, the same
three; then (unless `--no-static`) the FP8 model with static input scales from this step's ranges
(`set_static_input_scales`: lossless with SDPA, high with FP8 attention) and with per-tensor weights too (the
tensorwise GEMM of a ModelOpt checkpoint). Relative L2 error of each step against the bf16 lossless step.
Usage: python3 scripts/bench_fp8_attention.py [--ops] [--steps] [--models flux1-dev,flux2-dev] [--sizes 1024,2048]
[--json out.json]
(neither --ops nor --steps: both). Needs an sm90 GPU and the fa3-fwd package (`pip install
'flux-runtime[fp8-attention]'`, or scripts/gpu_check.sh fp8-attention's wheel).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (  # scripts/benchlib.py, beside this file
    DEV,
    FLUX2_MODELS,
    cuda_time,
    finish_run,
    flux1_pair,
    flux1_step_inputs,
    flux2_pair,
    flux2_step_inputs,
    free_cuda,
    require_cuda,
)

from flux_runtime.kernels import attention_backends as backends
from flux_runtime.kernels.attention_quant import (
    Fp8Heads,
    attention_fp32,
    fp8_attention_reference,
    quantize_heads_reference,
    relative_error,
)
from flux_runtime.kernels.dispatch import use_fused
from flux_runtime.kernels.heads_fp8 import heads_fp8, qk_norm_rope_fp8
from flux_runtime.kernels.qk_norm_rope import empty_heads, head_major_layout, is_head_major, qk_norm_rope
from flux_runtime.models.dit.fp8_attention import keep_bf16_attention
from flux_runtime.models.dit.layers import Fp8Linear, sdpa
from flux_runtime.pipeline.graphs import GraphedDenoiser
from flux_runtime.weights.fp8 import quantize_model, set_static_input_scales
from flux_runtime.weights.fp8_export import quantize_per_tensor, record_input_ranges

# name -> (heads, text tokens, image tokens)
SHAPES: dict[str, tuple[int, int, int]] = {
    "FLUX.1 1024²": (24, 512, 4096),
    "FLUX.2-dev 1024²": (48, 512, 4096),
    "FLUX.1 2048²": (24, 512, 16384),
    "FLUX.2-dev 2048²": (48, 512, 16384),
}
EPS = 1e-6
RESULTS: dict[str, object] = {}


class Projections:
    """One double block's attention inputs before QK-norm + RoPE: each stream's q, k, v as (1, L, H, 128) views of a
    (1, L, 3, H, 128) QKV output, the four RMSNorm weights, the joint RoPE tables."""

    def __init__(self, heads: int, n_txt: int, n_img: int) -> None:
        g = torch.Generator(device=DEV).manual_seed(0)

        def qkv(n: int) -> torch.Tensor:
            x = torch.randn(1, n, 3, heads, 128, device=DEV, generator=g)
            mag = torch.rand(1, 1, 3, heads, 1, device=DEV, generator=g) * 4 + 0.5
            return (x * mag).to(torch.bfloat16)

        self.txt, self.img = qkv(n_txt), qkv(n_img)
        self.weights = [(torch.rand(128, device=DEV, generator=g) * 2).to(torch.bfloat16) for _ in range(4)]
        angles = torch.rand(n_txt + n_img, 64, device=DEV, generator=g) * 6.3
        self.cos = angles.cos().repeat_interleave(2, dim=1).contiguous()
        self.sin = angles.sin().repeat_interleave(2, dim=1).contiguous()

    def role(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.txt[:, :, i], self.img[:, :, i]

    def qk_args(self, i: int) -> tuple:
        """qk_norm_rope's arguments for q (i = 0) or k (i = 1)."""
        txt, img = self.role(i)
        return txt, img, self.weights[2 * i], self.weights[2 * i + 1], self.cos, self.sin, EPS

    def bf16(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The lossless chain's q, k and joint v (the runtime's layouts)."""
        q = qk_norm_rope(*self.qk_args(0), is_head_major("q"))
        k = qk_norm_rope(*self.qk_args(1), is_head_major("k"))
        txt_v, img_v = self.role(2)
        n_txt = txt_v.shape[1]
        v = empty_heads(1, n_txt + img_v.shape[1], *txt_v.shape[2:], dtype=txt_v.dtype, device=DEV,
                        head_major=is_head_major("v"))  # fmt: skip
        v[:, :n_txt].copy_(txt_v)
        v[:, n_txt:].copy_(img_v)
        return q, k, v

    def fp8(self) -> tuple[Fp8Heads, Fp8Heads, Fp8Heads]:
        """The producers' e4m3 q, k, v (the high tier's chain)."""
        q = qk_norm_rope_fp8(*self.qk_args(0), is_head_major("q"))
        k = qk_norm_rope_fp8(*self.qk_args(1), is_head_major("k"))
        return q, k, heads_fp8(*self.role(2), is_head_major("v"))


def attention_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """float64 attention of (B, L, H, D) inputs, `chunk` heads at a time (the 2048² scores do not fit at once)."""
    return torch.cat(
        [attention_fp32(q[:, :, h : h + chunk], k[:, :, h : h + chunk], v[:, :, h : h + chunk], torch.float64)
         for h in range(0, q.shape[2], chunk)],
        dim=2,
    )  # fmt: skip


def fp8_reference_chunked(q: Fp8Heads, k: Fp8Heads, v: Fp8Heads, chunk: int = 4) -> torch.Tensor:
    """`fp8_attention_reference(..., fp8_probabilities=True)` `chunk` heads at a time."""

    def part(x: Fp8Heads, h: int) -> Fp8Heads:
        return Fp8Heads(x.data[:, :, h : h + chunk], x.descale[:, h : h + chunk])

    return torch.cat(
        [fp8_attention_reference(part(q, h), part(k, h), part(v, h), fp8_probabilities=True)
         for h in range(0, q.data.shape[2], chunk)],
        dim=2,
    )  # fmt: skip


def flashinfer_fp8() -> Callable[[Fp8Heads, Fp8Heads, Fp8Heads], torch.Tensor] | str:
    """FlashInfer's e4m3 single prefill (its FA3 path) on batch row 0, or why it is not available."""
    try:
        import flashinfer  # type: ignore[import-not-found]
    except Exception as e:  # not installed, or its JIT dependencies missing
        return f"flashinfer unavailable: {type(e).__name__}: {e}"

    def run(q: Fp8Heads, k: Fp8Heads, v: Fp8Heads) -> torch.Tensor:
        o = flashinfer.single_prefill_with_kv_cache(
            q.data[0], k.data[0], v.data[0], scale_q=q.descale[0], scale_k=k.descale[0],
            scale_v=v.descale[0], o_dtype=torch.bfloat16, backend="fa3",
        )  # fmt: skip
        return o[None]

    return run


def same_codes(a: Fp8Heads, b: Fp8Heads) -> bool:
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(
        a.descale, b.descale
    )


@torch.no_grad()
def bench_ops(iters: int) -> None:
    ops: dict[str, object] = {}
    RESULTS["ops"] = ops
    fi = flashinfer_fp8()
    if isinstance(fi, str):
        print(fi, flush=True)
        ops["flashinfer"] = fi
    for name, (heads, n_txt, n_img) in SHAPES.items():
        p = Projections(heads, n_txt, n_img)
        row: dict[str, object] = {}
        ops[name] = row
        with use_fused("lossless"):
            q, k, v = p.bf16()
        with use_fused("high"):
            q8, k8, v8 = p.fp8()
        eager = tuple(quantize_heads_reference(t) for t in (q, k, v))
        row["producers_equal_eager"] = all(same_codes(a, b) for a, b in zip((q8, k8, v8), eager, strict=True))

        def chain_bf16(p: Projections = p) -> torch.Tensor:
            with use_fused("lossless"):
                return sdpa(*p.bf16())

        def chain_fp8(p: Projections = p) -> torch.Tensor:
            with use_fused("high"):
                return backends.fa3_fp8_attention(*p.fp8())

        def chain_fp8_eager(p: Projections = p) -> torch.Tensor:
            with use_fused("lossless"):
                return backends.fa3_fp8_attention(*(quantize_heads_reference(t) for t in p.bf16()))

        def producers_bf16(p: Projections = p) -> object:
            with use_fused("lossless"):
                return p.bf16()

        def producers_fp8(p: Projections = p) -> object:
            with use_fused("high"):
                return p.fp8()

        arms: dict[str, Callable[[], object]] = {
            "cuDNN SDPA bf16": partial(sdpa, q, k, v),
            "FA3 bf16": partial(backends.fa3_attention, q, k, v),
            "FA3 e4m3": partial(backends.fa3_fp8_attention, q8, k8, v8),
            "chain bf16 (producers + SDPA)": chain_bf16,
            "chain e4m3, producers + FA3": chain_fp8,
            "chain e4m3, eager quantization + FA3": chain_fp8_eager,
            "producers bf16 (q, k, joint v)": producers_bf16,
            "producers e4m3 (q, k, v)": producers_fp8,
        }
        for layout, what in ((False, "token-major"), (True, "head-major")):  # the e4m3 codes' storage A/B

            def chain_layout(p: Projections = p, layout: bool = layout) -> torch.Tensor:
                with use_fused("high"), head_major_layout(layout):
                    return backends.fa3_fp8_attention(*p.fp8())

            arms[f"chain e4m3, producers + FA3, q, k, v {what}"] = chain_layout
        if not isinstance(fi, str):
            arms["FlashInfer e4m3"] = partial(fi, q8, k8, v8)
        ms: dict[str, float | str] = {}
        for label, fn in arms.items():
            try:
                ms[label] = cuda_time(fn, iters=iters)
            except Exception as e:  # one arm failing (FlashInfer's JIT) leaves the others
                ms[label] = f"{type(e).__name__}: {e}"
        row["ms"] = ms

        ref = attention_fp64(q, k, v)
        k_smooth = quantize_heads_reference(k, smooth=True)
        err: dict[str, float | str] = {
            "cuDNN SDPA bf16": relative_error(sdpa(q, k, v), ref),
            "FA3 bf16": relative_error(backends.fa3_attention(q, k, v), ref),
            "FA3 e4m3": relative_error(backends.fa3_fp8_attention(q8, k8, v8), ref),
            "FA3 e4m3, K smoothed": relative_error(backends.fa3_fp8_attention(q8, k_smooth, v8), ref),
            "e4m3 reference, P in e4m3": relative_error(fp8_reference_chunked(q8, k8, v8), ref),
        }
        if not isinstance(fi, str):
            try:
                err["FlashInfer e4m3"] = relative_error(fi(q8, k8, v8), ref)
            except Exception as e:
                err["FlashInfer e4m3"] = f"{type(e).__name__}: {e}"
        row["error_vs_fp64"] = err
        del ref
        free_cuda()
        print(f"[{name}] producers torch.equal to eager: {row['producers_equal_eager']}", flush=True)
        for label, t in ms.items():
            print(f"  {label:<40} {t:.3f} ms" if isinstance(t, float) else f"  {label:<40} {t}", flush=True)
        for label, e in err.items():
            print(
                f"  error {label:<34} {e:.3%}" if isinstance(e, float) else f"  error {label}: {e}",
                flush=True,
            )


@torch.no_grad()
def bench_step(name: str, iters: int, size: int = 1024, static: bool = True) -> None:
    """One step of `name` at `size`² (512 text tokens), each arm a new CUDA graph (the attention backend is read
    at capture); `static`: also the FP8 arms with static input scales (this step's ranges)."""
    flux1 = name == "flux1-dev"
    n_img = (size // 16) ** 2
    if flux1:
        ref, ours = flux1_pair()
        img, img_ids, txt, txt_ids, t, y, g = flux1_step_inputs(n_img)
        extra: tuple = (y,)
    else:
        cfg, kw = FLUX2_MODELS[name.removeprefix("flux2-")]
        ref, ours = flux2_pair(cfg, kw)
        img, img_ids, txt, txt_ids, t, g = flux2_step_inputs(cfg, n_img)
        extra = ()
    del ref
    free_cuda()
    pe = ours.rope(txt_ids, img_ids)
    rows: dict[str, object] = {}
    RESULTS[f"step {name}" + ("" if size == 1024 else f" {size}²")] = rows
    name = name if size == 1024 else f"{name} {size}²"

    def arm(label: str, tier: str, attention: str, expected: torch.Tensor | None) -> torch.Tensor:
        def step(x: torch.Tensor, tt: torch.Tensor, gg: torch.Tensor | None) -> torch.Tensor:
            with use_fused(tier), backends.attention_backend(attention):  # type: ignore[arg-type]
                return ours(x, img_ids, txt, txt_ids, tt, *extra, gg, pe=pe)

        graphed = GraphedDenoiser(step)
        backends.reset_attention_record()
        out = graphed(img, t, g)
        out = graphed(img, t, g)  # captured
        record = backends.attention_record()
        ms = cuda_time(lambda: graphed(img, t, g), iters=iters)
        err = None if expected is None else relative_error(out, expected)
        rows[label] = {"step_ms": ms, "attention": record, "error_vs_bf16_lossless": err}
        shown = "-" if err is None else f"{err:.3%}"
        print(
            f"[{name}] {label}: {ms:.1f} ms, attention {record.get('attention')}, error {shown}", flush=True
        )
        return out.clone()

    want = arm("bf16 lossless + graph", "lossless", "auto", None)
    arm("bf16 high + graph, SDPA", "high", "sdpa", want)
    arm("bf16 high + graph, FP8 attention", "high", "fa3-fp8", want)
    keep_bf16_attention(ours, first=1, last=1)
    arm("bf16 high + graph, FP8 attention but the first and last blocks", "high", "fa3-fp8", want)
    keep_bf16_attention(ours)
    # each projection's max |input| over this step, for the static-scale arms below (max calibration on one step)
    ranges, remove = record_input_ranges(ours)
    with torch.no_grad(), use_fused("lossless"):
        ours(img, img_ids, txt, txt_ids, t, *extra, g, pe=pe)
    remove()
    quantize_model(ours, torch.bfloat16)
    free_cuda()
    arm("fp8 high + graph, SDPA", "high", "sdpa", want)
    arm("fp8 high + graph, FP8 attention", "high", "fa3-fp8", want)
    keep_bf16_attention(ours, first=1, last=1)
    arm("fp8 high + graph, FP8 attention but the first and last blocks", "high", "fa3-fp8", want)
    keep_bf16_attention(ours)
    if not static:
        return
    # static input scales (a calibrated checkpoint's kind): the producers write e4m3 with no row absmax pass
    set_static_input_scales(ours, ranges)
    arm("fp8 static lossless + graph, SDPA", "lossless", "sdpa", want)
    arm("fp8 static high + graph, FP8 attention", "high", "fa3-fp8", want)
    # the weights as a ModelOpt checkpoint stores them: the tensorwise GEMM instead of the row-wise one
    per_tensor_weights(ours)
    free_cuda()
    arm("fp8 static, per-tensor weights, high + graph, FP8 attention", "high", "fa3-fp8", want)


def per_tensor_weights(model: torch.nn.Module) -> None:
    """Requantize each per-output-channel e4m3 weight with one scale (from its dequantized values: a second
    rounding, so the error grows a little; the speed is a per-tensor checkpoint's)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module.weight_scale.ndim == 1:
            dequantized = module.weight.float() * module.weight_scale[:, None]
            module.weight, module.weight_scale = quantize_per_tensor(dequantized)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", action="store_true", help="one attention call at FLUX shapes")
    ap.add_argument("--steps", action="store_true", help="the FLUX step with and without FP8 attention")
    ap.add_argument(
        "--models", default="flux1-dev", help="for --steps: flux1-dev, flux2-dev (comma separated)"
    )
    ap.add_argument(
        "--sizes", default="1024", help="for --steps: image sides (comma separated), e.g. 1024,2048"
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-static", action="store_true", help="for --steps: skip the static-scale FP8 arms")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not require_cuda("bench_fp8_attention.py"):
        return 1
    obstacle = backends.fp8_obstacle(DEV, torch.bfloat16, 128)
    if obstacle is not None:
        print(f"FP8 attention cannot run here: {obstacle}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    both = not (args.ops or args.steps)
    if args.ops or both:
        bench_ops(args.iters)
    if args.steps or both:
        for name in args.models.split(","):
            for size in (int(v) for v in args.sizes.split(",")):
                bench_step(name, args.iters, size, static=not args.no_static)
    finish_run(RESULTS, t0, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
