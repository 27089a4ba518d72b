"""`flux-gen`'s options as one table: each option's names, value, help and default, under its --help heading.

`OPTIONS` holds them by heading, in the order --help lists them (rows of `command_help.option`); `PARAMS` are
the click options it makes and `GROUPS` the headings `GroupedCommand` prints them under (the table's last
part, "Other options", holds the options no heading names). A new option is one row here: --help,
docs/cli.md (`scripts/cli_reference.py`) and the names a `--prompts` line is told to move to the command
line follow from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from flux_runtime.command_help import FILE, FLAG, NO_DEFAULT, OTHER, option, table_groups, table_params
from flux_runtime.registry import MODEL_NAMES as MODEL_CHOICES

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class CacheSpec(click.ParamType):
    """A step-cache spec, checked as the command line is read; the value is the spec written in full."""

    name = "SPEC"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str | None:
        from flux_runtime.sampling.step_cache import CacheSpecError, parse_cache

        try:
            policy = parse_cache(value)
        except CacheSpecError as e:
            self.fail(str(e), param, ctx)
        return None if policy is None else policy.spec


class ControlRange(click.ParamType):
    """`START:END`, the fraction of the steps ControlNets act in, checked as the command line is read."""

    name = "START:END"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple:
        if isinstance(value, tuple):
            return value
        start, sep, end = str(value).partition(":")
        try:
            bounds = (float(start), float(end)) if sep else None
        except ValueError:
            bounds = None
        if bounds is None or not 0 <= bounds[0] < bounds[1] <= 1:
            self.fail(f"{value!r} is not START:END with 0 <= START < END <= 1 (e.g. 0:0.6)", param, ctx)
        return bounds


OPTIONS: dict[str, tuple[click.Option, ...]] = {
    "Prompt and output": (
        option("--prompt -p", str, "What to draw.", NO_DEFAULT),
        option(
            "--prompts",
            FILE,
            "A file of prompts, one run a line. A line is a prompt or a JSON object of per-image options "
            '({"prompt", "seed", "width", ...}, named like the options); the model loads once and each line '
            "is one run into the --out folder [default: the current folder], e.g. 0007-a-red-fox.png.",
        ),
        option("--out -o", click.Path(path_type=Path), "A .png file or a folder.", Path("flux.png")),
        option("--overwrite", FLAG, "Replace existing output files."),
        option("--num-images", click.IntRange(min=1), "Images per prompt, one batch.", 1),
        option("--seed", click.IntRange(min=0), "The noise's seed.", 0),
        option("--replay", FILE, "Regenerate the image recorded in a flux-gen PNG."),
    ),
    "Model": (
        option(
            "--model -m",
            str,
            f"A preset, a cached model id or a path. The presets: {', '.join(MODEL_CHOICES)}.",
            "tiny",
        ),
        option(
            "--lora loras",
            str,
            "A LoRA fused at SCALE (repeatable). PATH is a .safetensors file, a folder or a cached id; SCALE "
            "defaults to 1.",
            NO_DEFAULT,
            multiple=True,
            metavar="PATH[:SCALE]",
        ),
        option(
            "--controlnet controlnets",
            str,
            "A FLUX.1 ControlNet at SCALE (repeatable). Run in order, each with its --control-image; PATH is "
            "a diffusers folder or file (InstantX, Shakker-Labs, union), an XLabs file or a cached id; SCALE "
            "defaults to 1.",
            NO_DEFAULT,
            multiple=True,
            metavar="PATH[:SCALE]",
        ),
        option(
            "--fp8",
            FLAG,
            "Quantize the transformer to FP8 at load. Its block projections, from bf16; FP8 checkpoints need "
            "no flag.",
        ),
        option(
            "--fp8-text",
            FLAG,
            "Quantize the text encoders to FP8 at load. Their layers (T5, Qwen3, Qwen3-VL, Mistral), from "
            "bf16; --fp8 includes this.",
        ),
        option("--vae", str, "Autoencoder file/folder for a BFL transformer file."),
        option(
            "--text-encoder",
            str,
            "Text encoder folder or id for a BFL transformer file. CLIP-L (FLUX.1) or the Mistral / Qwen3 "
            "model (FLUX.2).",
        ),
        option("--text-encoder-2", str, "T5-XXL folder or id for a BFL transformer file."),
        option(
            "--download-only",
            FLAG,
            "Fetch what --model reads into the Hugging Face cache, and exit. Only the files the load reads, "
            "from the Hub; says what was fetched; no --prompt needed.",
        ),
        option(
            "--offline",
            FLAG,
            "Never touch the network (as HF_HUB_OFFLINE=1). The model must be a path or in the local Hugging "
            "Face cache; without it a model id is fetched on first use.",
        ),
    ),
    "Sampling": (
        option(
            "--steps",
            click.IntRange(min=1),
            "Denoising steps, at most 1000. [default: FLUX.1 28 dev, 4 schnell; FLUX.2 50 (distilled klein "
            "is made for 4)]",
        ),
        option(
            "--guidance",
            click.FloatRange(min=0),
            "Guidance scale. FLUX.1 / FLUX.2 dev: embedded guidance; klein: CFG scale (CFG when > 1, not on "
            "distilled models) [default: FLUX.1 3.5 (the built-in tiny 2.5), FLUX.2 4.0; schnell and "
            "distilled klein ignore it].",
        ),
        option(
            "--width",
            click.IntRange(min=1),
            "Width in pixels, a multiple of 16. [default: 1024, tiny models 256; with --image the first "
            "image's]",
        ),
        option(
            "--height",
            click.IntRange(min=1),
            "Height in pixels, a multiple of 16. [default: 1024, tiny models 256; with --image the first "
            "image's]",
        ),
        option(
            "--quality",
            click.Choice(["lossless", "high"]),
            "lossless: diffusers' bits; high: faster. high adds approximate fusions, each kept within an "
            "error budget (docs/quality.md).",
            "lossless",
        ),
        option(
            "--attention",
            click.Choice(["sdpa", "auto", "fa3-fp8"]),
            "high's attention: sdpa (bf16), auto or fa3-fp8 (FP8). auto takes FP8 attention (FA3 e4m3, "
            "Hopper, pip install 'flux-runtime[fp8-attention]') where it can run, fa3-fp8 insists; faster, but "
            "it moves the image more than high's budget allows (docs/quality.md).",
            "sdpa",
            metavar="NAME",
        ),
        option(
            "--cache",
            CacheSpec(),
            "Step caching, off by default: POLICY[:key=value,...], e.g. first-block:threshold=0.1 or "
            "taylor:order=1,refresh=2. Skips most of the transformer on steps that change little; an "
            "approximation, recorded in the PNG (docs/step-caching.md).",
        ),
        option(
            "--max-sequence-length",
            click.IntRange(1, 512),
            "Text tokens (T5, Mistral, Qwen3). [default: 512; the tiny models 64, what they were trained "
            "with]",
        ),
        option("--negative-prompt", str, "FLUX.1 true CFG: what to steer away from."),
        option(
            "--true-cfg",
            click.FloatRange(min=1),
            "FLUX.1 true CFG scale. With --negative-prompt and > 1 each step runs twice.",
            1.0,
        ),
    ),
    "Input images": (
        option(
            "--image -i",
            FILE,
            "An input image. FLUX.2 / FLUX.3: a reference image to edit or draw from (repeatable; FLUX.3 up "
            "to 10). FLUX.1: the image for img2img or, with --mask, inpainting (once).",
            NO_DEFAULT,
            multiple=True,
        ),
        option("--mask", FILE, "FLUX.1 inpainting mask. White where --image is repainted (its size)."),
        option(
            "--strength",
            float,
            "FLUX.1 img2img / inpainting: how much of --image is redrawn. In (0, 1] [default: 0.6].",
        ),
        option(
            "--control-image",
            FILE,
            "FLUX.1 Depth / Canny: the depth map or edge image. With --controlnet: one per ControlNet, in "
            "order, each the output's size (the first sets it when --width / --height are not given).",
            NO_DEFAULT,
            multiple=True,
        ),
        option(
            "--control-mode control_modes",
            str,
            "A union ControlNet's mode (canny, depth, ...). canny, tile, depth, blur, pose, gray, lq or an "
            "index; one for every --controlnet, or one each in order (none for a ControlNet without modes).",
            NO_DEFAULT,
            multiple=True,
        ),
        option(
            "--control-range",
            ControlRange(),
            "The fraction of the steps the ControlNets act in. START:END, each in [0, 1] [default: 0:1].",
        ),
        option(
            "--redux",
            str,
            "FLUX.1 Redux: variations of --image. Repeat --image to mix images; --prompt is optional. PATH: "
            "the FLUX.1-Redux-dev folder or id, or BFL's flux1-redux-dev.safetensors with "
            "--redux-image-encoder.",
            metavar="PATH",
        ),
        option(
            "--redux-image-encoder",
            str,
            "FLUX.1 Redux: SigLIP for a single file. A FLUX.1-Redux-dev folder, or "
            "google/siglip-so400m-patch14-384.",
            metavar="PATH",
        ),
        option(
            "--redux-scale",
            click.FloatRange(min=0),
            "FLUX.1 Redux: weight of the tokens. Each image's, prompt and image (prompt_embeds_scale) "
            "[default: 1].",
            1.0,
            show_default=False,
        ),
        option(
            "--redux-pooled-scale",
            click.FloatRange(min=0),
            "FLUX.1 Redux: weight of the pooled vector. Each image's (pooled_prompt_embeds_scale) "
            "[default: 1].",
            1.0,
            show_default=False,
        ),
        option(
            "--ip-adapter",
            str,
            "FLUX.1: an XLabs IP-Adapter at SCALE. SCALE defaults to 1; PATH is its .safetensors file, a folder "
            "holding ip_adapter.safetensors or a cached id. Needs --ip-image.",
            metavar="PATH[:SCALE]",
        ),
        option("--ip-image", FILE, "FLUX.1 with --ip-adapter: the image prompt."),
        option(
            "--negative-ip-image",
            FILE,
            "FLUX.1 true CFG: the negative image prompt. With --ip-adapter [default: a black image].",
        ),
        option(
            "--ip-image-encoder",
            str,
            "The CLIP vision encoder for --ip-adapter. A CLIPVisionModelWithProjection folder or cached id "
            "[default: image_encoder/ beside the adapter, else openai/clip-vit-large-patch14 from the cache].",
        ),
        option(
            "--max-area",
            click.IntRange(min=1),
            "FLUX.1 Kontext: output pixels. The size keeps --width / --height at this area [default: 1024²].",
        ),
        option(
            "--no-auto-resize",
            FLAG,
            "FLUX.1 Kontext: keep --image's size (rounded). Without it, the nearest preferred Kontext "
            "resolution.",
        ),
    ),
    "FLUX.3 prompt upsampler": (
        option(
            "--no-upsample",
            FLAG,
            "FLUX.3: encode the prompt as given. Without it, the prompt upsampler rewrites it first where "
            "the model has one.",
        ),
        option(
            "--prompt-upsampler",
            str,
            "FLUX.3: the prompt upsampler's folder or cached id. [default: "
            "black-forest-labs/flux-3-image-klein-pup for flux3-klein*; none for tiny-flux3 and "
            "tiny-flux3-random]",
        ),
        option(
            "--upsampler-prompts",
            FILE,
            "FLUX.3: the upsampler's system prompts (JSON). [default: system_prompts.json in its folder]",
        ),
        option(
            "--boxes",
            str,
            "FLUX.3: layout boxes for the prompt upsampler. A JSON list (inline, or a .json file) of "
            '{"id", "desc", "bbox"} or, with --image, {"id", "desc", "from": "target" | "ref_image_N", '
            '"src_bbox", "tgt_bbox"}; boxes [y_min, x_min, y_max, x_max] in 0-1.',
            metavar="JSON|FILE",
        ),
    ),
    "Device and memory": (
        option("--device", str, "cuda, cuda:1, cpu [default: cuda if available]."),
        option("--dtype", click.Choice(list(DTYPES)), "Model dtype [default: bf16 on GPU, fp32 on CPU]."),
        option(
            "--memory",
            str,
            "GPU memory budget (24GB, 16GB, ...) or auto. The fastest plan that fits (resident, "
            "offload-text, swap, stream); 'auto' is the GPU's free memory. Plans move weights, never change "
            "the pixels.",
            "auto",
            show_default=True,
        ),
        option("--offload-text-encoders", FLAG, "Keep the text encoders off the GPU except while encoding."),
        option(
            "--vae-tile",
            click.IntRange(min=4),
            "Decode in tiles of N latent pixels. N a multiple of 4, at least 16: bounds memory for large "
            "images.",
        ),
        option(
            "--no-cuda-graphs",
            FLAG,
            "Run the denoiser eagerly. By default CUDA graphs are replayed when the process makes several "
            "calls (--prompts) or runs a step cache (--cache); one plain call runs eagerly, as capturing costs "
            "more than it saves over one image.",
        ),
        option(
            "--cuda-graphs",
            FLAG,
            "Replay the denoiser in CUDA graphs even for one call (the capture is paid once, at its first step).",
        ),
        option(
            "--gpus",
            click.IntRange(min=1),
            "Spread the image over N GPUs. Sequence parallelism; with CFG, the two passes on two halves: "
            "starts N ranks itself, or is one rank under torchrun. With --device cpu: N CPU processes "
            "(gloo).",
        ),
    ),
    OTHER: (
        option("--quiet -q", FLAG, "No progress bars."),
        option(
            "--timings",
            FLAG,
            "Print where the time went, at the end. Start-up, imports, load, each image (and within the images: "
            "encode, prepare, first step, other steps, decode, waiting for the GPU at each) and save, and the "
            "peak memory.",
        ),
        option("--debug", FLAG, "On an error, show the Python traceback instead of one line."),
    ),
}
PARAMS = table_params(OPTIONS)
GROUPS = table_groups(OPTIONS)
# the options' long names as a --prompts line spells them (`lora`, `text_encoder_2`)
OPTION_NAMES = frozenset(o[2:].replace("-", "_") for p in PARAMS for o in p.opts if o.startswith("--"))


def model_parts(opts: dict[str, Any]) -> dict[str, str | None]:
    """--vae, --text-encoder, --text-encoder-2: the parts a BFL transformer file comes without."""
    return {name: opts[name] for name in ("vae", "text_encoder", "text_encoder_2")}
