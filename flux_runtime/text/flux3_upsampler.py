"""FLUX.3's optional prompt upsampler: a Qwen3.5 that rewrites a short request into the detailed caption FLUX.3 was
trained on, run through transformers `generate` as diffusers 0.42.1's modular FLUX.3 pipeline runs it.

One request per call; the mode follows the inputs: `t2i` (text only) or `i2i` (with reference images). The chat is
a system turn (the mode's system prompt) and a user turn (`t2i`: the request; `i2i`: the prepared reference images,
then the request placed in the edit scaffold), rendered with the generation prompt and thinking turned off, decoded
greedily (`do_sample=False`) for at most `MAX_NEW_TOKENS` new tokens under the model's own generation config; the
caption is the new tokens decoded without special tokens, stripped. An empty caption is an error.

The system prompts and the edit scaffold are Black Forest Labs' text and are not part of this package: they are read
at run time from a JSON file (`UpsamplerPrompts`), by default `system_prompts.json` in the upsampler's folder.

Text-only requests go through the upsampler's tokenizer and the processor's chat template (no image processor is
needed); requests with reference images go through its full processor (`AutoProcessor`), which transformers opens
only where its image and video processors can load (they need torchvision).
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

from flux_runtime.text.flux2 import _check_model_folder, _load_model
from flux_runtime.text.flux3 import _processor_template
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


@dataclass(frozen=True)
class UpsamplerPrompts:
    """The upsampler's system prompts by mode and the edit scaffold, from a JSON object
    `{"t2i": str, "i2i": str, "i2i_scaffold": str with "{instruction}", ...}` (other keys are ignored).

    `t2i` is required; `i2i` and `i2i_scaffold` only for requests with reference images.
    """

    t2i: str
    i2i: str | None
    i2i_scaffold: str | None
    path: Path

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
        for key in ("t2i", "i2i", "i2i_scaffold"):
            value = data.get(key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise WeightsError(f"{path}: {key!r} must be a non-empty string")
            values[key] = value
        if values["t2i"] is None:
            raise WeightsError(f"{path}: no 't2i' system prompt (the text-to-image mode's)")
        scaffold = values["i2i_scaffold"]
        if scaffold is not None:
            try:
                scaffold.format(instruction="")
            except (KeyError, IndexError, ValueError) as e:
                raise WeightsError(
                    f"{path}: 'i2i_scaffold' must hold {INSTRUCTION_SLOT} and no other braces ({e!r})"
                ) from None
            if INSTRUCTION_SLOT not in scaffold:
                raise WeightsError(f"{path}: 'i2i_scaffold' has no {INSTRUCTION_SLOT} slot for the request")
        return cls(values["t2i"], values["i2i"], scaffold, path)  # type: ignore[arg-type]

    def check_mode(self, mode: str) -> None:
        """A WeightsError unless the file has what `mode` ("t2i" / "i2i") needs."""
        if mode == "i2i" and (self.i2i is None or self.i2i_scaffold is None):
            missing = [k for k in ("i2i", "i2i_scaffold") if getattr(self, k) is None]
            raise WeightsError(
                f"{self.path} has no {' and no '.join(repr(k) for k in missing)}: upsampling a request with "
                "reference images needs the edit mode's system prompt and its user-turn scaffold (with "
                f"{INSTRUCTION_SLOT}); add them, or generate without the upsampler (--no-upsample / upsample=False)"
            )

    def fingerprint(self, mode: str) -> str:
        """sha256 of what `mode` sends besides the request (its system prompt, and the scaffold for i2i)."""
        parts = [self.t2i] if mode == "t2i" else [self.i2i or "", self.i2i_scaffold or ""]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()


class PromptUpsampler:
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

    @property
    def device(self) -> torch.device:
        return self.model.device

    def to(self, device: torch.device | str) -> PromptUpsampler:
        self.model.to(device)
        return self

    def offload(self) -> PromptUpsampler:
        self.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self

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

        _check_model_folder(folder, cls)  # type: ignore[arg-type]
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        template = _processor_template(folder) or tokenizer.chat_template
        if not isinstance(template, str):
            raise WeightsError(
                f"{folder}: no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json)"
            )
        model = _load_model(Qwen3_5ForConditionalGeneration, folder, dtype, cls)  # type: ignore[arg-type]
        return cls(
            model,
            tokenizer,
            template,
            prompts,
            folder=folder,
            source=source,
            weights=upsampler_weights_id(folder),
        ).to(device)

    def messages(self, request: str, images: Sequence[Image.Image] = ()) -> list[dict[str, Any]]:
        """The chat of one request: the mode's system turn, then the user turn (content as lists of parts)."""
        if images:
            self.prompts.check_mode("i2i")
            assert self.prompts.i2i is not None and self.prompts.i2i_scaffold is not None
            system = self.prompts.i2i
            text = self.prompts.i2i_scaffold.format(instruction=request)
            content = [{"type": "image", "image": image} for image in images] + [
                {"type": "text", "text": text}
            ]
        else:
            system, content = self.prompts.t2i, [{"type": "text", "text": request}]
        return [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": content},
        ]

    @torch.no_grad()
    def upsample(
        self, request: str, images: Sequence[Image.Image] = (), *, max_new_tokens: int = MAX_NEW_TOKENS
    ) -> str:
        """The caption for `request` (with `images`, already `prepare_upsampler_references`-ed: an edit)."""
        if not isinstance(request, str):
            raise TypeError(
                f"the prompt upsampler takes one request (a string), got {type(request).__name__}"
            )
        messages = self.messages(request, images)
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
        return caption


def open_processor(folder: Path) -> Any:
    """The upsampler's full processor (`AutoProcessor`), which requests with reference images go through; a
    WeightsError in one line where transformers cannot open it (its image and video processors need torchvision)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder, local_files_only=True)
    except (ImportError, AttributeError, OSError, ValueError, TypeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise WeightsError(
            f"cannot open the prompt upsampler's processor in {folder} ({reason}); upsampling a request with "
            "reference images needs it, and its image processor needs torchvision: install torchvision, or "
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
