"""What a generated image records about itself: the PNG text chunk that `flux-gen --replay` reads."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

import flux_runtime
from flux_runtime.pipeline.sources import Sources
from flux_runtime.weights.builtin import builtin
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.transformer import find_transformer_files


def weights_id(src: Sources) -> str:
    """A short fingerprint of the transformer weights: sha256 over its files' names, sizes and headers.

    Built-in models name themselves: `tiny-seed0` (random), `tiny-trained-<sha256 of the shipped file>`.
    """
    spec = builtin(src.name)
    if spec is not None:
        return spec.weights_id()
    digest = hashlib.sha256()
    for f in find_transformer_files(resolve(src.transformer)):
        digest.update(f.name.encode())
        digest.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(1 << 16))
    return digest.hexdigest()[:16]


def provenance(
    *,
    prompt: object,
    seed: int | None,
    height: int,
    width: int,
    steps: int,
    guidance: float | None,
    max_sequence_length: int,
    tier: str,
    cuda_graphs: bool,
    model: str,
    weights: str,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """The generation record every pipeline writes into `PipelineOutput.info` (JSON-serialisable)."""
    return {
        "prompt": prompt,
        "seed": seed,
        "height": height,
        "width": width,
        "num_steps": steps,
        "guidance": guidance,
        "max_sequence_length": max_sequence_length,
        "model": model,
        "weights": weights,
        "quality": tier,
        "cuda_graphs": cuda_graphs,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "flux_runtime": flux_runtime.__version__,
        "torch": torch.__version__,
    }


def save_png(image: Image.Image, path: Path, info: dict[str, Any]) -> None:
    """Write `image` with the provenance in PNG text chunks (`flux_runtime` JSON + a readable summary)."""
    meta = PngInfo()
    meta.add_text("flux_runtime", json.dumps(info, default=str))
    meta.add_text("Description", str(info.get("prompt", "")))
    meta.add_text("Software", f"flux-runtime {flux_runtime.__version__}")
    image.save(path, pnginfo=meta)
