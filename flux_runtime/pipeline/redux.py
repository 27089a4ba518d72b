"""FLUX.1 Redux on the pipeline core: an image (or several) as the conditioning, in place of encoding a prompt.

What diffusers splits over two pipelines, `FluxPriorReduxPipeline` then `FluxPipeline(prompt_embeds=...)`,
is one call here: `pipe(image=IMG)` on a pipeline with a Redux attached (`from_pretrained(..., redux=)` or
`load_redux`). The Redux stage follows `FluxPriorReduxPipeline.__call__` (diffusers 0.42.1) op for op:

1. SigLIP's last hidden state of the images, batched (`SiglipImageEncoder.encode`), through the embedder
   (`ReduxEmbedder`): (B, N, D) image tokens in the embedder's dtype;
2. the text part: with a prompt, the pipeline's T5 states and CLIP pooled vector of it (one prompt per
   image; one string serves every image); without one, zeros (B, L, D) and (B, D_pooled) in the image
   tokens' dtype (`L` = max_sequence_length: by default 512, what diffusers fixes for both);
3. T5 states and image tokens concatenated along the sequence, each image's row multiplied by its
   `prompt_embeds_scale` and the pooled vector by `pooled_prompt_embeds_scale` (both rounded to the image
   tokens' dtype first, as diffusers builds the scale tensor), then summed over the images into one
   conditioning (batch 1, L + N tokens), repeated for `num_images_per_prompt`.

Then the call runs as text to image (or Depth / Canny: `control_image` is still the control input) on those
embeddings, as `FluxPipeline` does with `prompt_embeds`. On a Redux pipeline `image=` is the Redux image:
img2img (`strength`, `mask_image`), Kontext and Fill, which also read `image`, are refused, as is true CFG
(`negative_prompt`). The result is cached like an encoded prompt (same images, prompt, scales: no model
runs). Its weights join the text encoders' in the memory plan: moved with them, run under their stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image
from torch import Tensor, nn

from flux_runtime.models.redux import ReduxEmbedder
from flux_runtime.pipeline.checks import check_prompts
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.provenance import image_fingerprint, image_record
from flux_runtime.pipeline.state import Call, Conditioning
from flux_runtime.sampling.reference_images import require_image
from flux_runtime.weights.redux import ReduxFiles, find_redux, load_redux_embedder

if TYPE_CHECKING:
    from flux_runtime.pipeline.core import Recipe
    from flux_runtime.text.siglip import SiglipImageEncoder

__all__ = ["Redux", "attach", "check_call", "encode", "open_redux", "record_inputs"]

SCALES = ("prompt_embeds_scale", "pooled_prompt_embeds_scale")


class Redux:
    """A loaded Redux: SigLIP (`image_encoder`), the embedder, and the files they came from."""

    def __init__(self, image_encoder: SiglipImageEncoder, embedder: ReduxEmbedder, files: ReduxFiles) -> None:
        self.image_encoder, self.embedder, self.files = image_encoder, embedder, files
        self.weights_id = files.weights_id()

    @property
    def tokens(self) -> int:
        """Image tokens Redux appends to the text tokens (729 for SigLIP so400m at 384 px)."""
        return self.image_encoder.tokens

    def modules(self) -> list[nn.Module]:
        """What a memory plan moves with the text encoders: SigLIP and the embedder."""
        return [self.image_encoder.model, self.embedder]

    def embed(self, images: list[Image.Image], device: torch.device) -> Tensor:
        """Image tokens (B, N, D) of `images`, in the embedder's dtype."""
        return self.embedder(self.image_encoder.encode(images, device)).to(device=device)

    def record(self) -> dict[str, Any]:
        """The provenance of the weights: what was named (the Redux, its SigLIP: null when inside the Redux
        folder) and the files' fingerprint."""
        return {
            "path": self.files.source,
            "image_encoder": self.files.encoder_source,
            "weights": self.weights_id,
        }


