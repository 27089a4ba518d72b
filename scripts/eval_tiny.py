"""Score the built-in tiny models on caption combinations their training never saw.

Renders every prompt of `tiny_scenes.held_out_prompts()` (a held-out shape colour / background colour pair, or a
held-out shape / place pair; one shape each) through `Pipeline.from_pretrained(model)` at the model's defaults,
and scores each picture with `tiny_scenes.score`: background colour (the border's palette colour), shape
colour (the most common other palette colour), place (where the pixels of the asked colour sit). Prints the
three rates per model beside the targets (95 %, 90 %, 80 %) and, with `--grid`, writes a labelled grid of some
of the pictures.

The JSON report lists each held-out miss with the colour the shape came out in. `--seen` adds the same rates
on prompts of the training distribution, and `--sweeps N` renders N sweeps of one noise through every place
word and measures how far the shape follows them (`place_following`: 0 when the place words change nothing):
together they tell a word the model never learned from one it does not generalise.

Usage: python scripts/eval_tiny.py [--model tiny --model tiny-flux2] [--seeds 2] [--json out.json] [--grid g.png]
       python scripts/eval_tiny.py --seen --sweeps 4
       python scripts/eval_tiny.py --dtype bfloat16; python scripts/eval_tiny.py --fp8-text   # FP8 encoders vs bf16
       python scripts/eval_tiny.py --device cuda --variants   # lossless bf16 against high and FP8, PSNR + scores
       python scripts/eval_tiny.py --text-swap   # whose colours spliced text states paint

`--variants` is the image-quality check of the paths that are not bit-exact: the held-out prompts rendered by
the bf16 `lossless` model, then by `quality="high"`, by the DiT quantized to FP8 at load (`fp8=True`), and by
both, each scored as above and compared with the lossless pictures of the same noise (PSNR over all of them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_scenes import (
    COLOURS,
    HELD_OUT_COLOURS,
    SEEN_COLOURS,
    Scene,
    background_colour,
    background_cut,
    centre,
    held_out_prompts,
    hit_rates,
    place_following,
    place_sweeps,
    round_trip,
    scores,
    seen_prompts,
    shape_colour,
)

from flux_runtime.pipeline import Pipeline

TARGETS = {"background": 0.95, "colour": 0.90, "place": 0.80}


def render_all(
    pipe: Pipeline, scenes: list[Scene], seeds: list[int], batch: int = 8, ran: dict | None = None,
    guidance: float | None = None,
) -> list[np.ndarray]:  # fmt: skip
    """One picture per scene at the model's defaults (`guidance`: another guidance or CFG scale), scene `k`
    drawn with generator seed `seeds[k]`; `ran` receives the provenance's tier and precision (what actually
    ran, e.g. `lossless` where `high` needs a GPU)."""
    images: list[np.ndarray] = []
    extra = {} if guidance is None else {"guidance": guidance}
    for i in range(0, len(scenes), batch):
        gens = [torch.Generator().manual_seed(s) for s in seeds[i : i + batch]]
        out = pipe([s.caption for s in scenes[i : i + batch]], generator=gens, output_type="np", **extra)
        images.extend(out.images)
        if ran is not None:
            ran.update(quality=out.info["quality"], precision=out.info["precision"])
    return images


def misses(images: list[np.ndarray], scenes: list[Scene], scored: list | None = None) -> list[dict]:
    """The pictures that got something wrong: the caption, what was wrong, and the colour the shape came out
    in (None: no shape found), so a run's log says where the colour binding fails, not only how often."""
    out = []
    results = scores(images, scenes) if scored is None else scored
    for image, scene, got in zip(images, scenes, results, strict=True):
        wrong = [k for k in ("background", "colour", "place") if getattr(got, k) is False]
        if wrong:
            out.append(
                {
                    "caption": scene.caption,
                    "wrong": wrong,
                    "shape_colour": shape_colour(image, scene.background),
                }
            )
    return out


