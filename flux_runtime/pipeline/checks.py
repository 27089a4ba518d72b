"""Checks every pipeline runs on its call arguments before any model work, each failing as one FluxError."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flux_runtime.pipeline.errors import FluxError
from flux_runtime.registry import Variant
from flux_runtime.weights import checks as weight_checks
from flux_runtime.weights.errors import WeightsError

if TYPE_CHECKING:
    from flux_runtime.models.dit import Flux1Transformer, Flux2Transformer, Flux3Transformer
    from flux_runtime.models.vae import Flux1VAE, Flux2VAE

OUTPUT_TYPES = ("pil", "pt", "np", "latent")
QUALITIES = ("lossless", "high")
# More steps than the schedule's 1000 training timesteps only repeats timesteps (and holds every step's
# modulation table in the high tier); a typo such as 10**9 would run for days.
MAX_STEPS = 1000
# The largest image side in pixels. FLUX is trained up to about 2 MP; past ~11,500 px a side the time shift
# `exp(mu)`, mu growing with the token count, overflows float32 and every sigma becomes NaN (a black image
# after hours of attention over a million tokens). 8192 px a side keeps the schedule finite with room.
MAX_SIDE = 8192
# The largest guidance (embedded or CFG scale) taken: a thousand times what any FLUX model is run with, far
# below where FLUX.1's guidance embedding (guidance x 1000 in float32) overflows.
MAX_GUIDANCE = 1000.0
# The smallest VAE tile, in latent pixels: a smaller tile gives the decoder's GroupNorm and attention too
# little of the image (and, on narrow models, a single value per group, which GroupNorm refuses).
MIN_VAE_TILE = 16
# diffusers' tile overlap: tiles start every int(0.75 * tile) latent pixels.
_TILE_STRIDE = 0.75


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_prompts(prompt: object) -> int:
    """A non-empty string or list of non-empty strings; returns how many prompts."""
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise FluxError("prompt must be a non-empty string or a list of strings")
    if any(not p.strip() for p in prompts):
        raise FluxError("prompt is empty")
    for p in prompts:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:
            # on a command line: bytes that are not UTF-8 arrive as lone surrogates
            raise FluxError(
                f"prompt is not valid UTF-8 text (character {e.start} is {p[e.start]!r}): "
                "give the prompt in UTF-8"
            ) from None
    return len(prompts)


def check_prompt_embeds(embeds: object, width: int, max_len: int, dtype: torch.dtype) -> int:
    """A float tensor (B, 1..max_len, width) in the model's dtype (the noise is drawn in the embeddings'
    dtype, as diffusers does); returns B."""
    if (
        not isinstance(embeds, Tensor)
        or embeds.ndim != 3
        or embeds.shape[-1] != width
        or not 1 <= embeds.shape[1] <= max_len
        or not embeds.is_floating_point()
    ):
        shape = tuple(embeds.shape) if isinstance(embeds, Tensor) else type(embeds).__name__
        raise FluxError(f"prompt_embeds must be a float tensor (B, L <= {max_len}, {width}), got {shape}")
    if embeds.dtype != dtype:
        raise FluxError(f"prompt_embeds are {embeds.dtype}; this pipeline runs {dtype}")
    return embeds.shape[0]


def check_size(height: object, width: object, multiple: int) -> None:
    """Positive pixel sides of at most `MAX_SIDE`, divisible by `multiple` (2 x the VAE factor: packing takes
    2x2 latents; 0 checks no multiple, for a caller that has no model yet)."""
    for name, v in (("height", height), ("width", width)):
        if not _is_int(v) or v <= 0:  # type: ignore[operator]
            raise FluxError(f"{name} {v!r} must be a positive integer")
        if v > MAX_SIDE:  # type: ignore[operator]
            raise FluxError(
                f"{name} {v} is more than {MAX_SIDE} px, the largest side drawn (FLUX is trained up to about "
                "2 megapixels, e.g. 1024x1024 to 1920x1088); give a smaller size"
            )
        if multiple and v % multiple:  # type: ignore[operator]
            lower = v - v % multiple  # type: ignore[operator]
            near = " or ".join(str(n) for n in (lower, lower + multiple) if 0 < n <= MAX_SIDE)
            raise FluxError(
                f"{name} {v} is not divisible by {multiple}; give a multiple of {multiple}, e.g. {near}"
            )


def check_steps(num_steps: object, default: int) -> int:
    """`num_steps` (or `default`): an integer in 1..MAX_STEPS."""
    steps = default if num_steps is None else num_steps
    if not _is_int(steps) or steps < 1:  # type: ignore[operator]
        raise FluxError(f"num_steps {num_steps!r} must be an integer >= 1")
    if steps > MAX_STEPS:  # type: ignore[operator]
        raise FluxError(
            f"num_steps {steps} is more than {MAX_STEPS}: the schedule has {MAX_STEPS} timesteps "
            "(FLUX uses 4 to 50 steps)"
        )
    return steps  # type: ignore[return-value]


def check_guidance(guidance: object, default: float) -> float:
    """`guidance` (or `default`): a finite number in 0..MAX_GUIDANCE (inf or NaN would give a black image)."""
    g = default if guidance is None else guidance
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 0:
        raise FluxError(f"guidance {guidance!r} must be a number >= 0")
    if not math.isfinite(g):
        raise FluxError(f"guidance {guidance!r} must be a finite number >= 0")
    if g > MAX_GUIDANCE:
        raise FluxError(
            f"guidance {guidance!r} is more than {MAX_GUIDANCE:g}: FLUX uses 1 to 10 (the embedded guidance is "
            "scaled by 1000 and overflows float32 long before such values); give a smaller guidance"
        )
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


def check_vae_tile(tile: object, latent_size: tuple[int, int] | None = None) -> None:
    """`Pipeline.vae_tile`: None (decode in one pass) or a multiple of 4 latent pixels, at least MIN_VAE_TILE,
    that leaves no 1-pixel edge tile on a latent of `latent_size` (height, width) when that is given."""
    if tile is None:
        return
    if not _is_int(tile) or tile <= 0 or tile % 4:  # type: ignore[operator]
        raise FluxError(f"vae_tile {tile!r} must be None or a positive multiple of 4 (latent pixels)")
    if tile < MIN_VAE_TILE:  # type: ignore[operator]
        raise FluxError(
            f"vae_tile {tile} is below the minimum of {MIN_VAE_TILE} latent pixels: "
            f"use {MIN_VAE_TILE} or more, or no tiling"
        )
    if latent_size is None or max(latent_size) <= tile:  # type: ignore[operator]
        return  # no latent to tile yet, or decoded in one pass
    stride = int(tile * _TILE_STRIDE)  # type: ignore[operator]
    for side in latent_size:
        if side - (side - 1) // stride * stride == 1:
            raise FluxError(
                f"vae_tile {tile} leaves a 1-pixel edge tile on a latent side of {side} pixels "
                f"(tiles start every {stride}): choose another tile size"
            )


def check_device(device: object) -> torch.device:
    """`device` (None: cuda when available, else cpu) as a torch.device that exists: cpu, cuda, cuda:N or mps."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return weight_checks.check_device(device)
    except WeightsError as e:
        raise FluxError(str(e)) from None