def open_redux(
    files: ReduxFiles, transformer: Any, *, device: torch.device | str, dtype: torch.dtype, name: str
) -> Redux:
    """Load the Redux `files` (checked by `find_redux`) for `transformer` (named `name` in errors), whose
    text input must be the embedder's output width."""
    from flux_runtime.text.siglip import SiglipImageEncoder

    width = transformer.config.context_in_dim
    if files.config.txt_in_features != width:
        raise FluxError(
            f"{files.source}: the Redux embedder gives tokens of width {files.config.txt_in_features}, but "
            f"{name}'s transformer reads text of width {width}"
        )
    encoder = SiglipImageEncoder.from_folders(
        files.image_encoder, files.feature_extractor, device=device, dtype=dtype
    )
    if encoder.hidden_size != files.config.redux_dim:
        raise FluxError(
            f"{files.image_encoder}: SigLIP's width is {encoder.hidden_size}, but the Redux embedder reads "
            f"{files.config.redux_dim}"
        )
    return Redux(encoder, load_redux_embedder(files, device, dtype), files)


def attach(pipe: Recipe, path: str | Path, image_encoder: str | Path | None = None) -> Redux:
    """`pipe.load_redux`: open the Redux at `path` beside a built pipeline (replacing any before), on the
    pipeline's device; under a memory plan the plan is made again with it counted among the text encoders."""
    if getattr(pipe, "family", None) != "flux1":
        raise FluxError(f"Redux conditions FLUX.1 models; {pipe.model_name} is not FLUX.1")
    if pipe.parallel is not None:
        raise FluxError("Redux runs on one GPU for now: load it on a pipeline without parallel=")
    files = find_redux(path, image_encoder)
    device = pipe.device
    planned = pipe.placement is not None
    if planned:
        device = torch.device("cpu")  # the plan puts it on the device when the text stage runs
    pipe.redux = open_redux(files, pipe.transformer, device=device, dtype=pipe.dtype, name=pipe.model_name)
    pipe._prompts.clear()
    if planned:
        from flux_runtime.pipeline import placement

        placement.replan_text(pipe)
    return pipe.redux


def check_call(pipe: Recipe, call: Call) -> bool:
    """Validate a call's Redux inputs before any model runs; True when Redux conditions it. On a Redux
    pipeline `image` moves to `inputs["redux_images"]` (a list), the scales to one float per image."""
    inputs = call.inputs
    redux, image = getattr(pipe, "redux", None), inputs["image"]
    given = [name for name in SCALES if inputs.get(name, 1.0) != 1.0]
    if redux is None or image is None:
        if given:
            needs = "a Redux pipeline (redux= / load_redux)" if redux is None else "an image"
            raise FluxError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} {needs}")
        return False
    images = [image] if isinstance(image, Image.Image) else image
    if not isinstance(images, list) or not images:
        raise FluxError("image on a Redux pipeline is the Redux image: give a PIL image or a list of them")
    for i, im in enumerate(images):
        require_image("image" if len(images) == 1 else f"image {i}", im, FluxError)
    variant = getattr(pipe, "variant", "text2img")
    if variant in ("kontext", "fill"):
        raise FluxError(
            f"{pipe.model_name} is a {variant.capitalize()} checkpoint, which reads image= itself; on a Redux "
            "pipeline image= is the Redux image: use Redux with FLUX.1 [dev] / [schnell] (or Depth / Canny)"
        )
    for arg in ("strength", "mask_image"):
        if inputs[arg] is not None:
            raise FluxError(
                f"on a Redux pipeline image= is the Redux image, not an image to redraw: drop {arg}"
            )
    if inputs["negative_prompt"] is not None:
        raise FluxError("negative_prompt (true CFG) does not run with Redux: drop it")
    if call.prompt_embeds is not None:
        raise FluxError(
            "Redux makes the prompt embeddings itself: give a prompt (or none), not prompt_embeds"
        )
    if call.prompt is not None:
        n = check_prompts(call.prompt)
        if isinstance(call.prompt, list) and n != len(images):
            raise FluxError(
                f"got {n} prompts for {len(images)} Redux images: give one prompt per image, or one"
            )
        if pipe.text_encoder is None:
            raise FluxError("this pipeline has no text encoders: a Redux call takes no prompt here")
    for name in SCALES:
        inputs[name] = _scales(name, inputs.get(name, 1.0), len(images))
    inputs["redux_images"], inputs["image"] = images, None
    return True