def evaluate(
    model: str, scenes: list[Scene], seeds: int, device: str, batch: int = 8, *,
    dtype: torch.dtype = torch.float32, fp8_text: bool = False, seen: bool = False, sweeps: int = 0,
    quality: str = "lossless", fp8: bool = False, autoencoder: bool = False, guidance: float | None = None,
    swap: bool = False,
) -> tuple[dict, list]:  # fmt: skip
    """Rates of correct background, shape colour and place over `scenes` x `seeds` pictures (`fp8_text`: the
    text encoders quantized to FP8 at load, which computes in bf16). `seen` adds the same rates on prompts of
    the training distribution (`seen_prompts`); `sweeps` adds that many place sweeps (`place_sweeps`: one
    noise, every place word), whose `place_following` is 0 for a model that ignores place words.
    `autoencoder` adds the rates of the held-out and seen scenes rendered and passed through the model's
    autoencoder alone (`tiny_scenes.round_trip`): what its decoder can paint at all. `swap` adds `text_swap`'s
    counts (where the model reads a held-out pair's colours from)."""
    pipe = Pipeline.from_pretrained(
        model,
        device=device,
        dtype=dtype,
        fp8_text=fp8_text,
        quality=quality,
        fp8=fp8,  # type: ignore[arg-type]
    )
    start = time.time()
    asked = [s for _ in range(seeds) for s in scenes]
    noise = [1000 * seed + i for seed in range(seeds) for i in range(len(scenes))]
    ran: dict = {}
    images = render_all(pipe, asked, noise, batch, ran, guidance)
    scored = scores(images, asked)
    report: dict = {**hit_rates(images, asked, scored), "images": len(images), "ran": ran}
    report["misses"] = misses(images, asked, scored)
    report["seconds_per_image"] = round((time.time() - start) / len(images), 2)
    report.update(weights=pipe.weights_id, dtype=str(dtype).removeprefix("torch."), fp8_text=fp8_text)
    report.update(quality=quality, fp8=fp8, guidance=guidance)
    if seen:
        familiar = seen_prompts(len(scenes))
        report["seen"] = hit_rates(render_all(pipe, familiar, list(range(len(familiar))), batch), familiar)
    if autoencoder:  # the same scenes rendered and passed through the autoencoder alone
        size = pipe.default_size
        trip = {"held_out": scenes, "seen": seen_prompts(len(scenes))}
        report["autoencoder"] = {
            k: hit_rates(round_trip(pipe.vae.encoder, pipe.vae.decoder, v, size), v) for k, v in trip.items()
        }
    if swap:
        report["text_swap"] = text_swap(pipe, scenes, batch)
    if sweeps:
        follow = []
        for k, group in enumerate(place_sweeps(sweeps)):
            pictures = render_all(pipe, group, [7000 + k] * len(group), batch=len(group))
            found = [centre(p, s.colour) for p, s in zip(pictures, group, strict=True)]
            follow.append(place_following(found, group))
        report["place_following"] = round(float(np.mean(follow)), 3)
    return report, list(zip([s.caption for s in asked], images, strict=True))


def swap_donors(scene: Scene) -> tuple[Scene, Scene]:
    """Two training-distribution captions for a held-out colour pair's scene: the same shape colour on another
    background (the first seen pair in palette order), and another shape colour on the same background."""
    seen = set(SEEN_COLOURS)
    other_bg = next(b for b in COLOURS if (scene.colour, b) in seen)
    other_colour = next(c for c in COLOURS if (c, scene.background) in seen)
    return replace(scene, background=other_bg), replace(scene, colour=other_colour)


def _caption_ids(pipe: Pipeline, text: str) -> list[int]:
    """The ids of the token sequence the DiT reads: T5's (FLUX.1) or Qwen3's chat-templated (FLUX.2)."""
    te = pipe.text_encoder
    if hasattr(te, "t5_tokenizer"):
        return te.t5_tokenizer(text)["input_ids"]
    return te.tokenize([text], pipe.default_max_sequence_length)[0][0].tolist()


