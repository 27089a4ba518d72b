"""The FLUX.1 variants as small recipes: how each one's latents start and what conditions every step.

- text to image (FluxPipeline), with true CFG when `negative_prompt` and `true_cfg_scale > 1` are given;
- img2img (FluxImg2ImgPipeline): the image's latents noised to the first kept timestep (`strength`);
- inpainting (FluxInpaintPipeline): img2img, and after each step the re-noised original outside the mask;
- Kontext (FluxKontextPipeline): the reference image's tokens appended after the latents, ids at time 1;
- Fill (FluxFillPipeline): masked-image latents and the 8x8-packed mask concatenated on the channels;
- control (FluxControlPipeline, Depth / Canny): the control image's latents concatenated on the channels.

Which one a checkpoint is: the diffusers folder's model_index.json class, else the registry name, else the
caller's `variant=`; Fill and control are also told by the transformer's input width.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flux_runtime.pipeline.checks import MAX_GUIDANCE, input_width
from flux_runtime.pipeline.core import first_step
from flux_runtime.pipeline.errors import FluxError, warn_caller
from flux_runtime.pipeline.provenance import image_record
from flux_runtime.pipeline.sources import Sources
from flux_runtime.pipeline.state import Call, Conditioning, Start
from flux_runtime.registry import Variant, spec_for
from flux_runtime.sampling import draw_noise, image_ids, latent_size, pack
from flux_runtime.sampling.reference_images import require_image

if TYPE_CHECKING:
    from flux_runtime.pipeline.core import Recipe as Pipeline  # the FLUX.1 recipe

log = logging.getLogger(__name__)

# FluxImg2ImgPipeline / FluxInpaintPipeline's default strength.
DEFAULT_STRENGTH = 0.6
# FluxFillPipeline's: the whole schedule, the masked image comes in through the channels
FILL_STRENGTH = 1.0
MASK_MODES = ("L", "1", "RGB", "RGBA", "LA", "P")
# FLUX.1 Kontext's preferred (width, height), about one megapixel each, the aspect ratios it was trained at
KONTEXT_RESOLUTIONS: tuple[tuple[int, int], ...] = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024),
    (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688), (1568, 672),
)  # fmt: skip
IMAGE_ROLES = ("image", "mask_image", "control_image")
VARIANTS: tuple[Variant, ...] = ("text2img", "kontext", "fill", "control")
# model_index.json `_class_name` → variant
_PIPELINE_CLASSES: dict[str, Variant] = {
    "FluxPipeline": "text2img",
    "FluxImg2ImgPipeline": "text2img",
    "FluxInpaintPipeline": "text2img",
    "FluxKontextPipeline": "kontext",
    "FluxKontextInpaintPipeline": "kontext",
    "FluxFillPipeline": "fill",
    "FluxControlPipeline": "control",
    "FluxControlImg2ImgPipeline": "control",
    "FluxControlInpaintPipeline": "control",
}


def check_variant_name(variant: object) -> None:
    """`from_pretrained`'s `variant=`: None or one of `VARIANTS` (diffusers' `variant=` means something else)."""
    if variant is not None and variant not in VARIANTS:
        raise FluxError(
            f"unknown variant {variant!r}: choose one of {', '.join(VARIANTS)} (diffusers' variant=, a weight "
            "file's precision such as 'fp16', has no counterpart here: give those files' path)"
        )


def named_variant(src: Sources, variant: Variant | None) -> Variant | None:
    """The variant the sources name: model_index.json's class, else the registry entry, else `variant`."""
    check_variant_name(variant)
    cls = (src.model_index or {}).get("_class_name")
    if isinstance(cls, str) and cls in _PIPELINE_CLASSES:
        return _PIPELINE_CLASSES[cls]
    spec = spec_for(src.name)
    if spec is not None and spec.family == "flux1":
        return spec.variant
    return variant


def variant_of(transformer: Any, vae: Any, named: Variant | None, name: str) -> Variant:
    """The variant: told by the input width for Fill and control, else `named` (Kontext has dev's keys)."""
    z, f = vae.config.z_channels, getattr(vae.config, "spatial_factor", 8)
    width = transformer.config.in_channels
    for by_width in ("fill", "control"):
        if width == input_width(by_width, z, f):  # type: ignore[arg-type]
            return by_width  # type: ignore[return-value]
    return named if named in ("text2img", "kontext") else "text2img"


