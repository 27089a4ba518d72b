"""Checks every pipeline runs on its call arguments before any model work, each failing as one FluxError."""

from __future__ import annotations

import torch

from flux_runtime.pipeline.errors import FluxError

OUTPUT_TYPES = ("pil", "pt", "np", "latent")
QUALITIES = ("lossless", "high")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_prompts(prompt: object) -> int:
    """A non-empty string or list of non-empty strings; returns how many prompts."""
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise FluxError("prompt must be a non-empty string or a list of strings")
    if any(not p.strip() for p in prompts):
        raise FluxError("prompt is empty")
    return len(prompts)


def check_size(height: object, width: object, multiple: int) -> None:
    """Positive pixel sides divisible by `multiple` (2 x the VAE factor: packing takes 2x2 latents)."""
    for name, v in (("height", height), ("width", width)):
        if not _is_int(v) or v <= 0:  # type: ignore[operator]
            raise FluxError(f"{name} {v!r} must be a positive integer")
        if v % multiple:  # type: ignore[operator]
            raise FluxError(f"{name} {v} is not divisible by {multiple}")


def check_steps(num_steps: object, default: int) -> int:
    steps = default if num_steps is None else num_steps
    if not _is_int(steps) or steps < 1:  # type: ignore[operator]
        raise FluxError(f"num_steps {num_steps!r} must be an integer >= 1")
    return steps  # type: ignore[return-value]


def check_guidance(guidance: object, default: float) -> float:
    g = default if guidance is None else guidance
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 0:
        raise FluxError(f"guidance {guidance!r} must be a number >= 0")
    return float(g)


def check_sampling(
    seed: object,
    generator: object,
    max_sequence_length: object,
    max_length_limit: int,
    num_images_per_prompt: object,
    output_type: object,
    quality: object,
) -> None:
    """Seed vs generator, text length, images per prompt, output type and quality tier."""
    if seed is not None and generator is not None:
        raise FluxError("pass either seed or generator, not both")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):  # type: ignore[operator]
        raise FluxError(f"seed {seed!r} must be an integer in [0, 2**64)")
    if generator is not None and not isinstance(generator, (torch.Generator, list)):
        raise FluxError(
            f"generator must be a torch.Generator or a list of them, got {type(generator).__name__}"
        )
    if not _is_int(max_sequence_length) or not 1 <= max_sequence_length <= max_length_limit:  # type: ignore[operator]
        raise FluxError(f"max_sequence_length {max_sequence_length!r} must be in 1..{max_length_limit}")
    if not _is_int(num_images_per_prompt) or num_images_per_prompt < 1:  # type: ignore[operator]
        raise FluxError(f"num_images_per_prompt {num_images_per_prompt!r} must be an integer >= 1")
    if output_type not in OUTPUT_TYPES:
        raise FluxError(f"unknown output_type {output_type!r}: choose pil, pt, np or latent")
    if quality not in QUALITIES:
        raise FluxError(f"unknown quality {quality!r}: choose 'lossless' or 'high'")


def check_vae_tile(tile: object) -> None:
    """`Pipeline.vae_tile`: None (decode in one pass) or a positive multiple of 4 latent pixels."""
    if tile is not None and (not _is_int(tile) or tile <= 0 or tile % 4):  # type: ignore[operator]
        raise FluxError(f"vae_tile {tile!r} must be None or a positive multiple of 4 (latent pixels)")