def background_start(pipe: Pipeline, scene: Scene) -> int:
    """How many tokens the caption shares with its words before " on a(n) <colour> ..."."""
    whole, head = _caption_ids(pipe, scene.caption), _caption_ids(pipe, background_cut(scene.caption))
    return next(i for i, (x, y) in enumerate(zip(whole, head, strict=False)) if x != y)


def prefix_change(pipe: Pipeline, scenes: list[Scene]) -> dict[str, float]:
    """How much the text encoder's states of a caption's words before its background phrase change when only
    the background colour changes, and when only the shape colour does: the mean relative L2 change per token
    over `scenes`, each against every other background (other shape colour) a scene can take. A causal encoder
    (FLUX.2's Qwen3) gives 0 for the background; a bidirectional one (FLUX.1's T5) mixes it into every token."""
    te, length = pipe.text_encoder, pipe.default_max_sequence_length
    changes: dict[str, list[float]] = {"background": [], "colour": []}
    for scene in scenes:
        others = {
            "background": [
                replace(scene, background=b) for b in COLOURS if b not in (scene.colour, scene.background)
            ],
            "colour": [
                replace(scene, colour=c) for c in COLOURS if c not in (scene.colour, scene.background)
            ],
        }
        for key, group in others.items():
            k = min(background_start(pipe, s) for s in [scene, *group])
            out = te.encode(
                [s.caption for s in [scene, *group]], max_sequence_length=length, device=pipe.device
            )
            own, rest = out.prompt_embeds[:1, :k].float(), out.prompt_embeds[1:, :k].float()
            changes[key].append(((rest - own).norm(dim=-1) / own.norm(dim=-1)).mean().item())
    return {key: round(float(np.mean(v)), 4) for key, v in changes.items()}


def spliced_text(
    pipe: Pipeline, scenes: list[Scene], shape_donors: list[Scene], background_donors: list[Scene]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Text embeddings for `scenes` with the sequence spliced at the background phrase: the tokens before it
    from each shape donor's caption (the same words; FLUX.1's T5 is bidirectional, so their states also carry
    the donor's background, while FLUX.2's Qwen3 is causal and gives the scene's own states), the rest from each
    background donor's caption. FLUX.1's CLIP pooled state comes from the scene's own caption (FLUX.2 has
    none: None). With the scenes as their own donors this is the scenes' own embedding."""
    te, length = pipe.text_encoder, pipe.default_max_sequence_length
    flux1 = hasattr(te, "t5_tokenizer")

    def encode(group: list[Scene]) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = te.encode([s.caption for s in group], max_sequence_length=length, device=pipe.device)
        return out.prompt_embeds, (out.pooled_prompt_embeds if flux1 else None)

    _, pooled = encode(scenes)
    shape_part, _ = encode(shape_donors)
    background_part, _ = encode(background_donors)
    out = background_part.clone()
    for i, (scene, donor) in enumerate(zip(scenes, background_donors, strict=True)):
        k, kb = background_start(pipe, scene), background_start(pipe, donor)
        out[i, :k] = shape_part[i, :k]
        tail = background_part[i, kb:]  # the background phrase on, padded with its last state if it is short
        out[i, k:] = torch.cat([tail, tail[-1:].expand(max(0, length - k - tail.shape[0]), -1)])[: length - k]
    return out, pooled