def check_inputs(pipe: Pipeline, call: Call) -> None:
    """The variant's own arguments, before any model runs."""
    inputs = call.inputs
    scale, negative = inputs["true_cfg_scale"], inputs["negative_prompt"]
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not scale >= 1.0
        or scale == float("inf")
    ):
        raise FluxError(f"true_cfg_scale {scale!r} must be a finite number >= 1")
    if scale > MAX_GUIDANCE:
        raise FluxError(f"true_cfg_scale {scale!r} is more than {MAX_GUIDANCE:g}; give a smaller scale")
    if negative is not None:
        n = 1 if isinstance(call.prompt, str) or call.prompt is None else len(call.prompt)
        negatives = [negative] if isinstance(negative, str) else negative
        if not isinstance(negatives, list) or not all(isinstance(p, str) for p in negatives):
            raise FluxError("negative_prompt must be a string or a list of strings")
        if isinstance(negative, list) and len(negative) != n:
            raise FluxError(
                f"negative_prompt has {len(negative)} prompts for {n} prompts; give one per prompt"
            )
        if isinstance(negative, str) and n > 1:
            inputs["negative_prompt"] = [negative] * n
    if scale > 1 and negative is None:
        warn_caller("true_cfg_scale > 1 needs a negative_prompt; no true CFG runs")
    if negative is not None and scale <= 1:
        warn_caller("negative_prompt is used only with true_cfg_scale > 1; no true CFG runs")
    call.true_cfg_scale = float(scale) if scale > 1 and negative is not None else 1.0
    image, mask, strength = inputs["image"], inputs["mask_image"], inputs["strength"]
    for arg in ("image", "mask_image", "control_image"):
        if inputs[arg] is not None:
            require_image(arg, inputs[arg], FluxError)
    if inputs["max_area"] is not None and pipe.variant != "kontext":
        raise FluxError(f"max_area is a Kontext setting; {pipe.model_name} is not a Kontext checkpoint")
    if pipe.variant == "kontext":
        _check_kontext(pipe, call)
        return
    if pipe.variant == "fill":
        if inputs["control_image"] is not None:
            raise FluxError(f"{pipe.model_name} is a Fill checkpoint: it takes no control_image")
        if image is None or mask is None:
            raise FluxError(
                f"{pipe.model_name} is a Fill checkpoint: give an image and a mask_image (white = fill)"
            )
    if pipe.variant == "control":
        for arg in ("image", "mask_image", "strength"):
            if inputs[arg] is not None:
                raise FluxError(f"{pipe.model_name} is a Depth / Canny checkpoint: it takes no {arg}")
        if inputs["control_image"] is None:
            raise FluxError(
                f"{pipe.model_name} is a Depth / Canny checkpoint: give a control_image (the depth map or "
                "edge image)"
            )
        return
    if inputs["control_image"] is not None:
        raise FluxError(
            f"control_image needs a Depth or Canny checkpoint; {pipe.model_name} has no control input"
        )
    if mask is not None and image is None:
        raise FluxError("mask_image needs an image to inpaint")
    if strength is not None and image is None:
        raise FluxError("strength needs an image (img2img or inpainting)")
    if image is not None:
        default = FILL_STRENGTH if pipe.variant == "fill" else DEFAULT_STRENGTH
        strength = default if strength is None else strength
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 < strength <= 1:
            raise FluxError(f"strength {strength!r} must be in (0, 1]")
        inputs["strength"] = float(strength)
    if mask is not None:
        if mask.mode not in MASK_MODES:
            raise FluxError(f"mask_image has mode {mask.mode}; give a grayscale (L), 1-bit or RGB mask")
        if mask.size != image.size:
            raise FluxError(
                f"mask_image is {mask.width}x{mask.height} but image is {image.width}x{image.height}"
            )