def _scales(name: str, value: object, n: int) -> list[float]:
    """A scale for each of `n` images: one number for all, or a list of `n`."""
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise FluxError(f"{name} must be a finite number or a list of them, got {value!r}")
    if isinstance(value, list) and len(value) != n:
        raise FluxError(f"{name} has {len(value)} values for {n} Redux images: give one per image, or one")
    return [float(v) for v in values] * (1 if isinstance(value, list) else n)


def encode(pipe: Recipe, call: Call) -> Conditioning:
    """The Redux conditioning of a checked call (`check_call`), from the prompt cache when it was made before."""
    inputs = call.inputs
    images: list[Image.Image] = inputs["redux_images"]
    prompts = None if call.prompt is None else _prompt_list(call.prompt, len(images))
    scales, pooled_scales = inputs["prompt_embeds_scale"], inputs["pooled_prompt_embeds_scale"]
    max_len = call.max_sequence_length
    key = (
        "redux", pipe.redux.weights_id, tuple(image_fingerprint(im) for im in images),
        None if prompts is None else tuple(prompts), max_len, tuple(scales), tuple(pooled_scales),
    )  # fmt: skip
    txt, vec = pipe.cached_encode(
        key, lambda: conditioning(pipe, images, prompts, max_len, scales, pooled_scales)
    )
    n = call.num_images_per_prompt
    return Conditioning(txt.repeat_interleave(n, dim=0), vec.repeat_interleave(n, dim=0))


def _prompt_list(prompt: str | list[str], n: int) -> list[str]:
    return [prompt] * n if isinstance(prompt, str) else list(prompt)


def conditioning(
    pipe: Recipe,
    images: list[Image.Image],
    prompts: list[str] | None,
    max_len: int,
    scales: Sequence[float],
    pooled_scales: Sequence[float],
) -> tuple[Tensor, Tensor]:
    """(prompt_embeds (1, L + N, D), pooled (1, D_pooled)): `FluxPriorReduxPipeline`'s output for `images`."""
    device = pipe.device
    image_embeds = pipe.redux.embed(images, device)
    if prompts is not None:
        text = pipe.text_encoder.encode(prompts, max_sequence_length=max_len, device=device)
        txt, vec = text.prompt_embeds, text.pooled_prompt_embeds
    else:
        cfg = pipe.transformer.config
        txt = torch.zeros((len(images), max_len, cfg.context_in_dim), device=device, dtype=image_embeds.dtype)
        vec = torch.zeros((len(images), cfg.vec_in_dim), device=device, dtype=image_embeds.dtype)
    txt = torch.cat([txt, image_embeds], dim=1)
    txt *= torch.tensor(scales, device=device, dtype=image_embeds.dtype)[:, None, None]
    vec *= torch.tensor(pooled_scales, device=device, dtype=image_embeds.dtype)[:, None]
    return torch.sum(txt, dim=0, keepdim=True), torch.sum(vec, dim=0, keepdim=True)


def record_inputs(pipe: Recipe, call: Call) -> dict[str, Any]:
    """The provenance of a Redux call: the Redux weights, each image's file and fingerprint, the scales."""
    if "redux_images" not in call.inputs:
        return {}
    inputs = call.inputs
    return {
        "redux": {
            **pipe.redux.record(),
            "images": [image_record(im) for im in inputs["redux_images"]],
            **{name: inputs[name] for name in SCALES},
        }
    }
