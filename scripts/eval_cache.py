"""Choose and check step-cache defaults on the trained tiny models: held-out scores against the fraction skipped.

For each built-in tiny model, renders the held-out prompts of `eval_tiny` (a held-out colour pair, or shape and
place pair, in every caption) without a cache, then with each step-cache policy of a sweep (first-block
thresholds, taylor orders and refreshes), one noise per prompt shared by all. Each row: the three rates
(background colour, shape colour, place), their mean's change against no cache in points, the PSNR of the
pictures against the uncached ones, and the fraction of transformer calls skipped (every branch counted).

Usage: python scripts/eval_cache.py [--model tiny] [--per-pair 3] [--json out.json]
       python scripts/eval_cache.py --policy first-block:threshold=0.2 --policy taylor:refresh=3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_tiny import TARGETS, psnr
from tiny_scenes import Scene, held_out_prompts, hit_rates

from flux_runtime.pipeline import Pipeline

SWEEP = (
    "first-block:threshold=0.05",
    "first-block:threshold=0.1",
    "first-block:threshold=0.15",
    "first-block:threshold=0.2",
    "first-block:threshold=0.3",
    "taylor:order=1,refresh=2",
    "taylor:order=2,refresh=2",
    "taylor:order=1,refresh=3",
    "taylor:order=2,refresh=3",
)


def render(
    pipe: Pipeline, scenes: list[Scene], cache: str | None, batch: int
) -> tuple[list[np.ndarray], float]:
    """The scenes' pictures (scene k from noise seed k) and the fraction of transformer calls skipped."""
    images: list[np.ndarray] = []
    calls = computed = 0
    for i in range(0, len(scenes), batch):
        chunk = scenes[i : i + batch]
        gens = [torch.Generator().manual_seed(i + k) for k in range(len(chunk))]
        out = pipe([s.caption for s in chunk], generator=gens, output_type="np", cache=cache or "off")
        images.extend(out.images)
        record = out.info["cache"]
        if isinstance(record, dict):
            for branch in record.get("branches", {"cond": record}).values():
                calls += branch["calls"]
                computed += len(branch["computed_steps"])
    return images, (1 - computed / calls) if calls else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="built-in model names [default: tiny, tiny-flux2]")
    ap.add_argument(
        "--policy", action="append", help=f"cache specs to score [default: {len(SWEEP)} of a sweep]"
    )
    ap.add_argument("--per-pair", type=int, default=3, help="prompts per held-out combination")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    scenes = held_out_prompts(args.per_pair)
    report: dict = {"held_out_prompts": len(scenes)}
    for model in args.model or ["tiny", "tiny-flux2"]:
        pipe = Pipeline.from_pretrained(model, device=args.device, dtype=torch.float32)
        t0 = time.time()
        base, _ = render(pipe, scenes, None, args.batch)
        base_rates = hit_rates(base, scenes)
        base_mean = float(np.mean([base_rates[k] for k in TARGETS]))
        rows = {"off": {**base_rates, "skipped": 0.0, "seconds": round(time.time() - t0, 1)}}
        print(f"{model}: no cache: " + ", ".join(f"{k} {base_rates[k]:.1%}" for k in TARGETS), flush=True)
        for spec in args.policy or SWEEP:
            t0 = time.time()
            images, skipped = render(pipe, scenes, spec, args.batch)
            rates = hit_rates(images, scenes)
            mean = float(np.mean([rates[k] for k in TARGETS]))
            row = {
                **rates,
                "mean_change_points": round(100 * (mean - base_mean), 2),
                "skipped": round(skipped, 3),
                "psnr_db": round(psnr(base, images), 2),
                "seconds": round(time.time() - t0, 1),
            }
            rows[spec] = row
            print(
                f"{model}: {spec}: skipped {skipped:.0%}, "
                + ", ".join(f"{k} {rates[k]:.1%}" for k in TARGETS)
                + f", mean {row['mean_change_points']:+.1f} points, PSNR {row['psnr_db']} dB",
                flush=True,
            )
        report[model] = {"steps": pipe.default_steps, "policies": rows}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
