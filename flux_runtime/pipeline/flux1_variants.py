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

import warnings
from typing import TYPE_CHECKING, Any

from flux_runtime.pipeline.core import Call, Conditioning, Start
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.sources import Sources
from flux_runtime.registry import Variant, spec_for

if TYPE_CHECKING:
    from flux_runtime.pipeline.flux1 import Pipeline

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


def input_width(variant: Variant, z: int, f: int) -> int:
    """The transformer's input width for a variant: latents packed 2x2 (4z), Fill adds the masked image's
    latents (4z) and the f x f mask packed 2x2 (4 f^2), control the control image's latents (4z)."""
    if variant == "fill":
        return 8 * z + 4 * f * f
    if variant == "control":
        return 8 * z
    return 4 * z


def named_variant(src: Sources, variant: Variant | None) -> Variant | None:
    """The variant the sources name: model_index.json's class, else the registry entry, else `variant`."""
    if variant is not None and variant not in VARIANTS:
        raise FluxError(f"unknown variant {variant!r}: choose one of {', '.join(VARIANTS)}")
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
        warnings.warn("true_cfg_scale > 1 needs a negative_prompt; no true CFG runs", stacklevel=5)
    if negative is not None and scale <= 1:
        warnings.warn("negative_prompt is used only with true_cfg_scale > 1; no true CFG runs", stacklevel=5)
    call.true_cfg_scale = float(scale) if scale > 1 and negative is not None else 1.0
    for arg in ("image", "mask_image", "control_image"):
        if inputs[arg] is not None:
            raise FluxError(f"{arg} is not supported by this FLUX.1 pipeline yet")
    if inputs["strength"] is not None:
        raise FluxError("strength needs an image (img2img)")


def check_after_size(pipe: Pipeline, call: Call) -> None:
    """Checks that need the final size (input images against the output size)."""


def prepare(pipe: Pipeline, call: Call, cond: Conditioning) -> Start:
    return pipe.text2img_start(call, cond)


def record_inputs(pipe: Pipeline, call: Call) -> dict[str, Any]:
    """Provenance of the variant's inputs: the negative prompt and CFG scale when true CFG ran."""
    if call.true_cfg_scale <= 1:
        return {}
    return {"negative_prompt": call.inputs["negative_prompt"], "true_cfg_scale": call.true_cfg_scale}
