"""`flux-gen`: one click command: parse, call `Pipeline`, save PNGs with their provenance.

FLUX.1, FLUX.2 and FLUX.3 alike (`Pipeline.from_pretrained` picks by the checkpoint); FLUX.2 and FLUX.3 also
edit with `--image` reference images, whose paths and pixel fingerprints go into the provenance so `--replay` can
refuse a reference that has gone or changed. Library errors become one line and exit 1 here, and only
here (`--debug` shows the traceback instead). Nothing heavy is imported at module level, so that even a
Ctrl-C while torch loads ends in one line. Every check that needs no model (output folder, device, prompt,
step count, guidance, reference images) runs before any weights are read. `--prompts FILE` makes one such call
per line of FILE with one load, every line checked first (the file's reading is `prompts_file`'s).
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from flux_runtime.cli.errors import one_line_errors
from flux_runtime.cli.timings import Stopwatch
from flux_runtime.command_help import DOCS_PAGE, GroupedCommand
from flux_runtime.registry import MODEL_NAMES as MODEL_CHOICES

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# What a --replay takes from the image's record; given beside --replay, these are refused, not ignored.
REPLAYED = (
    "prompt",
    "model",
    "quality",
    "steps",
    "guidance",
    "seed",
    "width",
    "height",
    "max_sequence_length",
    "dtype",
    "image",
    "num_images",
    "mask",
    "strength",
    "control_image",
    "negative_prompt",
    "true_cfg",
    "max_area",
    "no_auto_resize",
    "lora",
    "no_upsample",
    "prompt_upsampler",
    "upsampler_prompts",
    "boxes",
)
# --help's headings (click's parameter names); an option not named here is listed under "Other options"
GROUPS = (
    ("Prompt and output", "prompt prompts out overwrite num_images seed replay"),
    ("Model", "model loras fp8 fp8_text vae text_encoder text_encoder_2 download_only offline"),
    ("Sampling", "steps guidance width height quality max_sequence_length negative_prompt true_cfg"),
    ("Input images", "image mask strength control_image max_area no_auto_resize"),
    ("FLUX.3 prompt upsampler", "no_upsample prompt_upsampler upsampler_prompts boxes"),
    ("Device and memory", "device dtype memory offload_text_encoders vae_tile no_cuda_graphs gpus"),
)


class _Progress:
    """tqdm bars on stderr for encoding, denoising and decoding (at `position` 1 under --prompts' bar)."""

    def __init__(self, enabled: bool, position: int | None = None) -> None:
        self.enabled, self.position, self.bar, self.stage = enabled, position, None, None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(
                total=total,
                desc=f"{stage:>8}",
                unit="step" if stage == "denoise" else "",
                leave=False,
                position=self.position,
            )
        assert self.bar is not None
        self.bar.n = done
        self.bar.refresh()
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar, self.stage = None, None


def _output_paths(out: Path, n: int, seed: int, overwrite: bool) -> list[Path]:
    """The PNG paths to write, in a folder that exists (created for a folder --out) and takes new files."""
    if out.is_dir() or str(out).endswith(("/", "\\")) or out.suffix == "":
        _make_folder(out)
        folder = out
        paths = [out / f"flux-{seed}-{i}.png" for i in range(n)]
    elif out.suffix.lower() != ".png":
        raise click.ClickException(f"--out {out}: images are written as PNG; give a .png file or a folder")
    else:
        folder = out.parent
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise click.ClickException(f"--out {out}: {folder} {what}; create it or choose another --out")
        paths = [out] if n == 1 else [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(n)]
    _check_writable(out, folder)
    _refuse_existing(paths, overwrite)
    return paths


def _prompts_paths(out: Path, names: list[list[str]], overwrite: bool) -> list[list[Path]]:
    """--prompts: each line's PNG paths (`names`) in the --out folder, made if missing, taking new files."""
    if not out.is_dir() and (out.exists() or out.suffix.lower() == ".png"):
        raise click.ClickException(
            f"--out {out}: with --prompts, --out is a folder (one PNG per image, named by line); give a folder"
        )
    _make_folder(out)
    _check_writable(out, out)
    paths = [[out / name for name in line] for line in names]
    _refuse_existing([p for line in paths for p in line], overwrite)
    return paths


def _make_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.ClickException(f"--out {out}: cannot make this folder ({e.strerror or e})") from None


def _check_writable(out: Path, folder: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise click.ClickException(f"--out {out}: cannot write in {folder} ({e.strerror or e})") from None


def _refuse_existing(paths: list[Path], overwrite: bool) -> None:
    """One error naming the files that exist (the first three of many), unless they are to be replaced."""
    clash = [str(p) for p in paths if p.exists()]
    if clash and not overwrite:
        shown = ", ".join(clash[:3]) + (f" and {len(clash) - 3} more" if len(clash) > 3 else "")
        verb = "exists" if len(clash) == 1 else "exist"
        raise click.ClickException(f"{shown} already {verb}; pass --overwrite or choose another --out")


@click.command(
    cls=GroupedCommand,
    groups=GROUPS,
    epilog=f"Every option in full: {DOCS_PAGE} (flux-gen).",
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True, "max_content_width": 120},
)
@click.option("--prompt", "-p", type=str, help="What to draw.")
@click.option(
    "--prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help='A file of prompts, one run a line. A line is a prompt or a JSON object of per-image options ({"prompt", '
    '"seed", "width", ...}, named like the options); the model loads once and each line is one run into the '
    "--out folder [default: the current folder], e.g. 0007-a-red-fox.png.",
)
@click.option(
    "--model",
    "-m",
    default="tiny",
    help=f"A preset, a cached model id or a path. The presets: {', '.join(MODEL_CHOICES)}.",
)
@click.option(
    "--quality",
    type=click.Choice(["lossless", "high"]),
    default="lossless",
    help="lossless: diffusers' bits; high: faster. high adds approximate fusions, each kept within an error "
    "budget (docs/quality.md).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=None,
    help="Denoising steps, at most 1000. [default: FLUX.1 28 dev, 4 schnell; FLUX.2 50 (distilled klein is "
    "made for 4)]",
)
@click.option(
    "--guidance",
    type=click.FloatRange(min=0),
    default=None,
    help="Guidance scale. FLUX.1 / FLUX.2 dev: embedded guidance; klein: CFG scale (CFG when > 1, not on "
    "distilled models) [default: FLUX.1 3.5 (the built-in tiny 2.5), FLUX.2 4.0; schnell and distilled klein "
    "ignore it].",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    help="The noise's seed.",
)
@click.option(
    "--width",
    type=click.IntRange(min=1),
    default=None,
    help="Width in pixels, a multiple of 16. [default: 1024, tiny models 256; with --image the first image's]",
)
@click.option(
    "--height",
    type=click.IntRange(min=1),
    default=None,
    help="Height in pixels, a multiple of 16. [default: 1024, tiny models 256; with --image the first image's]",
)
@click.option(
    "--image",
    "-i",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    multiple=True,
    help="An input image. FLUX.2 / FLUX.3: a reference image to edit or draw from (repeatable; FLUX.3 up to "
    "10). FLUX.1: the image for img2img or, with --mask, inpainting (once).",
)
@click.option(
    "--mask",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="FLUX.1 inpainting mask. White where --image is repainted (its size).",
)
@click.option(
    "--strength",
    type=float,
    default=None,
    help="FLUX.1 img2img / inpainting: how much of --image is redrawn. In (0, 1] [default: 0.6].",
)
@click.option(
    "--control-image",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="FLUX.1 Depth / Canny: the depth map or edge image.",
)
@click.option(
    "--max-area",
    type=click.IntRange(min=1),
    default=None,
    help="FLUX.1 Kontext: output pixels. The size keeps --width / --height at this area [default: 1024²].",
)
@click.option(
    "--no-auto-resize",
    is_flag=True,
    help="FLUX.1 Kontext: keep --image's size (rounded). Without it, the nearest preferred Kontext "
    "resolution.",
)
@click.option("--negative-prompt", type=str, default=None, help="FLUX.1 true CFG: what to steer away from.")
@click.option(
    "--true-cfg",
    type=click.FloatRange(min=1),
    default=1.0,
    help="FLUX.1 true CFG scale. With --negative-prompt and > 1 each step runs twice.",
)
@click.option(
    "--no-upsample",
    is_flag=True,
    help="FLUX.3: encode the prompt as given. Without it, the prompt upsampler rewrites it first where the "
    "model has one.",
)
@click.option(
    "--prompt-upsampler",
    type=str,
    default=None,
    help="FLUX.3: the prompt upsampler's folder or cached id. [default: "
    "black-forest-labs/flux-3-image-klein-pup for flux3-klein*; none for tiny-flux3 and tiny-flux3-random]",
)
@click.option(
    "--upsampler-prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="FLUX.3: the upsampler's system prompts (JSON). [default: system_prompts.json in its folder]",
)
@click.option(
    "--boxes",
    type=str,
    default=None,
    metavar="JSON|FILE",
    help="FLUX.3: layout boxes for the prompt upsampler. A JSON list (inline, or a .json file) of "
    '{"id", "desc", "bbox"} or, with --image, {"id", "desc", "from": "target" | "ref_image_N", "src_bbox", '
    '"tgt_bbox"}; boxes [y_min, x_min, y_max, x_max] in 0-1.',
)
@click.option(
    "--lora",
    "loras",
    multiple=True,
    metavar="PATH[:SCALE]",
    help="A LoRA fused at SCALE (repeatable). PATH is a .safetensors file, a folder or a cached id; SCALE "
    "defaults to 1.",
)
@click.option("--num-images", type=click.IntRange(min=1), default=1, help="Images per prompt, one batch.")
@click.option(
    "--max-sequence-length",
    type=click.IntRange(1, 512),
    default=None,
    help="Text tokens (T5, Mistral, Qwen3). [default: 512; the tiny models 64, what they were trained with]",
)
@click.option("--device", default=None, help="cuda, cuda:1, cpu [default: cuda if available].")
@click.option(
    "--dtype",
    type=click.Choice(list(DTYPES)),
    default=None,
    help="Model dtype [default: bf16 on GPU, fp32 on CPU].",
)
@click.option(
    "--out", "-o", type=click.Path(path_type=Path), default=Path("flux.png"), help="A .png file or a folder."
)
@click.option("--overwrite", is_flag=True, help="Replace existing output files.")
@click.option(
    "--fp8",
    is_flag=True,
    help="Quantize the transformer to FP8 at load. Its block projections, from bf16; FP8 checkpoints need no "
    "flag.",
)
@click.option(
    "--fp8-text",
    is_flag=True,
    help="Quantize the text encoders to FP8 at load. Their layers (T5, Qwen3, Qwen3-VL, Mistral), from bf16; "
    "--fp8 includes this.",
)
@click.option(
    "--memory",
    default="auto",
    show_default=True,
    help="GPU memory budget (24GB, 16GB, ...) or auto. The fastest plan that fits (resident, offload-text, "
    "swap, stream); 'auto' is the GPU's free memory. Plans move weights, never change the pixels.",
)
@click.option(
    "--offload-text-encoders", is_flag=True, help="Keep the text encoders off the GPU except while encoding."
)
@click.option(
    "--vae-tile",
    type=click.IntRange(min=4),
    default=None,
    help="Decode in tiles of N latent pixels. N a multiple of 4, at least 16: bounds memory for large images.",
)
@click.option(
    "--no-cuda-graphs",
    is_flag=True,
    help="Run the denoiser eagerly. By default CUDA graphs are replayed when the process makes several calls "
    "(--prompts); one call runs eagerly, as capturing costs more than it saves over one image.",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    help="Spread the image over N GPUs. Sequence parallelism; with CFG, the two passes on two halves: starts "
    "N ranks itself, or is one rank under torchrun. With --device cpu: N CPU processes (gloo).",
)
@click.option("--vae", type=str, default=None, help="Autoencoder file/folder for a BFL transformer file.")
@click.option(
    "--text-encoder",
    type=str,
    default=None,
    help="Text encoder folder or id for a BFL transformer file. CLIP-L (FLUX.1) or the Mistral / Qwen3 model "
    "(FLUX.2).",
)
@click.option(
    "--text-encoder-2", type=str, default=None, help="T5-XXL folder or id for a BFL transformer file."
)
@click.option(
    "--replay",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Regenerate the image recorded in a flux-gen PNG.",
)
@click.option(
    "--download-only",
    is_flag=True,
    help="Fetch what --model reads into the Hugging Face cache, and exit. Only the files the load reads, from the "
    "Hub; says what was fetched; no --prompt needed.",
)
@click.option(
    "--offline",
    is_flag=True,
    help="Never touch the network (as HF_HUB_OFFLINE=1). The model must be a path or in the local Hugging Face "
    "cache; without it a model id is fetched on first use.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.option(
    "--timings",
    is_flag=True,
    help="Print where the time went, at the end. Start-up, imports, load, each image and save, and the peak "
    "memory.",
)
@click.option("--debug", is_flag=True, help="On an error, show the Python traceback instead of one line.")
def main(**opts: Any) -> None:
    """Generate images with FLUX; a model id is fetched from the Hugging Face Hub on first use."""
    logging.basicConfig(level=logging.WARNING, format="flux-gen: %(message)s")
    opts["_watch"] = Stopwatch()
    rank = _launched_rank(opts)
    with one_line_errors(opts["debug"]), _rank_errors(rank, opts["debug"]):
        if opts["prompts"] is not None:
            _prompts_file_options(opts, click.get_current_context())
        elif opts["replay"] is not None:
            _apply_replay(opts, click.get_current_context())
        if opts["download_only"]:
            _download_only(opts)
            return
        if not opts["prompt"] and opts["prompts"] is None:
            raise click.UsageError("--prompt is required (or --replay an image, or --prompts a file)")
        if rank is None and (opts["gpus"] or 1) > 1:
            _spawn_ranks(opts)
        opts["_rank"] = rank
        _generate(opts)
        if opts["timings"] and rank in (None, 0):
            click.echo(f"flux-gen: {opts['_watch'].line()}", err=True)


def _launched_rank(opts: dict[str, Any]) -> int | None:
    """This process's rank when it is one of a parallel run (torchrun, or `--gpus` starting it), else None."""
    import os

    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if opts["gpus"] is None:
        opts["gpus"] = world
    elif opts["gpus"] != world:
        raise click.ClickException(f"--gpus {opts['gpus']}, but this run was started with {world} ranks")
    return int(os.environ["RANK"]) if world > 1 else None


def _spawn_ranks(opts: dict[str, Any]) -> None:
    """Check what needs no model, then run this command as --gpus ranks and exit with the run's status."""
    from flux_runtime.parallel.launch import relaunch_command, supervise

    _plan(opts, main_rank=True)
    _fetch(opts)  # once, here: the ranks read the cache
    status = supervise(relaunch_command(), opts["gpus"], say=lambda m: click.echo(f"flux-gen: {m}", err=True))
    sys.exit(status)


@contextmanager
def _rank_errors(rank: int | None, debug: bool) -> Iterator[None]:
    """One message per failed run, not one per rank: rank 0 alone reports the errors every rank meets (bad
    input, files); a rank that only lost its peers leaves the report to the `--gpus` supervisor (exit
    LOST_PEER); any other error is reported by the rank it happened on, naming it."""
    if rank is None or debug:
        yield
        return
    from flux_runtime.cli.errors import is_foreseen, one_line
    from flux_runtime.parallel.launch import LOST_PEER, is_supervised

    try:
        yield
    except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, KeyboardInterrupt):
        if rank == 0:
            raise
        sys.exit(1)
    except Exception as e:
        lost = type(e).__name__ == "LostRank"
        if lost and is_supervised():
            sys.exit(LOST_PEER)
        if rank != 0 and (is_foreseen(e) or lost):
            sys.exit(1)
        raise click.ClickException(one_line(e) if rank == 0 else f"rank {rank}: {one_line(e)}") from None


