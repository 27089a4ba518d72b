"""FLUX.3's prompt upsampling in the pipeline: decided and checked before any model runs, run before the text
encoder, recorded in the provenance so a replay encodes the recorded caption without the upsampler.

A call's `upsample` (None: the pipeline's default, on when it has an upsampler, as BFL recommends) and
`upsampled_prompt` (an earlier run's caption) give one of four modes, recorded as `upsample`:

- "on": the upsampler rewrites the prompt (with the reference images, in its edit mode; with layout `boxes`, in
  its layout mode) and the caption is encoded; the record keeps the prompt, the caption (`upsampled_prompt`), the
  boxes (`boxes`, 0-1) and the upsampler (`prompt_upsampler`: its id or folder, weights fingerprint, `mode` (t2i,
  i2i, t2i_bbox, i2i_bbox) and the sha256 of the mode's system prompt and scaffolds);
- "given": `upsampled_prompt` is encoded as is (a replay), the upsampler does not run;
- "off": asked off (`upsample=False` / `--no-upsample`), or `prompt_embeds` were given;
- "unavailable": the model has no upsampler (the built-in tiny FLUX.3) and none was asked for.

Asking for it where none is set, or an upsampler that is not in the local cache, is one FluxError naming the fix;
so are boxes that are malformed or point at a reference image that was not given, and boxes where the upsampler
does not run (upsample=False, a given `upsampled_prompt`, `prompt_embeds`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.state import Call
from flux_runtime.text.flux3_boxes import box_record, canvas_rows
from flux_runtime.text.flux3_upsampler import (
    PROMPTS_FILE,
    PromptUpsampler,
    UpsamplerPrompts,
    open_processor,
    prepare_upsampler_references,
    upsample_mode,
)
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve

if TYPE_CHECKING:
    from flux_runtime.pipeline.core import Recipe as Flux3Pipe  # the FLUX.3 recipe

log = logging.getLogger(__name__)


@dataclass
class UpsamplerSetting:
    """Where a pipeline's prompt upsampler is (a folder or cached id; None: it has none) and its system prompts
    (a JSON file; None: `system_prompts.json` in the upsampler's folder); the opened upsampler, once loaded."""

    source: str | Path | None = None
    prompts: str | Path | None = None
    loaded: PromptUpsampler | None = None
    processor: Any = None  # its full processor, opened for the first request with reference images


def plan(pipe: Flux3Pipe, call: Call) -> None:
    """Decide the call's upsampling mode (see the module docstring) and check what it needs, before any model runs."""
    upsample, caption = call.inputs["upsample"], call.inputs["upsampled_prompt"]
    boxes = call.inputs.get("boxes")
    setting: UpsamplerSetting = pipe.prompt_upsampler
    if upsample not in (None, True, False):
        raise FluxError(f"upsample must be True, False or None (the model's default), got {upsample!r}")
    if boxes is not None:
        _check_boxes(boxes, call)
    if caption is not None:
        if not isinstance(caption, str) or not caption.strip():
            raise FluxError("upsampled_prompt must be a non-empty string (an earlier run's caption)")
        if call.prompt_embeds is not None or upsample:
            raise FluxError(
                "upsampled_prompt replaces the upsampler's run: pass it with a prompt, not upsample=True"
            )
        call.prepared["upsample"] = "given"
        return
    if call.prompt_embeds is not None:
        if upsample:
            raise FluxError("the prompt upsampler rewrites a prompt: it cannot run on prompt_embeds")
        call.prepared["upsample"] = "off"
        return
    # layout boxes are the upsampler's input: they ask for it (checked above: not against upsample=False)
    want = (boxes is not None or setting.source is not None) if upsample is None else upsample
    if not want:
        call.prepared["upsample"] = (
            "off" if upsample is False or setting.source is not None else "unavailable"
        )
        return
    if setting.source is None:
        raise FluxError(
            f"{pipe.model_name} has no prompt upsampler{' (layout boxes need one)' if boxes is not None else ''}: "
            "name one with pipe.set_prompt_upsampler(...) / --prompt-upsampler, or pass upsample=False / "
            "--no-upsample" + (" without boxes" if boxes is not None else "")
        )
    try:
        _check_files(setting, call)
    except WeightsError as e:  # a missing or bad prompts file, a processor that cannot open: bad input here
        raise FluxError(str(e)) from None
    call.prepared["upsample"] = "on"


def caption(pipe: Flux3Pipe, call: Call) -> str | None:
    """The caption to encode instead of the prompt ("on": the upsampler's, loaded on first use; "given": the
    caller's), or None."""
    mode = call.prepared["upsample"]
    if mode == "given":
        return call.inputs["upsampled_prompt"]
    if mode != "on":
        return None
    setting: UpsamplerSetting = pipe.prompt_upsampler
    if setting.loaded is None:
        folder, prompts = call.prepared["upsampler_files"]
        device = torch.device("cpu") if _moves_text(pipe) else pipe.device
        setting.loaded = PromptUpsampler.open(
            folder, prompts, source=str(setting.source), device=device, dtype=pipe.dtype
        )
    upsampler = setting.loaded
    if setting.processor is not None:
        upsampler.processor = setting.processor
    assert isinstance(call.prompt, str)  # checked
    if _moves_text(pipe):
        upsampler.to(pipe.device)
    try:
        text = upsampler.upsample(
            call.prompt, call.prepared.get("upsampler_images", ()), boxes=call.inputs.get("boxes")
        )
    except ValueError as e:
        raise FluxError(f"prompt upsampler: {e}") from None
    finally:
        if _moves_text(pipe):
            upsampler.offload()
    call.prepared["caption"] = text
    log.info("upsampled prompt: %s", text)
    return text


def _moves_text(pipe: Flux3Pipe) -> bool:
    """The upsampler follows the text encoder: under a memory plan that takes the encoder off the GPU between
    uses, the upsampler lives in host memory and comes to the GPU only to write its caption."""
    return pipe.memory_plan.text != "resident"


def record(pipe: Flux3Pipe, call: Call) -> dict[str, Any]:
    """The provenance fields of the call's upsampling."""
    mode = call.prepared["upsample"]
    out: dict[str, Any] = {"upsample": mode}
    if mode == "given":
        out["upsampled_prompt"] = call.inputs["upsampled_prompt"]
    elif mode == "on":
        upsampler = pipe.prompt_upsampler.loaded
        assert upsampler is not None  # it ran
        mode, boxes = call.prepared["upsampler_mode"], call.inputs.get("boxes")
        out["upsampled_prompt"] = call.prepared["caption"]
        if boxes is not None:
            out["boxes"] = box_record(boxes)
        out["prompt_upsampler"] = {
            "model": upsampler.source,
            "weights": upsampler.weights,
            "mode": mode,
            "system_prompt": upsampler.prompts.fingerprint(mode),
        }
    return out


def _locate(source: str | Path) -> Path:
    """The upsampler's local folder, or one FluxError telling how to get it or go without."""
    try:
        return resolve(source)
    except WeightsError:
        raise FluxError(
            f"the prompt upsampler {source} is neither a local folder nor in the local Hugging Face cache: fetch it "
            "while online (`flux-gen --download-only` with the same model, or the pipeline loaded with download=True), "
            "or generate without it (upsample=False / --no-upsample)"
        ) from None


def _check_files(setting: UpsamplerSetting, call: Call) -> None:
    """Locate the upsampler and read its system prompts (unless loaded), prepare the references for it, and open
    its full processor where an edit request needs it."""
    assert setting.source is not None
    if setting.loaded is None:
        folder: Path | None = _locate(setting.source)
        assert folder is not None
        prompts = UpsamplerPrompts.read(folder / PROMPTS_FILE if setting.prompts is None else setting.prompts)
        call.prepared["upsampler_files"] = (folder, prompts)
    else:
        folder, prompts = setting.loaded.folder, setting.loaded.prompts
    given = _references(call)
    mode = upsample_mode(len(given), call.inputs.get("boxes") is not None)
    prompts.check_mode(mode)
    call.prepared["upsampler_mode"] = mode
    if not given:
        return
    if setting.processor is None and folder is not None:
        setting.processor = open_processor(folder)
    try:
        call.prepared["upsampler_images"] = prepare_upsampler_references(given)
    except ValueError as e:
        raise FluxError(f"prompt upsampler: {e}") from None


def _references(call: Call) -> list[Image.Image]:
    images = call.inputs["image"]
    if images is None:
        return []
    return [images] if isinstance(images, Image.Image) else list(images)


def _check_boxes(boxes: Any, call: Call) -> None:
    """Layout boxes only where the upsampler runs, and well formed for the references given; else one FluxError."""
    if call.inputs["upsampled_prompt"] is not None:
        raise FluxError(
            "boxes are the prompt upsampler's layout input and upsampled_prompt replaces its run (that caption "
            "already holds its layout): drop boxes"
        )
    if call.prompt_embeds is not None:
        raise FluxError("boxes are the prompt upsampler's layout input: it cannot run on prompt_embeds")
    if call.inputs["upsample"] is False:
        raise FluxError(
            "boxes are the prompt upsampler's layout input: drop upsample=False / --no-upsample, or the boxes"
        )
    check_boxes(boxes, len(_references(call)))


def check_boxes(boxes: Any, num_references: int) -> None:
    """One FluxError unless `boxes` are well-formed layout boxes for a request with `num_references` references."""
    try:
        canvas_rows(boxes, num_references)
    except ValueError as e:
        raise FluxError(f"boxes: {e}") from None
