"""LoRAs on a pipeline: fuse a file into the loaded models, record it, take every LoRA out again.

What a pipeline holds between calls (`PipelineLoras`): the fused state of its transformer and CLIP-L
encoder, each LoRA's record (file, sha256 of its bytes, scale, layout), and the variant it had before a
control LoRA widened `img_in` (FLUX.1 then runs as FluxControlPipeline does). CUDA graphs hold the old
weights' addresses, so every change drops them; the next call captures new ones.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from flux_runtime.pipeline.errors import FluxError
from flux_runtime.weights.lora import FusedState, fuse, unfuse
from flux_runtime.weights.lora_formats import convert, open_lora, read_lora
from flux_runtime.weights.lora_layers import LayerTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedLora:
    """One fused LoRA: where it came from, its fingerprint and scale, and what it changed."""

    path: str  # the file read
    sha256: str  # of the file's bytes
    scale: float
    format: str  # the layout read from its keys: diffusers, kohya, xlabs, bfl, bfl-control
    layers: int  # transformer projections changed
    text_layers: int  # CLIP-L projections changed
    fp8_layers: int  # of `layers`, FP8 ones dequantized, fused in bf16 and requantized
    widened: str | None = None  # "img_in 64 -> 128" for a control LoRA
    gguf_layers: int = 0  # of `layers`, GGUF ones replaced by their dequantized weight (compute dtype)

    def record(self) -> dict[str, Any]:
        """The provenance entry: file name and path, sha256, scale, layout."""
        return {
            "name": Path(self.path).name,
            "path": self.path,
            "sha256": self.sha256,
            "scale": self.scale,
            "format": self.format,
        }


@dataclass
class PipelineLoras:
    state: FusedState = field(default_factory=FusedState)
    loaded: list[LoadedLora] = field(default_factory=list)
    variant: str | None = None  # FLUX.1's variant before a control LoRA


def split_spec(spec: str) -> tuple[str, float]:
    """A command line's `PATH[:SCALE]` → (path, scale): a suffix that is not a number belongs to the path (a
    Windows drive, an id), none means 1.0; a ValueError for a scale that is not finite."""
    path, _, tail = spec.rpartition(":")
    if not path:
        return spec, 1.0
    try:
        scale = float(tail)
    except ValueError:
        return spec, 1.0
    if not math.isfinite(scale):
        raise ValueError(f"the scale {tail} must be a finite number")
    return path, scale


def check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise FluxError(f"LoRA scale {scale!r} must be a finite number")
    return float(scale)


def _clip(pipe: Any) -> nn.Module | None:
    """CLIP-L of a FLUX.1 pipeline (the text encoder LoRAs train), None for FLUX.2 and FLUX.3."""
    return getattr(pipe.text_encoder, "clip", None)


def holder(pipe: Any) -> PipelineLoras:
    if getattr(pipe, "_loras", None) is None:
        pipe._loras = PipelineLoras()
    return pipe._loras


def load_lora(pipe: Any, path: str | Path, scale: float = 1.0) -> LoadedLora:
    """Fuse the LoRA at `path` (a file, a folder with one, or a cached hub id) at `scale` into `pipe`."""
    scale = check_scale(scale)
    file, data, sha = open_lora(path)
    loras = holder(pipe)
    if any(lo.sha256 == sha for lo in loras.loaded):
        raise FluxError(f"{file.name} is already fused; call unload_loras() first to change its scale")
    sd, metadata = read_lora(data, file.name)
    del data
    clip = _clip(pipe)
    clip_names = None if clip is None else {n for n, m in clip.named_modules() if isinstance(m, nn.Linear)}
    table = LayerTable.of(pipe.transformer)
    weights = convert(sd, metadata, table, clip_names, file.name)
    moving = _off_device(pipe)
    report = fuse(
        pipe.transformer, table, weights, scale, loras.state,
        text_encoder=clip, name=file.name,
    )  # fmt: skip
    pipe._graphed.clear()  # graphs replay the old weights' addresses
    # GGUF layers grew to the compute dtype; under a plan that moves models the fused tensors are new: packed anew
    if report.gguf_layers or moving:
        from flux_runtime.pipeline import placement

        placement.replan(pipe)
    if report.widened is not None and hasattr(pipe, "input_widened"):  # a recipe with variants (FLUX.1)
        if loras.variant is None:
            loras.variant = pipe.variant
        pipe.input_widened(file.name)
    loaded = LoadedLora(
        str(file), sha, scale, weights.format, report.layers, report.text_layers, report.fp8_layers,
        report.widened, report.gguf_layers,
    )  # fmt: skip
    loras.loaded.append(loaded)
    log.info(
        "fused %s (%s layout, scale %g): %d transformer layers (%d FP8), %d CLIP layers",
        file.name, weights.format, scale, report.layers, report.fp8_layers, report.text_layers,
    )  # fmt: skip
    return loaded


def unload_loras(pipe: Any) -> None:
    """Restore every layer the LoRAs changed to its original tensors (bit for bit)."""
    loras = holder(pipe)
    if not loras.loaded:
        return
    gguf = any(lo.gguf_layers for lo in loras.loaded)
    moving = _off_device(pipe)
    unfuse(pipe.transformer, _clip(pipe), loras.state)
    if loras.variant is not None:
        pipe.variant = loras.variant
    loras.loaded.clear()
    loras.variant = None
    pipe._graphed.clear()
    if gguf or moving:  # the GGUF layers are back, the originals are other tensors: packed anew
        from flux_runtime.pipeline import placement

        placement.replan(pipe)


def _off_device(pipe: Any) -> bool:
    """Whether a memory plan moves any of `pipe`'s models; if so, every moved model is taken off the device first.

    Between calls a moved model's tensors are views of its device copy, or, for a streamed layer, of a ring slot
    that holds whichever block was copied there last: a fuse must read and change the host bytes instead. Its
    saved and fused tensors are new ones, outside the packed units, so the caller re-plans after (`replan`
    packs the models again from the tensors they hold then)."""
    placement = getattr(pipe, "placement", None)
    if placement is None or all(m.mode == "resident" for m in placement.models.values()):
        return False
    placement.reset()
    return True


def provenance_fields(pipe: Any) -> dict[str, Any]:
    """`loras` (each file's record) and, on an FP8 or GGUF model, `lora_fp8` / `lora_gguf` saying how they
    were fused."""
    loaded = holder(pipe).loaded
    if not loaded:
        return {}
    out: dict[str, Any] = {"loras": [lo.record() for lo in loaded]}
    gguf = sum(lo.gguf_layers for lo in loaded)
    if gguf:
        out["lora_gguf"] = f"{gguf} GGUF layers dequantized (diffusers' bits) and the LoRAs fused there"
    fp8 = len(holder(pipe).state.fp8_pieces)
    if fp8:
        out["lora_fp8"] = (
            f"{fp8} FP8 layers dequantized, LoRAs fused in bf16, requantized (e4m3, per-channel scales)"
        )
    return out