def _apply_replay(opts: dict[str, Any], ctx: click.Context) -> None:
    """Take the recorded settings from the --replay PNG; refuse options beside it that it would override."""
    from flux_runtime.pipeline.provenance import read_provenance

    given = [
        name
        for name in REPLAYED
        if ctx.get_parameter_source("loras" if name == "lora" else name)
        in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise click.ClickException(
            f"--replay takes {flags} from the image it remakes; drop {'it' if len(given) == 1 else 'them'} "
            "(or generate without --replay)"
        )
    png = opts["replay"]
    rec = read_provenance(png)
    if not isinstance(rec["prompt"], str):
        raise click.ClickException(
            f"cannot replay {png}: it was made from a list of prompts or from embeddings"
        )
    if rec["seed"] is None:
        raise click.ClickException(f"cannot replay {png}: it was made with a torch.Generator, not a seed")
    opts.update(
        prompt=rec["prompt"],
        model=rec["model"],
        quality=rec["quality"],
        steps=rec["num_steps"],
        guidance=rec["guidance"],
        seed=rec["seed"],
        width=rec["width"],
        height=rec["height"],
        max_sequence_length=rec["max_sequence_length"],
        dtype={v: k for k, v in DTYPES.items()}[rec["dtype"]],
        fp8=bool(rec.get("fp8_at_load", False)),
        fp8_text=bool(rec.get("fp8_text", False)),
        image=_replay_images(opts["replay"], rec.get("reference_images") or []),
        negative_prompt=rec.get("negative_prompt"),
        true_cfg=rec.get("true_cfg_scale", 1.0),
        strength=rec.get("strength"),
    )
    if rec.get("reference_crop"):  # FLUX.3 cropped back to its reference: the size comes from it again
        opts.update(width=None, height=None)
    if rec.get("variant") == "kontext":  # the recorded size is the rescaled one: keep it as the area
        opts.update(max_area=rec["width"] * rec["height"], no_auto_resize=rec.get("auto_resize") is False)
    inputs = rec.get("input_images") or {}
    for role, opt in (("image", "image"), ("mask_image", "mask"), ("control_image", "control_image")):
        if role in inputs:
            (path,) = _replay_images(opts["replay"], [inputs[role]])
            opts[opt] = (path,) if opt == "image" else path
    if "upsample" in rec:  # FLUX.3: the caption that was encoded, never the upsampler again
        opts["_upsampled_prompt"] = rec.get("upsampled_prompt")
        opts["no_upsample"] = rec.get("upsampled_prompt") is None
    opts["_loras"] = _replay_loras(png, rec.get("loras") or [])
    opts["_replay_weights"] = rec.get("weights")
    opts["_replay_index"] = rec.get("index", 0)
    # the whole recorded batch runs again: a batch's size changes its GEMMs' rounding, so image i of a
    # smaller batch is not image i of the recorded one (by one level in some pixels on the CPU)
    opts["_replay_batch"] = rec.get("num_images", opts["_replay_index"] + 1)
    served = rec.get("served_batch")  # flux-serve ran this image in one call with other requests' images
    opts["_served_batch"] = served if isinstance(served, int) and not isinstance(served, bool) else None


def parse_lora(spec: str) -> tuple[str, float]:
    """`PATH[:SCALE]` → (path, scale); a suffix that is not a number belongs to the path."""
    import math

    path, _, tail = spec.rpartition(":")
    if path:
        try:
            scale = float(tail)
        except ValueError:
            return spec, 1.0
        if not math.isfinite(scale):
            raise click.ClickException(f"--lora {spec}: the scale {tail} must be a finite number")
        return path, scale
    return spec, 1.0


def _replay_loras(png: Path, recorded: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """The LoRAs a PNG was made with, each still at its path with the same bytes."""
    import hashlib

    out = []
    for lo in recorded:
        path = Path(lo["path"])
        if not path.is_file():
            raise click.ClickException(f"cannot replay {png}: its LoRA {path} is gone")
        if hashlib.sha256(path.read_bytes()).hexdigest() != lo["sha256"]:
            raise click.ClickException(f"cannot replay {png}: its LoRA {path} has changed since")
        out.append((str(path), float(lo["scale"])))
    return out


def _replay_images(png: Path, recorded: list[dict[str, Any]]) -> tuple[Path, ...]:
    """The reference images a FLUX.2 PNG was made from, each still at its path with the same pixels."""
    from flux_runtime.pipeline.flux2 import image_fingerprint

    paths = []
    for k, ref in enumerate(recorded):
        if not ref.get("path"):
            raise click.ClickException(
                f"cannot replay {png}: reference image {k} was passed in memory, not as a file"
            )
        path = Path(ref["path"])
        if not path.is_file():
            raise click.ClickException(f"cannot replay {png}: its reference image {path} is gone")
        if image_fingerprint(_open_image(path)) != ref.get("sha256"):
            raise click.ClickException(f"cannot replay {png}: its reference image {path} has changed since")
        paths.append(path)
    return tuple(paths)


def _open_image(path: Path) -> Any:
    """A reference image, decoded now (so a bad file fails here); PIL keeps `path` as its `filename`."""
    from PIL import Image

    try:
        image = Image.open(path)
        image.load()
    except Image.DecompressionBombError as e:
        raise click.ClickException(f"cannot read image {path}: {e} Shrink it first.") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # UnidentifiedImageError is an OSError
        raise click.ClickException(f"cannot read image {path}: {e}") from None
    from flux_runtime.sampling.reference_images import wide_pixels

    wide = wide_pixels(str(path), image)  # refused now, before any weights are read
    if wide is not None:
        raise click.ClickException(wide)
    return image


def _fetch(opts: dict[str, Any]) -> list[Any]:
    """Fetch what the model, its parts, the prompt upsampler and the LoRAs read and the local cache lacks
    (nothing with --offline or HF_HUB_OFFLINE=1); the repos' plans (`weights.download.RepoPlan`)."""
    from flux_runtime.weights.download import downloads_allowed

    if not downloads_allowed(not opts["offline"]):
        return []
    from flux_runtime.pipeline.downloads import fetch_model

    if opts["quiet"]:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    else:
        logging.getLogger("flux_runtime.weights.download").setLevel(logging.INFO)  # "fetching ..." lines
    loras = opts.get("_loras") or [parse_lora(spec) for spec in opts["loras"]]
    return fetch_model(
        opts["model"],
        vae=opts["vae"],
        text_encoder=opts["text_encoder"],
        text_encoder_2=opts["text_encoder_2"],
        upsampler=False if opts["no_upsample"] else opts["prompt_upsampler"] or True,
        loras=[path for path, _ in loras],
    )


def _download_only(opts: dict[str, Any]) -> None:
    """--download-only: fetch, then one line per repo (what its plan holds and what was fetched)."""
    from flux_runtime.weights.download import downloads_allowed, size_text

    if not downloads_allowed(not opts["offline"]):
        raise click.ClickException(
            "--download-only fetches from the Hugging Face Hub: drop --offline (and unset HF_HUB_OFFLINE)"
        )
    plans = _fetch(opts)
    if not plans:
        click.echo(f"flux-gen: nothing to fetch for {opts['model']} (built in, or local files)", err=True)
    for plan in plans:
        fetched = f"{size_text(plan.to_fetch)} fetched" if plan.missing else "all already in the cache"
        click.echo(f"flux-gen: {plan.describe()}; {fetched}", err=True)


def _check_early(opts: dict[str, Any]) -> None:
    """The call arguments that need no model, checked before any weights are read (the pipeline checks
    them again, with the model's defaults and its size multiple)."""
    from flux_runtime.pipeline.checks import (
        check_guidance,
        check_prompts,
        check_size,
        check_steps,
        check_vae_tile,
    )
    from flux_runtime.weights.builtin import size_multiple

    check_prompts(opts["prompt"])
    if opts["height"] is not None or opts["width"] is not None:
        # the multiple where the registry knows the model's autoencoder; else the pipeline checks it once loaded
        multiple = (None if opts["vae"] is not None else size_multiple(opts["model"])) or 0
        other = max(multiple, 16)  # stands in for the side not given
        check_size(opts["height"] or other, opts["width"] or other, multiple)
    check_vae_tile(opts["vae_tile"])
    if opts["steps"] is not None:
        check_steps(opts["steps"], opts["steps"])
    if opts["guidance"] is not None:
        check_guidance(opts["guidance"], opts["guidance"])
    strength = opts.get("strength")
    if strength is not None and not 0 < strength <= 1:
        raise click.ClickException(f"--strength {strength} must be in (0, 1]")
    if opts.get("mask") is not None and not opts["image"]:
        raise click.ClickException("--mask needs --image (the image to inpaint)")
    if opts.get("strength") is not None and not opts["image"]:
        raise click.ClickException("--strength needs --image (img2img or inpainting)")


@dataclass
class _Job:
    """One pipeline call: its options (the command line's, or a --prompts line's over them), the PNGs it
    writes (none on ranks other than 0) and, for a line of --prompts, its FILE:LINE, which starts its errors."""

    opts: dict[str, Any]
    paths: list[Path] = field(default_factory=list)
    where: str | None = None

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Our errors (bad input, files) inside the block, as one line starting with FILE:LINE."""
        if self.where is None:
            yield
            return
        from flux_runtime.cli.errors import is_foreseen, one_line

        try:
            yield
        except click.ClickException as e:
            raise click.ClickException(f"{self.where}: {e.format_message()}") from None
        except Exception as e:
            if not is_foreseen(e):
                raise
            raise click.ClickException(f"{self.where}: {one_line(e)}") from None


def _prompts_file_options(opts: dict[str, Any], ctx: click.Context) -> None:
    """--prompts: refuse --prompt and --replay beside it; --out is a folder, the current one unless given."""
    for other, why in (("prompt", "its lines are the prompts"), ("replay", "replay each PNG on its own")):
        if opts[other] is not None:
            raise click.ClickException(f"--{other} and --prompts exclude each other: {why}")
    if ctx.get_parameter_source("out") == ParameterSource.DEFAULT:
        opts["out"] = Path(".")


def _plan(opts: dict[str, Any], main_rank: bool) -> list[_Job]:
    """The calls to make, each checked as far as it can be with no model, with the PNG paths they write:
    one call, or one per line of --prompts (every line checked before the first weights are read)."""
    if opts["prompts"] is None:
        _check_early(opts)
        n = 1 if opts["replay"] is not None else opts["num_images"]
        job = _Job(opts, _output_paths(opts["out"], n, opts["seed"], opts["overwrite"]) if main_rank else [])
        _check_inputs(opts, set())
        return [job]
    from flux_runtime.cli.prompts_file import read_prompts

    names = {o[2:].replace("-", "_") for p in main.params for o in p.opts if o.startswith("--")}
    lines = read_prompts(opts["prompts"], names)
    jobs, opened = [], set()
    for line in lines:
        job = _Job({**opts, **line.options}, where=f"{opts['prompts']}:{line.number}")
        with job.errors():
            _check_early(job.opts)
            _check_inputs(job.opts, opened)
        jobs.append(job)
    if main_rank:
        files = [line.file_names(job.opts["num_images"]) for line, job in zip(lines, jobs, strict=True)]
        for job, paths in zip(jobs, _prompts_paths(opts["out"], files, opts["overwrite"]), strict=True):
            job.paths = paths
    return jobs


def _check_inputs(opts: dict[str, Any], opened: set[Path]) -> None:
    """The input images (each path once in `opened`) decode and the boxes hold, before any weights are read."""
    for path in (*opts["image"], opts["mask"], opts["control_image"]):
        if path is not None and path.resolve() not in opened:
            _open_image(path.resolve())
            opened.add(path.resolve())
    boxes = _read_boxes(opts["boxes"])
    if boxes is not None:
        from flux_runtime.pipeline.flux3_upsample import check_boxes

        check_boxes(boxes, len(opts["image"]))


def _generate(opts: dict[str, Any]) -> None:
    """Check every call, load the model once, then run and save each call; as one rank of a parallel run
    (`opts["_rank"]`), only rank 0 shows progress and saves."""
    import torch

    from flux_runtime.pipeline import Pipeline
    from flux_runtime.pipeline.checks import check_device
    from flux_runtime.pipeline.flux2 import Flux2Pipe
    from flux_runtime.pipeline.flux3 import Flux3Pipe
    from flux_runtime.pipeline.sources import model_family
    from flux_runtime.weights.lora_formats import LoraError, check_lora_file

    watch: Stopwatch = opts["_watch"]
    rank = opts.get("_rank")
    main_rank = rank in (None, 0)
    jobs = _plan(opts, main_rank)
    loras = opts.get("_loras") or [parse_lora(spec) for spec in opts["loras"]]
    device = check_device(opts["device"])
    replaying = opts["replay"] is not None
    dtype_name = opts["dtype"] or (
        "bf16" if device.type == "cuda" or opts["fp8"] or opts["fp8_text"] else "fp32"
    )
    if rank is None:  # the ranks of a parallel run read the cache (`--gpus` fetched before starting them)
        with watch.lap("download"):
            _fetch(opts)
    for path, _ in loras:  # a missing or damaged LoRA fails before the model loads
        try:
            check_lora_file(path)
        except LoraError as e:
            raise click.ClickException(f"--lora: {str(e).removeprefix('LoRA ')}") from None

    # options of another family fail now, before anything loads
    family = model_family(
        opts["model"],
        vae=opts["vae"],
        text_encoder=opts["text_encoder"],
        text_encoder_2=opts["text_encoder_2"],
    )
    name = {"flux1": "FLUX.1", "flux2": "FLUX.2", "flux3": "FLUX.3"}[family]
    for job in jobs:
        with job.errors():
            if family != "flux1":
                _refuse_flux1_options(job.opts, name)
            if family != "flux3":
                _refuse_flux3_options(job.opts, name)

    # torch, the pipeline and the checks before the load
    watch.laps["imports"] = time.perf_counter() - watch.start - sum(watch.laps.values())
    with watch.lap("load"):
        pipe = Pipeline.from_pretrained(
            opts["model"],
            device=device,
            dtype=getattr(torch, DTYPES[dtype_name]),
            quality=opts["quality"],
            vae=opts["vae"],
            text_encoder=opts["text_encoder"],
            text_encoder_2=opts["text_encoder_2"],
            # capture pays off over several calls only (one image: eager measured 0.3 s faster on the H200)
            cuda_graphs=not opts["no_cuda_graphs"] and len(jobs) > 1,
            offload_text_encoders=opts["offload_text_encoders"],
            fp8=opts["fp8"],
            # --fp8 covers the text encoders; a replay takes exactly what the record says
            fp8_text=opts["fp8_text"] if replaying else opts["fp8"] or opts["fp8_text"],
            # a parallel run keeps every model resident (memory plans are for one GPU)
            memory=opts["memory"] if rank is None else "auto",
            parallel=None if rank is None else opts["gpus"],
            download=False,  # fetched above
        )
    if not opts["quiet"] and main_rank:
        click.echo(f"flux-gen: {pipe.memory_plan.describe()}", err=True)
    pipe.vae_tile = opts["vae_tile"]
    with watch.lap("load"):
        for path, scale in loras:
            pipe.load_lora(path, scale=scale)
    if main_rank and replaying and opts["_replay_weights"] not in (None, pipe.weights_id):
        click.echo(
            f"flux-gen: warning: the weights differ from the recorded ones ({opts['_replay_weights']}); "
            "the image will differ",
            err=True,
        )
    if main_rank and replaying and (opts["_served_batch"] or 1) > 1:
        click.echo(
            f"flux-gen: warning: this image was served in a batch of {opts['_served_batch']} images; the "
            "replay runs it alone and a batch's size changes the GEMMs' rounding, so pixels may differ slightly",
            err=True,
        )
    if isinstance(pipe, Flux3Pipe) and (
        opts["prompt_upsampler"] is not None or opts["upsampler_prompts"] is not None
    ):
        source = opts["prompt_upsampler"] or pipe.prompt_upsampler.source
        pipe.set_prompt_upsampler(source, prompts=opts["upsampler_prompts"])
    if not isinstance(pipe, (Flux2Pipe, Flux3Pipe)):
        for job in jobs:  # every line's FLUX.1 variant checks, before the first image is drawn
            with job.errors():
                _check_flux1_variant(pipe, job.opts)

    shown = main_rank and not opts["quiet"] and sys.stderr.isatty()
    many = opts["prompts"] is not None
    progress = _Progress(shown, position=1 if many else None)
    file_bar = None
    if shown and many:
        from tqdm import tqdm

        file_bar = tqdm(total=len(jobs), desc=" prompts", unit="prompt")
    try:
        for job in jobs:
            # errors of a parallel run pass unprefixed: _rank_errors tells a lost peer by its type
            with job.errors() if rank is None else nullcontext():
                with watch.lap(f"image {sum(k.startswith('image') for k in watch.laps) + 1}"):
                    out = _call(pipe, job.opts, progress)
                progress.close()
                if main_rank:  # rank 0 writes the images
                    with watch.lap("save"):
                        saved = _save(job, out)
                    for path in saved:
                        (file_bar.write if file_bar is not None else click.echo)(str(path))
            if file_bar is not None:
                file_bar.update()
    finally:
        if file_bar is not None:
            file_bar.close()


def _check_flux1_variant(pipe: Any, opts: dict[str, Any]) -> None:
    """The options a FLUX.1 model takes only in some variants, checked once the variant is known."""
    images = opts["image"]
    if images and pipe.variant == "text2img" and opts["strength"] is None and opts["mask"] is None:
        # a reference image to edit from is FLUX.2's (or Kontext's); FLUX.1 redraws an image on request
        raise click.ClickException(
            f"--image needs a FLUX.2 model; {opts['model']} is FLUX.1: for img2img give --strength, "
            "for inpainting --mask"
        )
    if len(images) > 1:
        raise click.ClickException("FLUX.1 takes one --image (img2img, inpainting, Kontext, Fill)")
    if pipe.variant != "kontext" and (opts["max_area"] is not None or opts["no_auto_resize"]):
        raise click.ClickException(
            f"--max-area and --no-auto-resize need a FLUX.1 Kontext model; {opts['model']} is not one"
        )


def _call(pipe: Any, opts: dict[str, Any], progress: _Progress) -> Any:
    """One pipeline call with `opts`: the same arguments whether they came from the command line alone or
    from a line of --prompts, so a line's pixels are those of the same options run alone."""
    from flux_runtime.pipeline.flux2 import Flux2Pipe
    from flux_runtime.pipeline.flux3 import Flux3Pipe

    images_in = [_open_image(p.resolve()) for p in opts["image"]]
    common = dict(
        height=opts["height"],
        width=opts["width"],
        num_steps=opts["steps"],
        guidance=opts["guidance"],
        seed=opts["seed"],
        max_sequence_length=opts["max_sequence_length"],
        num_images_per_prompt=opts["_replay_batch"] if opts["replay"] is not None else opts["num_images"],
        progress=progress,
    )
    if isinstance(pipe, Flux3Pipe):
        return pipe(
            opts["prompt"],
            image=images_in or None,
            upsample=False if opts["no_upsample"] else None,
            upsampled_prompt=opts.get("_upsampled_prompt"),
            boxes=_read_boxes(opts["boxes"]),
            **common,
        )
    if isinstance(pipe, Flux2Pipe):
        return pipe(opts["prompt"], image=images_in or None, **common)
    flux1_inputs = {
        name: _open_image(opts[opt].resolve())
        for name, opt in (("mask_image", "mask"), ("control_image", "control_image"))
        if opts[opt] is not None
    }
    if pipe.variant == "kontext":
        flux1_inputs.update(max_area=opts["max_area"], auto_resize=not opts["no_auto_resize"])
    return pipe(
        opts["prompt"],
        image=images_in[0] if images_in else None,
        strength=opts["strength"],
        negative_prompt=opts["negative_prompt"],
        true_cfg_scale=opts["true_cfg"],
        **flux1_inputs,
        **common,
    )


def _save(job: _Job, out: Any) -> list[Path]:
    """Write the call's images to `job.paths`, each with its provenance and its place in the call's batch."""
    from flux_runtime.pipeline.provenance import save_png

    opts = job.opts
    replaying = opts["replay"] is not None
    num_per_prompt = opts["_replay_batch"] if replaying else opts["num_images"]
    images = out.images[opts["_replay_index"] : opts["_replay_index"] + 1] if replaying else out.images
    for i, (image, path) in enumerate(zip(images, job.paths, strict=True)):
        info = {**out.info, "index": opts["_replay_index"] if replaying else i, "num_images": num_per_prompt}
        save_png(image, path, info, overwrite=opts["overwrite"])
    return job.paths


def _refuse_flux1_options(opts: dict[str, Any], family: str) -> None:
    """One error naming the FLUX.1-only options given for a model of another family."""
    flux1_only = [f for f, v in _flux1_options(opts).items() if v]
    if flux1_only:
        raise click.ClickException(
            f"{', '.join(flux1_only)} {'needs' if len(flux1_only) == 1 else 'need'} a FLUX.1 model; "
            f"{opts['model']} is {family}"
        )


def _flux1_options(opts: dict[str, Any]) -> dict[str, bool]:
    """The FLUX.1-only options and whether each was given."""
    return {
        "--mask": opts["mask"] is not None,
        "--strength": opts["strength"] is not None,
        "--control-image": opts["control_image"] is not None,
        "--max-area": opts["max_area"] is not None,
        "--no-auto-resize": opts["no_auto_resize"],
        "--negative-prompt": opts["negative_prompt"] is not None,
        "--true-cfg": opts["true_cfg"] != 1.0,
    }


def _read_boxes(value: str | list[Any] | None) -> Any:
    """--boxes: inline JSON (starting with '['), else a JSON file; one error if it is neither (a --prompts line
    may give the list itself). The boxes themselves are checked by the pipeline."""
    if value is None or isinstance(value, list):
        return value
    text, where = value, "--boxes"
    if not value.lstrip().startswith("["):
        path = Path(value)
        if not path.is_file():
            raise click.ClickException(
                f"--boxes {value}: neither a JSON list (starting with '[') nor a file; give the boxes inline "
                "or as a .json file"
            )
        try:
            text, where = path.read_text(encoding="utf-8"), f"--boxes {path}"
        except (OSError, UnicodeDecodeError) as e:
            raise click.ClickException(f"--boxes {path}: cannot read it ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise click.ClickException(f"{where}: not valid JSON ({e})") from None


def _refuse_flux3_options(opts: dict[str, Any], family: str) -> None:
    """One error naming the FLUX.3-only (prompt upsampler) options given for a model of another family."""
    given = [
        flag
        for flag, name in (
            ("--no-upsample", "no_upsample"),
            ("--prompt-upsampler", "prompt_upsampler"),
            ("--upsampler-prompts", "upsampler_prompts"),
            ("--boxes", "boxes"),
        )
        if opts[name]
    ]
    if given:
        verb = "needs" if len(given) == 1 else "need"
        raise click.ClickException(f"{', '.join(given)} {verb} a FLUX.3 model; {opts['model']} is {family}")


if __name__ == "__main__":  # how `--gpus N` runs each rank (and `torchrun -m flux_runtime.cli.gen`)
    main()