def text_swap(pipe: Pipeline, scenes: list[Scene], batch: int = 8) -> dict:
    """Where a model reads a held-out pair's colours from: each held-out colour scene rendered from
    `spliced_text` with its `swap_donors`, then counted: shapes painted in the asked colour or in the background
    donor's, backgrounds in the asked colour or the shape donor's. A DiT that reads the shape colour from the
    colour word's tokens and the background from the background phrase's paints what was asked; one that
    reads each from wherever the text encoder mixed it in paints the donors' colours."""
    pairs = [s for s in scenes if (s.colour, s.background) in HELD_OUT_COLOURS]
    donors = [swap_donors(s) for s in pairs]
    embeds, pooled = spliced_text(pipe, pairs, [d[0] for d in donors], [d[1] for d in donors])
    counts = dict.fromkeys(("shape_asked", "shape_donor", "background_asked", "background_donor"), 0)
    for i in range(0, len(pairs), batch):
        gens = [torch.Generator().manual_seed(j) for j in range(i, i + batch)][: len(pairs) - i]
        extra = {} if pooled is None else {"pooled_prompt_embeds": pooled[i : i + batch]}
        out = pipe(prompt_embeds=embeds[i : i + batch], generator=gens, output_type="np", **extra)
        for image, scene, (shape_donor, background_donor) in zip(
            out.images, pairs[i : i + batch], donors[i : i + batch], strict=True
        ):
            bg = background_colour(image)
            fg = shape_colour(image, bg)
            counts["shape_asked"] += fg == scene.colour
            counts["shape_donor"] += fg == background_donor.colour
            counts["background_asked"] += bg == scene.background
            counts["background_donor"] += bg == shape_donor.background
    return {"pictures": len(pairs), **counts, "prefix_change": prefix_change(pipe, pairs)}


VARIANTS = {"high": ("high", False), "fp8": ("lossless", True), "fp8 high": ("high", True)}


