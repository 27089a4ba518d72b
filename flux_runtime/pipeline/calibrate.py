"""`flux-convert quantize`: calibrate a bf16 checkpoint over a few generations and write it as ModelOpt FP8.

ModelOpt's "max" calibration: every block projection records the largest |input| it sees while the
pipeline generates from a handful of prompts; that range over 448 is the layer's static input scale.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flux_runtime.pipeline.errors import FluxError
from flux_runtime.weights.fp8_export import record_input_ranges, write_modelopt_fp8

if TYPE_CHECKING:
    from flux_runtime.pipeline.flux3 import Flux3Pipe

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "a red fox in the snow at dawn, photograph",
    "a bowl of ramen on a wooden table, top view",
    "an astronaut riding a horse on the moon, oil painting",
    "a street in Tokyo at night with neon signs, rain",
    "a watercolor of a lighthouse on a cliff",
    "a close-up portrait of an old man with a beard, studio light",
    "a blue circle and a yellow triangle on a white background",
    "a cozy living room with a fireplace, 3d render",
)


def read_prompts(path: Path | None) -> list[str]:
    """One prompt per non-empty line of `path`, or the built-in list."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise FluxError(f"cannot read calibration prompts {path}: {e}") from None
    prompts = [line for line in lines if line]
    if not prompts:
        raise FluxError(f"{path} holds no prompts (one per line)")
    return prompts


def quantize_checkpoint(
    src: str | Path,
    dst: Path,
    *,
    prompts: list[str],
    steps: int | None = None,
    size: int | None = None,
    device: str | None = None,
    max_shard_size: str | int = "10GB",
    overwrite: bool = False,
    vae: str | Path | None = None,
    text_encoder: str | Path | None = None,
    text_encoder_2: str | Path | None = None,
) -> list[Path]:
    """Generate `prompts` with the bf16 pipeline at `src`, recording activation ranges, and write FP8 to `dst`.
    `vae` / `text_encoder` / `text_encoder_2`: a BFL transformer file's other parts, as for `Pipeline`."""
    from flux_runtime.pipeline.entry import Pipeline

    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FluxError(f"{dst} already exists and is not empty; pass --overwrite to replace it")
    pipe = Pipeline.from_pretrained(
        src, device=device, dtype=torch.bfloat16, cuda_graphs=False, vae=vae, text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
    )  # fmt: skip
    if getattr(pipe.transformer, "precision", "bf16") != "bf16":
        raise FluxError(f"{src} is already {pipe.transformer.precision}; quantize a bf16 checkpoint")
    ranges, remove = record_input_ranges(pipe.transformer)
    try:
        if pipe.transformer.config.family == "flux3":
            _calibrate_flux3(pipe, prompts, steps, size)
        else:
            for i, prompt in enumerate(prompts):
                log.info("calibrating on prompt %d/%d", i + 1, len(prompts))
                pipe(prompt, num_steps=steps, height=size, width=size, seed=i, output_type="latent")
    finally:
        remove()
    return write_modelopt_fp8(
        pipe.transformer, ranges, dst, max_shard_size=max_shard_size, overwrite=overwrite
    )


def _calibrate_flux3(pipe: Flux3Pipe, prompts: list[str], steps: int | None, size: int | None) -> None:
    """FLUX.3's reference-image blocks run only with a reference: prompt i >= 1 is generated with prompt i - 1's
    image as its reference (a single prompt runs again with its own), so text-to-image and editing are both
    calibrated. The prompts go in as written (the prompt upsampler would only rephrase them)."""
    runs = [(p, i > 0) for i, p in enumerate(prompts)] + ([(prompts[0], True)] if len(prompts) == 1 else [])
    previous = None
    for i, (prompt, with_reference) in enumerate(runs):
        log.info("calibrating on prompt %d/%d%s", i + 1, len(runs), " (with a reference)" * with_reference)
        image = [previous] if with_reference else None
        out = pipe(prompt, image=image, num_steps=steps, height=size, width=size, seed=i, upsample=False)
        previous = out.images[0]
