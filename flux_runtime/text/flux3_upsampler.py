"""FLUX.3's optional prompt upsampler: a Qwen3.5 that rewrites a short request into the detailed caption FLUX.3 was
trained on, run through transformers `generate` as diffusers 0.42.1's modular FLUX.3 pipeline runs it.

One request per call; the mode follows the inputs: `t2i` (text only) or `i2i` (with reference images), each with a
layout form (`t2i_bbox`, `i2i_bbox`) when layout boxes are given (`flux3_boxes`). The chat is a system turn (the
mode's system prompt) and a user turn (`t2i`: the request; `i2i`: the prepared reference images, then the request
placed in the edit scaffold; the layout modes first put the request and the boxes' table into the layout request),
rendered with the generation prompt and thinking turned off, decoded greedily (`do_sample=False`) for at most
`MAX_NEW_TOKENS` new tokens under the model's own generation config; the caption is the new tokens decoded without
special tokens, stripped (an empty caption is an error), in the layout modes reconciled with the given boxes.

The system prompts, scaffolds and layout request are Black Forest Labs' text and are not part of this package: they
are read at run time from a JSON file (`UpsamplerPrompts`), by default `system_prompts.json` in the upsampler's
folder.

Text-only requests go through the upsampler's tokenizer and the processor's chat template (no image processor is
needed); requests with reference images go through its full processor (`AutoProcessor`, as diffusers loads it),
which transformers opens only with torchvision installed: its image processor has a PIL fallback, but the video
processor it opens alongside has none.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from flux_runtime.text.flux3 import processor_template
from flux_runtime.text.flux3_boxes import canvas_rows, reconcile
from flux_runtime.text.hf_weights import load_checked
from flux_runtime.text.llm import PlacedModel, check_llm_folder
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve

log = logging.getLogger(__name__)

# diffusers' / BFL's generation settings: the most new tokens, the most reference images.
MAX_NEW_TOKENS = 3584
MAX_REFERENCES = 10
PROMPTS_FILE = "system_prompts.json"
# The edit scaffold's slot for the request.
INSTRUCTION_SLOT = "{instruction}"
# How the upsampler saw reference images in training: sides multiples of 32, a pixel budget by reference count,
# an aspect ratio limit, re-encoded as JPEG at this quality.
REFERENCE_MULTIPLE = 32
MAX_ASPECT_RATIO = 200
JPEG_QUALITY = 92


def _pixel_budget(num_references: int) -> int:
    return 1024 * 1024 if num_references == 1 else 724 * 724 if num_references == 2 else 512 * 512


# What each mode sends besides the request: its system prompt, its user-turn scaffold (the edit modes: the request
# goes into `{instruction}`) and, in the layout modes, the layout request (the prompt into `{prompt}`, the box
# table as JSON into `{boxes}`), by the key each has in the prompts file.
MODE_KEYS = {
    "t2i": ("t2i",),
    "i2i": ("i2i", "i2i_scaffold"),
    "t2i_bbox": ("t2i_bbox", "layout_request"),
    "i2i_bbox": ("i2i_bbox", "i2i_bbox_scaffold", "layout_request"),
}
TEMPLATE_SLOTS = {
    "i2i_scaffold": ("instruction",),
    "i2i_bbox_scaffold": ("instruction",),
    "layout_request": ("prompt", "boxes"),
}
PROMPT_KEYS = ("t2i", "i2i", "i2i_scaffold", "t2i_bbox", "i2i_bbox", "i2i_bbox_scaffold", "layout_request")


def upsample_mode(num_references: int, layout: bool) -> str:
    """The upsampler's mode: "t2i" / "i2i" (with reference images), with "_bbox" for a layout (boxes given)."""
    return ("i2i" if num_references else "t2i") + ("_bbox" if layout else "")


