"""The XLabs FLUX.1 IP-Adapter on a pipeline: load it with its CLIP vision encoder, encode a call's images,
record it, take it off again.

As diffusers' `FluxPipeline` after `load_ip_adapter`: the image prompt goes through `CLIPImageProcessor`
(the encoder's image size, shortest side resized, centre-cropped) and `CLIPVisionModelWithProjection` (fp16
by default, diffusers' `image_encoder_dtype`) once per call; its embedding is repeated over the batch. A call
may give that embedding instead (`ip_adapter_image_embeds`, as diffusers; `encode_image` makes it), to encode
an image prompt once for many calls. With true CFG the negative branch reads the negative image's embedding
(or embeddings), an all-black image when none is given (and a black positive image when only a negative one
is). The transformer projects each branch's embedding
to image tokens once per generation (`Flux1Pipe.fixed_extra`) and its double blocks attend to them
(`models.dit.ip_adapter`). transformers is imported only when an adapter loads.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flux_runtime.models.dit.ip_adapter import IPAdapter
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.provenance import image_record, tensor_record
from flux_runtime.pipeline.state import Call
from flux_runtime.sampling.reference_images import require_image
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import hub_id, resolve
from flux_runtime.weights.ip_adapter import IPAdapterWeights, read_ip_adapter

log = logging.getLogger(__name__)

# where the CLIP vision encoder is looked for when `image_encoder` is not given: an `image_encoder/` folder
# beside the adapter (diffusers' default name), then the encoder XLabs' adapter was trained with in the cache
ENCODER_FOLDER = "image_encoder"
DEFAULT_ENCODER = "openai/clip-vit-large-patch14"
IMAGE_ROLES = ("ip_adapter_image", "negative_ip_adapter_image")
# the same branches' precomputed CLIP image embeddings, which a call may pass in place of the images
EMBEDS_ROLES = ("ip_adapter_image_embeds", "negative_ip_adapter_image_embeds")


@dataclass
class LoadedIPAdapter:
    """The IP-Adapter on a pipeline: its file and fingerprint, the scales, the encoder and preprocessing."""

    path: str
    sha256: str
    scale: float | list[float]
    encoder_path: str
    image_encoder: Any  # transformers' CLIPVisionModelWithProjection
    feature_extractor: Any  # transformers' CLIPImageProcessor

    def record(self) -> dict[str, Any]:
        """The provenance entry: file name and path, sha256, scale (per block where set so), encoder."""
        return {
            "name": Path(self.path).name,
            "path": self.path,
            "sha256": self.sha256,
            "scale": self.scale,
            "image_encoder": self.encoder_path,
        }


def loaded(pipe: Any) -> LoadedIPAdapter | None:
    """The IP-Adapter on `pipe`, None without one."""
    return getattr(pipe, "_ip_adapter", None)


def check_scale(scale: object, depth: int) -> float | list[float]:
    """A finite scale, or a list of one per double block (diffusers' per-layer form)."""

    def number(s: object) -> bool:
        return not isinstance(s, bool) and isinstance(s, (int, float)) and math.isfinite(s)

    if number(scale):
        return float(scale)  # type: ignore[arg-type]
    if isinstance(scale, (list, tuple)) and all(number(s) for s in scale):
        if len(scale) != depth:
            raise FluxError(f"IP-Adapter scale: {len(scale)} scales for {depth} double blocks; give one each")
        return [float(s) for s in scale]
    raise FluxError(f"IP-Adapter scale {scale!r} must be a finite number or a list of one per double block")


def _per_block(scale: float | list[float], depth: int) -> list[float]:
    return list(scale) if isinstance(scale, list) else [scale] * depth


def encoder_source(adapter_file: Path, image_encoder: str | Path | None) -> Path:
    """The CLIP vision encoder's folder: `image_encoder` (a folder or cached id), else `image_encoder/` beside
    the adapter, else `openai/clip-vit-large-patch14` in the local cache; one FluxError naming the fix when
    none is there (nothing is downloaded)."""
    if image_encoder is not None:
        try:
            return _check_encoder(resolve(image_encoder))
        except WeightsError as e:
            raise FluxError(f"IP-Adapter image encoder: {e}") from None
    beside = adapter_file.parent / ENCODER_FOLDER
    if (beside / "config.json").is_file():
        return _check_encoder(beside)
    try:
        return _check_encoder(resolve(DEFAULT_ENCODER))
    except WeightsError:
        raise FluxError(
            f"the IP-Adapter needs a CLIP vision encoder and none was found ({ENCODER_FOLDER}/ beside "
            f"{adapter_file.name}, or {DEFAULT_ENCODER} in the local Hugging Face cache): pass image_encoder=PATH "
            "(flux-gen --ip-image-encoder PATH), a CLIPVisionModelWithProjection folder or cached id"
        ) from None


def _check_encoder(folder: Path) -> Path:
    """`folder` if its config.json is a CLIP model's (vision, or a whole CLIP holding one); read, not loaded."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict) or config.get("model_type") not in ("clip_vision_model", "clip"):
        raise FluxError(
            f"{folder} is not a CLIP vision encoder (its config.json is not a CLIP model's): pass image_encoder="
            "a CLIPVisionModelWithProjection folder or cached id"
        )
    return folder


def open_encoder(folder: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """(CLIPVisionModelWithProjection in `dtype` on `device`, eval; CLIPImageProcessor at its image size), as
    diffusers' `load_ip_adapter` makes them."""
    from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

    try:
        encoder = CLIPVisionModelWithProjection.from_pretrained(folder, dtype=dtype)
    except (OSError, ValueError) as e:
        raise FluxError(f"{folder}: cannot load the CLIP vision encoder ({str(e).splitlines()[0]})") from None
    encoder = encoder.to(device).eval()
    size = encoder.config.image_size
    return encoder, CLIPImageProcessor(size=size, crop_size=size)


def load_ip_adapter(
    pipe: Any,
    path: str | Path,
    scale: float | list[float] = 1.0,
    *,
    image_encoder: str | Path | None = None,
    image_encoder_dtype: torch.dtype = torch.float16,
) -> LoadedIPAdapter:
    """Put the IP-Adapter at `path` (a file, a folder holding `ip_adapter.safetensors`, a cached id) on the
    FLUX.1 pipeline `pipe` at `scale`, with its CLIP vision encoder (`encoder_source`); replaces one already
    there."""
    t = pipe.transformer
    cfg = t.config
    scale = check_scale(scale, cfg.depth)
    try:
        weights = read_ip_adapter(path)
    except WeightsError as e:
        raise FluxError(str(e)) from None
    _check_fits(weights, cfg, pipe.model_name)
    folder = encoder_source(weights.file, image_encoder)
    # under a memory plan the encoder loads to host memory: the plan, made again below, places it
    device = pipe.device if pipe.placement is None else torch.device("cpu")
    encoder, processor = open_encoder(folder, device, image_encoder_dtype)
    width = encoder.config.projection_dim
    if width != weights.embed_dim:
        raise FluxError(
            f"{folder}: the CLIP vision encoder gives {width}-wide image embeddings, but {weights.file.name} "
            f"projects {weights.embed_dim}-wide ones; pass the encoder it was trained with"
        )
    if loaded(pipe) is not None:
        unload_ip_adapter(pipe)
    # beside the transformer's weights, wherever they are now (a plan then packs it with them)
    adapter = build_adapter(weights, cfg, next(t.parameters()).device, pipe.dtype)
    t.set_ip_adapter(adapter)
    adapter.set_scale(_per_block(scale, cfg.depth))
    record = LoadedIPAdapter(
        str(weights.file),
        weights.sha256,
        scale,
        hub_id(image_encoder) or str(folder.absolute()),
        encoder,
        processor,
    )
    pipe._ip_adapter = record
    pipe.image_encoder = encoder
    _replan(pipe)
    log.info(
        "IP-Adapter %s: %d image tokens over %d double blocks, scale %s, encoder %s",
        weights.file.name, weights.tokens, weights.depth, scale, record.encoder_path,
    )  # fmt: skip
    return record


def _check_fits(weights: IPAdapterWeights, cfg: Any, model: str) -> None:
    """The adapter's shapes against the transformer's: token width = text width, blocks, hidden size."""
    name = weights.file.name
    if cfg.family != "flux1":
        raise FluxError(f"{name} is a FLUX.1 IP-Adapter; {model} is not a FLUX.1 model")
    hidden = weights.tensors["blocks.0.to_k_ip.weight"].shape[0]
    for what, have, want in (
        ("image token width", weights.width, cfg.context_in_dim),
        ("double blocks", weights.depth, cfg.depth),
        ("hidden size", hidden, cfg.hidden_size),
    ):
        if have != want:
            raise FluxError(
                f"{name} was made for another transformer: its {what} is {have}, {model}'s {want}"
            )


def build_adapter(weights: IPAdapterWeights, cfg: Any, device: torch.device, dtype: torch.dtype) -> IPAdapter:
    """The adapter's modules with the file's tensors cast to the transformer's dtype (diffusers loads them in
    the transformer's dtype too), on `device`."""
    with torch.device("meta"):
        adapter = IPAdapter(
            weights.embed_dim, weights.width, weights.tokens, cfg.hidden_size, cfg.num_heads, weights.depth
        )
    tensors = {k: t.to(device=device, dtype=dtype) for k, t in weights.tensors.items()}
    adapter.load_state_dict(tensors, strict=True, assign=True)
    return adapter.eval()


def _replan(pipe: Any) -> None:
    """The plan made again with the adapter's and the encoder's weights counted (the encoder moves with the
    text encoders, the adapter with the transformer): `placement.replan`."""
    from flux_runtime.pipeline import placement

    placement.replan(pipe)


def unload_ip_adapter(pipe: Any) -> None:
    """Take the IP-Adapter and its encoder off `pipe` (nothing when none is on)."""
    if loaded(pipe) is None:
        return
    pipe.transformer.set_ip_adapter(None)
    pipe._ip_adapter = pipe.image_encoder = None
    _replan(pipe)


def set_ip_adapter_scale(pipe: Any, scale: float | list[float]) -> None:
    """A new scale (or one per double block) for the loaded IP-Adapter."""
    record = loaded(pipe)
    if record is None:
        raise FluxError("no IP-Adapter is loaded: load_ip_adapter(path, scale) first")
    depth = pipe.transformer.config.depth
    record.scale = check_scale(scale, depth)
    pipe.transformer.ip_adapter.set_scale(_per_block(record.scale, depth))
    pipe._graphed.clear()  # a captured graph holds the scale it was captured with


def check_call(pipe: Any, call: Call) -> None:
    """The call's IP-Adapter inputs, before any model runs: PIL images or embeddings (`check_embeds`), only with
    an adapter loaded and on FLUX.1 text to image / img2img / inpainting / Kontext, not an image and embeddings
    for the same branch, and one of them whenever an adapter is loaded (diffusers fails without one). The
    embeddings are left in `call.inputs` as a list of one tensor (diffusers also takes a bare tensor)."""
    inputs = call.inputs
    given = [role for role in IMAGE_ROLES if inputs.get(role) is not None]
    for role in given:
        require_image(role, inputs[role], FluxError)
    embedded = [role for role in EMBEDS_ROLES if inputs.get(role) is not None]
    record = loaded(pipe)
    if record is None:
        if given or embedded:
            raise FluxError(f"{(given + embedded)[0]} needs an IP-Adapter: pipe.load_ip_adapter(path) first")
        return
    for image_role, embeds_role in zip(IMAGE_ROLES, EMBEDS_ROLES, strict=True):
        if image_role in given and embeds_role in embedded:
            raise FluxError(f"pass either {image_role} or {embeds_role}, not both")
    width = pipe.transformer.ip_adapter.embed_dim
    for role in embedded:
        inputs[role] = check_embeds(role, inputs[role], width)
    if not given and not embedded:
        raise FluxError(
            "an IP-Adapter is loaded: pass ip_adapter_image or ip_adapter_image_embeds (or a negative one), or "
            "unload_ip_adapter()"
        )
    if pipe.variant not in ("text2img", "kontext"):
        raise FluxError(
            "the IP-Adapter runs with FLUX.1 text to image, img2img, inpainting and Kontext (as diffusers' "
            f"pipelines for them), not with {pipe.model_name}, a {pipe.variant} checkpoint"
        )
    if pipe.parallel is not None:
        raise FluxError("the IP-Adapter does not run in a parallel (multi-GPU) run yet: run on one GPU")


def check_embeds(role: str, value: object, width: int) -> list[Tensor]:
    """Precomputed CLIP image embeddings for the one loaded adapter: a list of one float tensor
    (1, num_images, `width`), or that tensor alone (diffusers wraps a bare tensor in a list too).

    diffusers repeats the tensor over the call's batch on dim 0 and its attention then folds every row of it
    into the image tokens each image reads, so a batch of k rows is one prompt of k images for all the images,
    never one image per prompt; that is refused here with the shape that says it outright, (1, k, width).
    """
    shape = f"(1, num_images, {width})"
    items = [value] if isinstance(value, Tensor) else value
    if not isinstance(items, list) or not all(isinstance(t, Tensor) for t in items):
        raise FluxError(
            f"{role} must be a list of one tensor {shape} per loaded IP-Adapter, as "
            "pipe.encode_ip_adapter_image(image) returns"
        )
    if len(items) != 1:
        raise FluxError(f"{role}: {len(items)} tensors for 1 loaded IP-Adapter; pass a list of one {shape}")
    (embeds,) = items
    if embeds.dim() != 3 or embeds.shape[2] != width or embeds.shape[1] < 1:
        raise FluxError(
            f"{role}[0] must be {shape} (the adapter reads {width}-wide CLIP image embeddings), got "
            f"{tuple(embeds.shape)}: pipe.encode_ip_adapter_image(image) makes one"
        )
    if not embeds.is_floating_point():
        raise FluxError(f"{role}[0] must be a floating-point tensor, got {embeds.dtype}")
    if embeds.shape[0] != 1:
        raise FluxError(
            f"{role}[0] has batch {embeds.shape[0]}, but the call repeats one row {shape} over its images "
            f"itself; for one prompt of several images put them on dim 1 (torch.cat(embeds, dim=1)), for "
            "one image prompt per prompt run one call per prompt"
        )
    return [embeds]


def encode_images(pipe: Any, call: Call, batch: int) -> tuple[Tensor, Tensor | None]:
    """The CLIP image embeddings (batch, num_images, E) of the positive branch and, with true CFG, of the
    negative one, on the pipeline's device: a branch's given embeddings (in their dtype) or its image's (in the
    encoder's dtype; a missing side is a black image of the output size), repeated over the batch."""
    record = loaded(pipe)
    assert record is not None and call.width is not None and call.height is not None  # checked
    black = np.zeros((call.width, call.height, 3), dtype=np.uint8)  # diffusers' (width, height) order
    sides = (0, 1) if call.true_cfg_scale > 1 else (0,)
    rows: dict[int, Tensor] = {}
    for side in sides:
        embeds = call.inputs.get(EMBEDS_ROLES[side])
        if embeds is not None:
            rows[side] = embeds[0]  # a list of one, `check_embeds`
    if len(rows) < len(sides):  # the encoder on the device only when an image is encoded
        with pipe.using("text"):
            for side in sides:
                if side not in rows:
                    image = call.inputs.get(IMAGE_ROLES[side])
                    rows[side] = _embed(record, black if image is None else image)
    # prepare_ip_adapter_image_embeds: the row repeated over the batch, then moved to the device
    embeds = [torch.cat([rows[side]] * batch, dim=0).to(device=pipe.device) for side in sides]
    return embeds[0], (embeds[1] if len(embeds) > 1 else None)


def encode_image(pipe: Any, image: object) -> list[Tensor]:
    """`[embeds]`, the CLIP image embedding (1, 1, E) of `image` for the loaded adapter, in the encoder's dtype
    on the pipeline's device: what a call takes as `ip_adapter_image_embeds` in place of the image, with the
    same bits as the image gives."""
    record = loaded(pipe)
    if record is None:
        raise FluxError("no IP-Adapter is loaded: load_ip_adapter(path, scale) first")
    require_image("image", image, FluxError)
    with pipe.using("text"):
        return [_embed(record, image).to(device=pipe.device)]


def _embed(record: LoadedIPAdapter, image: Image.Image | np.ndarray) -> Tensor:
    """`FluxPipeline.encode_image` for one image, as `prepare_ip_adapter_image_embeds` shapes it: (1, 1, E) on
    the encoder's device."""
    encoder = record.image_encoder
    weight = next(encoder.parameters())
    pixels = record.feature_extractor(image, return_tensors="pt").pixel_values
    pixels = pixels.to(device=weight.device, dtype=weight.dtype)
    return encoder(pixels).image_embeds[None, :]


def record_inputs(pipe: Any, call: Call) -> dict[str, Any]:
    """Provenance: the adapter's record (file, sha256, scale, encoder), the images' fingerprints (under
    `ip_adapter_images`, by role) and, for embeddings given in place of an image, their shape, dtype and
    fingerprint (under `ip_adapter_image_embeds`, by role: a replay cannot make them again, it refuses)."""
    record = loaded(pipe)
    if record is None:
        return {}
    out: dict[str, Any] = {
        "ip_adapter": record.record(),
        "ip_adapter_images": {
            role: image_record(call.inputs[role]) for role in IMAGE_ROLES if call.inputs.get(role) is not None
        },
    }
    embeds = {role: tensor_record(call.inputs[role][0]) for role in EMBEDS_ROLES if call.inputs.get(role)}
    if embeds:
        out["ip_adapter_image_embeds"] = embeds
    return out