def psnr(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """PSNR in dB of pictures `b` against `a` over all their pixels (8-bit; inf when equal)."""
    mse = float(np.mean([((x.astype(np.float64) - y) ** 2).mean() for x, y in zip(a, b, strict=True)]))
    return float("inf") if mse == 0 else 10 * float(np.log10(255**2 / mse))


def compare_variants(model: str, scenes: list[Scene], device: str) -> dict:
    """The held-out scores of bf16 `lossless` and of each entry of `VARIANTS`, each variant's PSNR against the
    lossless pictures of the same noise and its scores' change (percentage points)."""
    base, base_pics = evaluate(model, scenes, 1, device, dtype=torch.bfloat16)
    ref = [image for _, image in base_pics]
    out: dict = {"lossless": {k: base[k] for k in TARGETS} | {"ran": base["ran"]}}
    for name, (quality, fp8) in VARIANTS.items():
        rates, pics = evaluate(model, scenes, 1, device, dtype=torch.bfloat16, quality=quality, fp8=fp8)
        out[name] = {k: rates[k] for k in TARGETS} | {"ran": rates["ran"]}
        out[name]["psnr_db"] = round(psnr(ref, [image for _, image in pics]), 2)
        out[name]["change_points"] = {k: round(100 * (rates[k] - base[k]), 1) for k in TARGETS}
    return out


def write_grid(rows: list[tuple[str, list[tuple[str, np.ndarray]]]], path: Path, cell: int = 128) -> None:
    """A PNG grid: one row per model, each picture with its prompt written under it."""
    from PIL import Image, ImageDraw

    cols = max(len(p) for _, p in rows)
    text_h = 30
    grid = Image.new("RGB", (90 + cols * cell, len(rows) * (cell + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for r, (name, pics) in enumerate(rows):
        y = r * (cell + text_h)
        draw.text((4, y + cell // 2), name, fill="black")
        for c, (caption, image) in enumerate(pics):
            x = 90 + c * cell
            grid.paste(Image.fromarray(image).resize((cell, cell), Image.LANCZOS), (x, y))
            words, lines = caption.split(), [""]
            for w in words:
                lines[-1:] = [lines[-1] + " " + w] if len(lines[-1]) + len(w) < 24 else [lines[-1], w]
            for k, line in enumerate(lines[:3]):
                draw.text((x + 2, y + cell + k * 9), line.strip(), fill="black")
    grid.save(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="built-in model names [default: tiny, tiny-flux2]")
    ap.add_argument("--seeds", type=int, default=1, help="pictures per prompt")
    ap.add_argument("--per-pair", type=int, default=3, help="prompts per held-out combination")
    ap.add_argument(
        "--prompt-seed",
        type=int,
        default=1234,
        help="draws the held-out prompts' shapes, sizes and places (another seed: other prompts of the same pairs)",
    )
    ap.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="the held-out prompts at this guidance (FLUX.1) or CFG scale",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--fp8-text", action="store_true", help="text encoders in FP8 (quantized at load; implies bfloat16)"
    )
    ap.add_argument(
        "--seen",
        action="store_true",
        help="also score prompts of the training distribution (no held-out pair)",
    )
    ap.add_argument(
        "--sweeps",
        type=int,
        default=0,
        help="also measure how far shapes follow their place words over N sweeps (one noise, every place)",
    )
    ap.add_argument(
        "--autoencoder",
        action="store_true",
        help="also score the held-out and seen scenes passed through the autoencoder alone (no DiT)",
    )
    ap.add_argument(
        "--variants",
        action="store_true",
        help="also render in bf16 lossless, high, FP8 and FP8 high: scores and PSNR against lossless",
    )
    ap.add_argument(
        "--text-swap",
        action="store_true",
        help="also render the held-out colour pairs from text sequences spliced at the background phrase "
        "(swap_donors, spliced_text) and count whose colours come out",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--grid", type=Path, default=None)
    args = ap.parse_args()
    scenes = held_out_prompts(args.per_pair, args.prompt_seed)
    report, rows = {}, []
    for model in args.model or ["tiny", "tiny-flux2"]:
        dtype = torch.bfloat16 if args.fp8_text else getattr(torch, args.dtype)
        rates, pictures = evaluate(
            model, scenes, args.seeds, args.device, dtype=dtype, fp8_text=args.fp8_text, seen=args.seen,
            sweeps=args.sweeps, autoencoder=args.autoencoder, guidance=args.guidance, swap=args.text_swap,
        )  # fmt: skip
        report[model] = rates
        rows.append((model, pictures[:: max(1, len(pictures) // 8)][:8]))
        line = ", ".join(
            f"{k} {rates[k]:.1%} (target {t:.0%}{'' if rates[k] >= t else ', MISSED'})"
            for k, t in TARGETS.items()
        )
        print(f"{model}: {rates['images']} held-out pictures, {rates['seconds_per_image']} s each: {line}")
        if "seen" in rates:
            seen = rates["seen"]
            print(f"{model}: seen prompts: " + ", ".join(f"{k} {v:.1%}" for k, v in seen.items()))
        for k, row in rates.get("autoencoder", {}).items():
            print(
                f"{model}: autoencoder round trip, {k} scenes: "
                + ", ".join(f"{n} {v:.1%}" for n, v in row.items())
            )
        if "text_swap" in rates:
            swap = rates["text_swap"]
            print(
                f"{model}: spliced text, {swap['pictures']} pictures: shape in the asked colour {swap['shape_asked']}, "
                f"in the background donor's {swap['shape_donor']}; background asked {swap['background_asked']}, "
                f"the shape donor's {swap['background_donor']}"
            )
            change = swap["prefix_change"]
            print(
                f"{model}: text states before the background phrase change by {change['background']:.0%} when only "
                f"the background colour changes, by {change['colour']:.0%} when only the shape colour does"
            )
        if "place_following" in rates:
            print(
                f"{model}: place following {rates['place_following']:.2f} (1 follows the place words, 0 ignores them)"
            )
        if args.variants:
            rates["variants"] = compare_variants(model, scenes, args.device)
            for name, row in rates["variants"].items():
                print(f"{model} {name}: " + ", ".join(f"{k} {row[k]:.1%}" for k in TARGETS), end="")
                print(f", PSNR {row['psnr_db']} dB vs lossless" if "psnr_db" in row else "", end="")
                print(f" (ran {row['ran']['quality']}, {row['ran']['precision']})" if "ran" in row else "")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"targets": TARGETS, "held_out_prompts": len(scenes), **report}, indent=1)
        )
    if args.grid is not None:
        write_grid(rows, args.grid)


if __name__ == "__main__":
    main()