@dataclass(frozen=True)
class UpsamplerPrompts:
    """The upsampler's system prompts by mode, its user-turn scaffolds and the layout request, from a JSON object
    `{"t2i": str, "i2i": str, "i2i_scaffold": str with "{instruction}", "t2i_bbox": str, "i2i_bbox": str,
    "i2i_bbox_scaffold": str with "{instruction}", "layout_request": str with "{prompt}" and "{boxes}"}` (other
    keys are ignored).

    `t2i` is required; the others only for the modes that use them (`MODE_KEYS`).
    """

    t2i: str
    i2i: str | None
    i2i_scaffold: str | None
    path: Path
    t2i_bbox: str | None = None
    i2i_bbox: str | None = None
    i2i_bbox_scaffold: str | None = None
    layout_request: str | None = None

    @classmethod
    def read(cls, path: str | Path) -> UpsamplerPrompts:
        """Read and check the file; a WeightsError names the file and what is wrong with it."""
        path = Path(path)
        if not path.is_file():
            raise WeightsError(
                f"no prompt-upsampler system prompts at {path}: they are Black Forest Labs' text, shipped as "
                f"{PROMPTS_FILE} beside the upsampler's weights (pass another file with --upsampler-prompts), "
                "or generate without the upsampler (--no-upsample / upsample=False)"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{path}: not a readable JSON file ({e})") from None
        if not isinstance(data, dict):
            raise WeightsError(f"{path}: expected a JSON object of system prompts by mode (t2i, i2i)")
        values: dict[str, str | None] = {}
        for key in PROMPT_KEYS:
            value = data.get(key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise WeightsError(f"{path}: {key!r} must be a non-empty string")
            values[key] = value
        if values["t2i"] is None:
            raise WeightsError(f"{path}: no 't2i' system prompt (the text-to-image mode's)")
        for key, slots in TEMPLATE_SLOTS.items():
            template = values[key]
            if template is not None:
                _check_template(path, key, template, slots)
        return cls(path=path, **values)  # type: ignore[arg-type]

    def check_mode(self, mode: str) -> None:
        """A WeightsError unless the file has what `mode` (`MODE_KEYS`) needs."""
        missing = [k for k in MODE_KEYS[mode] if getattr(self, k) is None]
        if missing:
            what = {
                "i2i": "upsampling a request with reference images needs the edit mode's system prompt and its "
                f"user-turn scaffold (with {INSTRUCTION_SLOT})",
                "t2i_bbox": "upsampling with layout boxes needs the layout mode's system prompt and the layout "
                "request (with {prompt} and {boxes})",
                "i2i_bbox": "upsampling with reference images and layout boxes needs the layout edit mode's system "
                f"prompt, its user-turn scaffold (with {INSTRUCTION_SLOT}) and the layout request (with {{prompt}} "
                "and {boxes})",
            }[mode]
            raise WeightsError(
                f"{self.path} has no {' and no '.join(repr(k) for k in missing)}: {what}; add them, or generate "
                "without the upsampler (--no-upsample / upsample=False)"
            )

    def fingerprint(self, mode: str) -> str:
        """sha256 of what `mode` sends besides the request (`MODE_KEYS`: its system prompt, scaffold, layout
        request)."""
        parts = [getattr(self, k) or "" for k in MODE_KEYS[mode]]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _check_template(path: Path, key: str, template: str, slots: tuple[str, ...]) -> None:
    """A WeightsError unless `template` formats with exactly `slots` (each present, no other braces)."""
    names = " and ".join("{" + s + "}" for s in slots)
    try:
        template.format(**dict.fromkeys(slots, ""))
    except (KeyError, IndexError, ValueError) as e:
        raise WeightsError(f"{path}: {key!r} must hold {names} and no other braces ({e!r})") from None
    for slot in slots:
        if "{" + slot + "}" not in template:
            what = "the request" if slot == "instruction" else f"the {slot}"
            raise WeightsError(f"{path}: {key!r} has no {{{slot}}} slot for {what}")


class PromptUpsampler(PlacedModel):
    """A Qwen3.5 prompt upsampler (`Qwen3_5ForConditionalGeneration`) with its tokenizer, chat template and system
    prompts. Open one with `from_pretrained`; `upsample(request, images)` returns the caption."""

    family = "Qwen3.5"
    model_type = "qwen3_5"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str,
        prompts: UpsamplerPrompts,
        *,
        folder: Path | None = None,
        source: str = "custom",
        weights: str = "",
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.prompts = prompts
        self.folder = folder  # where the full processor (for reference images) is opened from
        self.source = source
        self.weights = weights
        self.processor: Any = None  # the full processor, opened (`open_processor`) for the first edit request

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        *,
        prompts: str | Path | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> PromptUpsampler:
        """Open the upsampler in a folder or cached id (never the network): config, weights, tokenizer, chat template,
        and the system prompts from `prompts` (default: the folder's `system_prompts.json`)."""
        folder = resolve(path_or_id)
        prompt_file = UpsamplerPrompts.read(folder / PROMPTS_FILE if prompts is None else prompts)
        return cls.open(folder, prompt_file, source=str(path_or_id), device=device, dtype=dtype)

    @classmethod
    def open(
        cls,
        folder: Path,
        prompts: UpsamplerPrompts,
        *,
        source: str,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> PromptUpsampler:
        """`from_pretrained` with the folder resolved and the prompts read."""
        from transformers import Qwen3_5ForConditionalGeneration

        check_llm_folder(folder, cls)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        template = processor_template(folder) or tokenizer.chat_template
        if not isinstance(template, str):
            raise WeightsError(
                f"{folder}: no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json)"
            )
        model = load_checked(Qwen3_5ForConditionalGeneration, folder, dtype, device, cls.family)
        return cls(
            model,
            tokenizer,
            template,
            prompts,
            folder=folder,
            source=source,
            weights=upsampler_weights_id(folder),
        ).to(device)

    def messages(
        self,
        request: str,
        images: Sequence[Image.Image] = (),
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """The chat of one request: the mode's system turn, then the user turn (content as lists of parts). With
        layout `rows` (from `canvas_rows`) the request is first put into the layout request with the rows as JSON."""
        mode = upsample_mode(len(images), bool(rows))
        self.prompts.check_mode(mode)
        p = self.prompts
        if rows:
            assert p.layout_request is not None  # checked
            table = json.dumps(list(rows), ensure_ascii=False)
            request = p.layout_request.format(prompt=request.strip(), boxes=table)
        system = getattr(p, mode)
        if images:
            scaffold = p.i2i_bbox_scaffold if rows else p.i2i_scaffold
            assert scaffold is not None  # checked
            content = [{"type": "image", "image": image} for image in images] + [
                {"type": "text", "text": scaffold.format(instruction=request)}
            ]
        else:
            content = [{"type": "text", "text": request}]
        return [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": content},
        ]

    @torch.no_grad()
    def upsample(
        self,
        request: str,
        images: Sequence[Image.Image] = (),
        *,
        boxes: Sequence[dict[str, Any]] | None = None,
        max_new_tokens: int = MAX_NEW_TOKENS,
    ) -> str:
        """The caption for `request` (with `images`, already `prepare_upsampler_references`-ed: an edit). With layout
        `boxes` (see `flux3_boxes`: 0-1 boxes, checked here) the layout caption: the caption citing each element as
        <id>, a space, and the box table as JSON, the given boxes kept exactly."""
        if not isinstance(request, str):
            raise TypeError(
                f"the prompt upsampler takes one request (a string), got {type(request).__name__}"
            )
        rows = None if boxes is None else canvas_rows(boxes, len(images))
        messages = self.messages(request, images, rows)
        kwargs = dict(
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            enable_thinking=False,
        )
        if images:
            if self.processor is None:
                if self.folder is None:
                    raise WeightsError("this prompt upsampler has no folder to open its processor from")
                self.processor = open_processor(self.folder)
            inputs = self.processor.apply_chat_template(messages, **kwargs)
        else:
            inputs = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)
        inputs = inputs.to(self.device)
        generated = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        new = generated[0, inputs["input_ids"].shape[1] :]
        caption = self.tokenizer.decode(new, skip_special_tokens=True).strip()
        if not caption:
            raise ValueError("the prompt upsampler returned an empty caption")
        return reconcile(caption, rows) if rows else caption


def open_processor(folder: Path) -> Any:
    """The upsampler's full processor (`AutoProcessor`), which requests with reference images go through; a
    WeightsError in one line where transformers cannot open it (without torchvision: the video processor needs it)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder, local_files_only=True)
    except (ImportError, AttributeError, OSError, ValueError, TypeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise WeightsError(
            f"cannot open the prompt upsampler's processor in {folder} ({reason}); upsampling a request with "
            "reference images needs it, and transformers opens it only with torchvision: install torchvision, or "
            "generate without the upsampler (--no-upsample / upsample=False)"
        ) from None


def upsampler_weights_id(folder: Path) -> str:
    """A short fingerprint of the upsampler's weights: sha256 over its safetensors files' names, sizes, headers."""
    digest = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        digest.update(f.name.encode())
        digest.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(1 << 16))
    return digest.hexdigest()[:16]


def upsampler_reference_size(width: int, height: int, num_references: int) -> tuple[int, int]:
    """(width, height) a reference is resized to for the upsampler: sides rounded to multiples of 32 (at least 32),
    then, over the pixel budget for this many references (1 MP, 724², 512²), scaled down and floored to 32."""
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ValueError(f"reference image {width}x{height} has an aspect ratio over {MAX_ASPECT_RATIO}:1")
    m = REFERENCE_MULTIPLE

    def floor(value: float) -> int:
        return max(m, math.floor(value / m) * m)

    budget = _pixel_budget(num_references)
    w, h = max(m, round(width / m) * m), max(m, round(height / m) * m)
    if w * h > budget:
        scale = math.sqrt(width * height / budget)
        w, h = floor(width / scale), floor(height / scale)
    if w * h > budget:
        if w == m:
            h = floor(budget / w)
        else:
            w = floor(budget / h)
    return w, h


def prepare_upsampler_references(images: Sequence[Image.Image]) -> list[Image.Image]:
    """Reference images as the upsampler saw them in training: EXIF orientation applied, transparency over white,
    RGB, resized (LANCZOS) to `upsampler_reference_size`, re-encoded as JPEG at quality 92."""
    if len(images) > MAX_REFERENCES:
        raise ValueError(
            f"the prompt upsampler takes at most {MAX_REFERENCES} reference images, got {len(images)}"
        )
    return [_prepare(image, len(images)) for image in images]


def _prepare(image: Image.Image, count: int) -> Image.Image:
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    image = image.convert("RGB")
    size = upsampler_reference_size(image.width, image.height, count)
    if image.size != size:
        image = image.resize(size, Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