def _check_kontext(pipe: Pipeline, call: Call) -> None:
    """FluxKontextPipeline's sizes: the output keeps the asked aspect ratio at `max_area` pixels (default
    the model's native area, 1024²) and the reference image is resized to the preferred resolution nearest
    its aspect ratio (`auto_resize`), both in multiples of 2f; a side that rounds to nothing is an error."""
    inputs = call.inputs
    for arg in ("mask_image", "control_image", "strength"):
        if inputs[arg] is not None:
            raise FluxError(
                f"{pipe.model_name} is a Kontext checkpoint: it takes no {arg}, only an image to edit"
            )
    unit = 2 * pipe.vae.config.spatial_factor
    height = pipe.default_size if call.height is None else call.height
    width = pipe.default_size if call.width is None else call.width
    area = pipe.default_size**2 if inputs["max_area"] is None else inputs["max_area"]
    if isinstance(area, bool) or not isinstance(area, int) or area < unit * unit:
        raise FluxError(f"max_area {area!r} must be a whole number of pixels >= {unit * unit}")
    for side, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FluxError(f"{side} {value!r} must be a positive whole number of pixels")
    aspect = width / height
    out_w = round((area * aspect) ** 0.5) // unit * unit
    out_h = round((area / aspect) ** 0.5) // unit * unit
    if out_w == 0 or out_h == 0:
        raise FluxError(
            f"{width}x{height} is too extreme an aspect ratio for Kontext at max_area {area}: a side rounds to "
            f"under {unit} px; ask for a size nearer to square"
        )
    if (out_h, out_w) != (height, width):
        log.warning("Kontext: %dx%d adjusted to %dx%d (max_area %d)", width, height, out_w, out_h, area)
    call.height, call.width = out_h, out_w
    image = inputs["image"]
    if image is None:
        return
    ref_w, ref_h = (image.width // unit * unit, image.height // unit * unit)
    if ref_w == 0 or ref_h == 0:
        raise FluxError(
            f"image is {image.width}x{image.height}: too extreme an aspect ratio (or too small) for Kontext, a "
            f"side is under {unit} px; crop or pad it nearer to square"
        )
    if inputs["auto_resize"]:
        ref_w, ref_h = kontext_resolution(ref_w, ref_h)
    call.prepared["reference_size"] = (ref_h // unit * unit, ref_w // unit * unit)


def kontext_resolution(width: int, height: int) -> tuple[int, int]:
    """The preferred Kontext (width, height) nearest the aspect ratio `width / height` (ties: the
    narrower), as FluxKontextPipeline's `_auto_resize` picks it."""
    aspect = width / height
    _, w, h = min((abs(aspect - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return w, h


def check_after_size(pipe: Pipeline, call: Call) -> None:
    """Checks that need the final size and step count: strength leaves at least one step."""
    strength = call.inputs["strength"]
    if strength is not None and first_step(call.steps, strength) >= call.steps:
        raise FluxError(
            f"strength {strength} of {call.steps} steps leaves no step to run: raise strength or num_steps"
        )


def prepare(pipe: Pipeline, call: Call, cond: Conditioning) -> Start:
    if pipe.variant == "kontext":
        return _kontext_start(pipe, call, cond)
    if pipe.variant == "control":
        return _control_start(pipe, call, cond)
    if call.inputs["image"] is None:
        return pipe.text2img_start(call, cond)
    generator = call_generator(call)
    if pipe.variant == "fill":
        start = img2img_start(pipe, call, cond, generator, inpaint=False)
        start.channel_cond = _fill_condition(pipe, call, cond, generator)
        return start
    return img2img_start(pipe, call, cond, generator)


def call_generator(call: Call) -> torch.Generator | list[torch.Generator] | None:
    """One generator for every draw of the call (VAE samples, noise), as diffusers threads it through them."""
    return torch.Generator("cpu").manual_seed(call.seed) if call.seed is not None else call.generator


def _control_start(pipe: Pipeline, call: Call, cond: Conditioning) -> Start:
    """FluxControlPipeline: the control image, resized to the output and repeated over the batch, goes
    through the VAE as a posterior sample (drawn before the noise, from the same generator); its packed
    latents sit beside the noisy ones on the channels at every step. The noise is text to image's."""
    assert call.height is not None and call.width is not None  # filled by check
    device, vae, batch = pipe.device, pipe.vae, cond.batch
    generator = call_generator(call)
    pixels = preprocess(call.inputs["control_image"], call.height, call.width)
    pixels = pixels.repeat_interleave(batch, dim=0).to(device=device, dtype=pipe.dtype)
    if isinstance(generator, list) and len(generator) != batch:
        raise FluxError(f"got {len(generator)} generators for a batch of {batch}; pass one per image")
    raw = vae.encode(pixels, sample=True, generator=generator)
    start = pipe.text2img_start(call, cond, generator=generator)
    start.channel_cond = pack(vae.scale_latents(raw)).to(dtype=cond.txt.dtype)
    return start


def _fill_condition(
    pipe: Pipeline, call: Call, cond: Conditioning, generator: torch.Generator | list[torch.Generator] | None
) -> Tensor:
    """FluxFillPipeline's conditioning tokens (B, L, 4z + 4f²): the latents of the image with the mask's
    area blanked (a posterior sample, drawn after the noise), then the pixel mask folded f x f onto the
    channels so each latent pixel sees its own f² mask pixels, both packed 2x2."""
    assert call.height is not None and call.width is not None  # filled by check
    device, dtype, vae = pipe.device, cond.txt.dtype, pipe.vae
    batch, f = cond.batch, vae.config.spatial_factor
    h, w = latent_size(call.height, call.width, f)
    first = generator[0] if isinstance(generator, list) else generator
    pixels = preprocess(call.inputs["image"], call.height, call.width)
    mask = preprocess(call.inputs["mask_image"], call.height, call.width, mask=True)
    masked = (pixels * (1 - mask)).to(device=device, dtype=dtype)
    latents = vae.scale_latents(vae.encode(masked, sample=True, generator=first)).to(
        device=device, dtype=dtype
    )
    latents = pack(torch.cat([latents] * batch, dim=0))
    # (1, 1, h f, w f) → (B, f², h, w): mask pixel (i f + a, j f + b) goes to channel a f + b at (i, j)
    folded = mask[:, 0].view(1, h, f, w, f).permute(0, 2, 4, 1, 3).reshape(1, f * f, h, w)
    folded = pack(folded.repeat(batch, 1, 1, 1)).to(device=device, dtype=dtype)
    return torch.cat([latents, folded], dim=2)


def _kontext_start(pipe: Pipeline, call: Call, cond: Conditioning) -> Start:
    """FluxKontextPipeline: noise as text to image; the reference image's latents (the posterior mean, so
    no draw from the generator) packed to tokens that follow the noise tokens at every step, their ids
    `[1, i, j]` so attention tells them from the image being made (`[0, i, j]`). The schedule's shift
    counts the noise tokens only."""
    start = pipe.text2img_start(call, cond)
    if call.inputs["image"] is None:
        return start
    device, dtype, vae = pipe.device, cond.txt.dtype, pipe.vae
    ref_h, ref_w = call.prepared["reference_size"]
    pixels = preprocess(call.inputs["image"], ref_h, ref_w).to(device=device, dtype=dtype)
    latents = vae.scale_latents(vae.encode(pixels))
    latents = torch.cat([latents] * cond.batch, dim=0)
    gh, gw = latents.shape[2:]
    ref_ids = image_ids(gh, gw, dtype=dtype, device=device)
    ref_ids[..., 0] = 1
    h, w = start.grid
    start.reference_tokens = pack(latents)
    start.img_ids = torch.cat([start.img_ids, ref_ids], dim=0)
    start.rope_key = (h, w, gh, gw, cond.txt.shape[1], device)
    return start


def preprocess(image: Image.Image, height: int, width: int, *, mask: bool = False) -> Tensor:
    """VaeImageProcessor.preprocess: LANCZOS resize to width x height, [0, 1] floats (B, C, H, W); an image
    to [-1, 1] RGB, a mask to one grayscale channel binarized at 0.5."""
    image = image.convert("L") if mask else image if image.mode == "RGB" else image.convert("RGB")
    image = image.resize((width, height), resample=Image.Resampling.LANCZOS, reducing_gap=None)
    array = np.array(image).astype(np.float32) / 255.0
    array = array[None, ..., None] if mask else array[None]  # (1, H, W, C)
    pixels = torch.from_numpy(array.transpose(0, 3, 1, 2))
    if mask:
        pixels[pixels < 0.5] = 0
        pixels[pixels >= 0.5] = 1
        return pixels
    return 2.0 * pixels - 1.0


def img2img_start(
    pipe: Pipeline,
    call: Call,
    cond: Conditioning,
    generator: torch.Generator | list[torch.Generator] | None,
    *,
    inpaint: bool = True,
) -> Start:
    """FluxImg2ImgPipeline / FluxInpaintPipeline / FluxFillPipeline: the image's latents (a posterior sample,
    drawn with the call's generator before the noise) noised to the first kept sigma, the schedule's last
    steps; with a mask and `inpaint`, the original put back outside the mask after every step."""
    assert call.height is not None and call.width is not None  # filled by check
    device, dtype, vae = pipe.device, cond.txt.dtype, pipe.vae
    batch, f = cond.batch, vae.config.spatial_factor
    h, w = latent_size(call.height, call.width, f)
    first = generator[0] if isinstance(generator, list) else generator
    pixels = preprocess(call.inputs["image"], call.height, call.width).to(device=device, dtype=dtype)
    image_latents = vae.scale_latents(vae.encode(pixels, sample=True, generator=first))
    image_latents = torch.cat([image_latents] * batch, dim=0)  # (B, C, h, w)
    noise = draw_noise(tuple(image_latents.shape), dtype=dtype, device=device, generator=generator)
    tokens = (h // 2) * (w // 2)
    sigmas, timesteps = pipe._schedule(call.steps, tokens, call.inputs["strength"])
    # FlowMatchEulerDiscreteScheduler.scale_noise: sigma cast to the sample's dtype first
    sigma = sigmas[0].to(dtype)
    latents = pack(sigma * noise + (1.0 - sigma) * image_latents)
    blend = None
    if inpaint and call.inputs["mask_image"] is not None:
        mask = preprocess(call.inputs["mask_image"], call.height, call.width, mask=True)
        mask = torch.nn.functional.interpolate(mask, size=(h, w)).to(device=device, dtype=dtype)
        mask = pack(mask.repeat(batch, image_latents.shape[1], 1, 1))
        packed_image, packed_noise = pack(image_latents), pack(noise)
        blend = _inpaint_blend(packed_image, packed_noise, mask, sigmas)
    return Start(
        latents, (h, w), sigmas, timesteps,
        img_ids=image_ids(h, w, dtype=dtype, device=device),
        txt_ids=pipe._text_ids(cond),
        rope_key=(h, w, cond.txt.shape[1], device),
        blend=blend,
    )  # fmt: skip


def _inpaint_blend(
    image: Tensor, noise: Tensor, mask: Tensor, sigmas: Tensor
) -> Callable[[int, Tensor], Tensor]:
    """After step i: outside the mask, the original latents noised to the next sigma (none after the last)."""
    last = sigmas.shape[0] - 2

    def blend(i: int, latents: Tensor) -> Tensor:
        proper = image
        if i < last:
            sigma = sigmas[i + 1].to(image.dtype)
            proper = sigma * noise + (1.0 - sigma) * image
        return (1 - mask) * proper + mask * latents

    return blend


def record_inputs(pipe: Pipeline, call: Call) -> dict[str, Any]:
    """Provenance of the variant's inputs: the negative prompt and CFG scale when true CFG ran, the
    strength and each input image's file and fingerprint."""
    out: dict[str, Any] = {}
    if pipe.variant != "text2img":
        out["variant"] = pipe.variant
    if call.true_cfg_scale > 1:
        out.update(negative_prompt=call.inputs["negative_prompt"], true_cfg_scale=call.true_cfg_scale)
    images = {k: image_record(call.inputs[k]) for k in IMAGE_ROLES if call.inputs.get(k) is not None}
    if images:
        out["input_images"] = images
    if call.inputs.get("strength") is not None:
        out["strength"] = call.inputs["strength"]
    if pipe.variant == "kontext" and call.inputs.get("image") is not None:
        out["auto_resize"] = bool(call.inputs["auto_resize"])
        out["reference_size"] = list(call.prepared["reference_size"])
    return out
