#!/usr/bin/env python3
"""The whole image in `high` against `lossless`: how far each approximation moves the pixels, and what it saves.

Issue 36's error budget and image target are about a full picture, not a step: after 28 steps at 1024² the
`high` image (FP8 attention where the GPU and the `fa3-fwd` package allow it) must stay at ≥ 40 dB PSNR of the
`lossless` one (same weights, prompt and seed), and FLUX.1-dev's FP8 `high` image (denoise and decode) should take
≤ 2.0 s. This runs a FLUX pipeline folder (e.g. the random full-size FLUX.1-dev that `bench_cold_start.py build
/tmp/cold` writes) once in bf16 and once quantized to FP8 at load, each call with CUDA graphs after a warm call
of the same arm, and prints per arm: the call's time (encode of a cached prompt, denoise, decode), the denoising
loop's time, the attention backend the provenance records and the PSNR of its 8-bit picture against the first
arm's, bf16 `lossless` (inf: identical).

Arms: bf16 `lossless` (the reference); bf16 `high` with attention as the runtime chooses it (`auto`) and with
SDPA forced; FP8 `high`, `auto` and SDPA; FP8 `lossless`; then, unless `--no-static`, the FP8 model with static
input scales (`set_static_input_scales`) from max calibration over one bf16 call of another prompt and seed at
the same size and steps (`record_input_ranges`, as `flux-convert quantize` calibrates), `high` and `lossless`.

Usage: python3 scripts/eval_high_image.py FOLDER [--size 1024] [--steps 28] [--device cuda] [--json out.json].
On the CPU (`--device cpu`, e.g. with the built-in `tiny` and a small size) it runs the same arms, the FP8 ones
with `--dtype bf16`, as a check of the script itself: the timings mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.kernels.attention_backends import attention_backend
from flux_runtime.pipeline import Pipeline
from flux_runtime.weights.fp8 import set_static_input_scales
from flux_runtime.weights.fp8_export import record_input_ranges

PROMPT = "a red fox in the snow, golden hour, photograph"
CALIBRATION_PROMPT = "a street in Tokyo at night with neon signs, rain"  # not the evaluated prompt


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of 8-bit picture `b` against `a` (inf when equal)."""
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * float(np.log10(255**2 / mse))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(pipe: Pipeline, quality: str, attention: str, size: int, steps: int) -> tuple[dict, np.ndarray]:
    """One warm call, then the timed one: its times, what ran, and its picture as (H, W, 3) uint8."""
    marks: dict[int, float] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "denoise" and done in (0, total):
            sync(pipe.device)
            marks[done] = time.perf_counter()

    def call() -> object:
        with attention_backend(attention):  # type: ignore[arg-type]
            return pipe(
                PROMPT, height=size, width=size, num_steps=steps, seed=0, quality=quality, progress=progress,
                output_type="np",
            )  # fmt: skip

    call()  # warm: kernels, graphs, the prompt's encoding
    sync(pipe.device)
    t0 = time.perf_counter()
    out = call()
    sync(pipe.device)
    call_s = time.perf_counter() - t0
    info = out.info  # type: ignore[attr-defined]
    image = np.asarray(out.images[0])  # type: ignore[attr-defined]
    if image.dtype != np.uint8:
        image = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
    row = {
        "call_s": round(call_s, 4),
        "loop_s": round(marks[steps] - marks[0], 4),
        "precision": info.get("precision"),
        "quality": info.get("quality"),
        "attention": info.get("attention"),
        "cuda_graphs": info.get("cuda_graphs"),
    }
    return row, image


def calibrate(pipe: Pipeline, size: int, steps: int) -> dict[str, float]:
    """Each block projection's max |input| over one lossless call of `CALIBRATION_PROMPT` (seed 1)."""
    ranges, remove = record_input_ranges(pipe.transformer)
    graphs, pipe.cuda_graphs = pipe.cuda_graphs, False  # a graph's replay would run no hook
    try:
        pipe(CALIBRATION_PROMPT, height=size, width=size, num_steps=steps, seed=1, output_type="latent")
    finally:
        remove()
        pipe.cuda_graphs = graphs
    if not ranges:
        raise SystemExit("eval_high_image.py: the calibration call recorded no projection's input")
    return ranges


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="a FLUX pipeline folder, a model name or `tiny`")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-static", action="store_true", help="skip the FP8 arms with static input scales")
    ap.add_argument(
        "--dtype", choices=("bf16", "fp32"), default=None,
        help="default: bf16 on a GPU, fp32 on the CPU; the FP8 arms run with bf16",
    )  # fmt: skip
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("eval_high_image.py: no CUDA GPU here (give --device cpu to check the script)", file=sys.stderr)
        return 1
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype]
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    base = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    arms = {base: [("lossless", "auto"), ("high", "auto"), ("high", "sdpa")]}
    if dtype == torch.bfloat16:  # FP8 computes in bf16 between its GEMMs
        arms["fp8"] = [("high", "auto"), ("high", "sdpa"), ("lossless", "auto")]
    static = "fp8" in arms and not args.no_static
    if static:
        arms["fp8 static"] = [("high", "auto"), ("lossless", "auto")]
    rows: dict[str, dict] = {}
    reference: np.ndarray | None = None
    ranges: dict[str, float] = {}
    pipe = None
    for precision, cases in arms.items():
        if precision == "fp8 static":  # the FP8 pipeline of the arms before, its input scales now static
            assert pipe is not None
            if set_static_input_scales(pipe.transformer, ranges) == 0:
                raise SystemExit("eval_high_image.py: no FP8 projection took a static input scale")
            pipe._graphed.clear()  # graphs captured before replay the per-row quantization
        else:
            pipe = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            pipe = Pipeline.from_pretrained(args.folder, device=device, dtype=dtype, fp8=precision == "fp8")
        for quality, attention in cases:
            label = f"{precision} {quality}" + ("" if attention == "auto" else f", attention {attention}")
            row, image = run_arm(pipe, quality, attention, args.size, args.steps)
            if reference is None:
                reference = image
            row["psnr_vs_lossless_db"] = psnr(reference, image)
            rows[label] = row
            print(f"{label}: {json.dumps(row)}", flush=True)
        if static and precision == base:
            ranges = calibrate(pipe, args.size, args.steps)
    report = {"folder": str(args.folder), "size": args.size, "steps": args.steps, "arms": rows}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