def check_finite(x: Tensor, what: str) -> None:
    """Raise a FluxError when `x` holds NaN or infinity (one host sync): a wrong image is never returned."""
    if not bool(torch.isfinite(x).all()):
        raise FluxError(
            f"the {what} hold NaN or infinite values ({x.dtype} overflow? try bfloat16 or a smaller guidance)"
        )


class StepWatch:
    """Finds the first denoising step whose latents hold NaN or infinity, as the `denoise` callback.

    On the CPU each step is checked at once (a check costs no device sync there), so a broken run stops
    early. Elsewhere the first bad step is kept in a device tensor and read once by `raise_if_bad()` after
    the loop: no host sync per step, nothing added inside a CUDA graph. A non-finite latent stays non-finite
    in later steps, so the final check alone cannot miss one.
    """

    def __init__(self, num_steps: int, device: torch.device) -> None:
        self.num_steps = num_steps
        self.eager = device.type == "cpu"
        self.first_bad: Tensor | None = None  # (), int64: the first bad step's index, or -1
        self.dtype = torch.float32  # the latents' dtype, for the message

    def __call__(self, i: int, latents: Tensor) -> None:
        if latents.device.type == "meta":
            return
        ok = torch.isfinite(latents).all()
        self.dtype = latents.dtype
        if self.eager:
            if not bool(ok):
                self._raise(i)
            return
        here = torch.where(ok, -1, i)
        self.first_bad = (
            here if self.first_bad is None else torch.where(self.first_bad >= 0, self.first_bad, here)
        )

    def raise_if_bad(self) -> None:
        if self.first_bad is not None and (i := int(self.first_bad)) >= 0:
            self._raise(i)

    def _raise(self, i: int) -> None:
        raise FluxError(
            f"the latents became NaN or infinite at denoising step {i + 1} of {self.num_steps}, so no image was "
            f"made ({str(self.dtype).removeprefix('torch.')} overflow? try bfloat16, a smaller guidance, or other weights)"
        )


def input_width(variant: Variant, z: int, f: int) -> int:
    """The transformer's input width for a variant: latents packed 2x2 (4z), Fill adds the masked image's
    latents (4z) and the f x f mask packed 2x2 (4 f^2), control the control image's latents (4z)."""
    if variant == "fill":
        return 8 * z + 4 * f * f
    if variant == "control":
        return 8 * z
    return 4 * z


def check_latent_widths(
    transformer: Flux1Transformer | Flux2Transformer | Flux3Transformer,
    vae: Flux1VAE | Flux2VAE,
    name: str,
    variant: Variant = "text2img",
) -> None:
    """The transformer reads and predicts the VAE's latents packed 2x2 (Fill adds the masked image and its
    8x8 mask, Depth/Canny the control image's latents): fail at load, naming the checkpoint, not at the
    first step with a bare shape error. (Every family alike.)"""
    z = vae.config.z_channels
    f = getattr(vae.config, "spatial_factor", 8)
    for layer, width, want in (
        ("img_in", transformer.config.in_channels, input_width(variant, z, f)),
        ("final_layer", transformer.config.out_channels, 4 * z),
    ):
        if width != want:
            raise FluxError(
                f"{name}: the transformer's {layer} has width {width}, but the VAE's {z} latent channels "
                f"packed 2x2 are {4 * z}" + ("" if want == 4 * z else f" ({variant}: {want})")
            )
