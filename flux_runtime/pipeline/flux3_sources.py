"""What FLUX.3's recipe opens from its located sources: the transformer, VAE and Qwen3-VL text encoder, the
schedule's shift and the CFG scale of a folder's configs, and the prompt upsampler paired with the model."""

from __future__ import annotations

from pathlib import Path

import torch

from flux_runtime.models.dit.flux3 import Flux3Transformer
from flux_runtime.models.vae import Flux2VAE
from flux_runtime.pipeline import placement, text_warmup
from flux_runtime.pipeline.checks import (
    check_latent_widths,
)
from flux_runtime.pipeline.core import Recipe, settle
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.provenance import weights_id
from flux_runtime.pipeline.sources import Sources
from flux_runtime.pipeline.tiers import Tier
from flux_runtime.registry import QWEN3_VL_4B_ID, spec_for
from flux_runtime.sampling.flux3 import FLUX3_SCHEDULE
from flux_runtime.sampling.schedule import ScheduleConfig
from flux_runtime.text.flux3 import Flux3TextEncoder
from flux_runtime.weights import load_transformer
from flux_runtime.weights.checkpoint import TransformerCheckpoint
from flux_runtime.weights.config_files import read_json_if_present
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.vae import load_vae

__all__ = ["DEFAULT_GUIDANCE", "open_flux3"]

# diffusers' FLUX.3 guider CFG scale, when a folder's guider config gives none
DEFAULT_GUIDANCE = 3.5


def open_flux3(
    cls: type[Recipe],
    src: Sources,
    *,
    device: torch.device,
    dtype: torch.dtype,
    quality: Tier = "lossless",
    text_encoder: str | Path | None = None,
    cuda_graphs: bool = True,
    offload_text_encoders: bool = False,
    checkpoint: TransformerCheckpoint | None = None,
    fp8: bool = False,
    fp8_text: bool = False,
    budget: int | None = None,
) -> Recipe:
    """`cls` (FLUX.3's recipe) with the parts `find_sources` located. The text encoder: the folder's `text_encoder/` + `tokenizer/`;
    else `text_encoder` (a diffusers FLUX.3 folder, or a Qwen3-VL folder / cached id); else Qwen3-VL-4B-Instruct;
    a built-in random model gets the tiny Qwen3-VL. The schedule's shift and the CFG scale come from the folder's
    `scheduler/` and `guider/` configs when it has them. `fp8` / `fp8_text`: quantize the transformer's block
    projections / the text encoder's decoder layers to FP8 at load (bf16). `budget`: the memory budget the
    plan is chosen for (`Pipeline.from_pretrained`'s `memory`; None: everything on the device)."""
    dit_device = placement.transformer_device(budget, checkpoint, dtype, fp8, device)
    vae = load_vae(src.vae, device=device, dtype=dtype)
    if not isinstance(vae, Flux2VAE):
        raise FluxError(f"{src.vae} is a {vae.config.family} autoencoder; FLUX.3 needs the FLUX.2 VAE")
    sources = [text_encoder] if text_encoder is not None else [src.text] if src.text is not None else None
    spec = spec_for(src.name)
    if spec is not None and spec.builtin and text_encoder is None:
        sources = []  # a built-in model's small encoders
    text_device = placement.text_device(
        budget, device, offload_text_encoders, sources,
        beside=placement.checkpoint_bytes(checkpoint, dtype, fp8) if dit_device == device else 0,
    )  # fmt: skip

    def open_text() -> Flux3TextEncoder:
        text = _open_text(src, text_encoder, text_device, dtype)
        if fp8_text:
            text.quantize_fp8()
        return text

    # on a GPU the text encoder loads first, warmed up while the transformer streams in (`text_warmup`)
    text = open_text() if text_warmup.loads_first(text_device, sources) else None
    with text_warmup.warming(text, text_device):
        transformer = load_transformer(checkpoint or src.transformer, device=dit_device, dtype=dtype, fp8=fp8)
    assert isinstance(transformer, Flux3Transformer)  # dispatched on the keys
    check_latent_widths(transformer, vae, src.name)
    if text is None:
        text = open_text()
    pipe = cls(
        transformer, vae, text, schedule=_schedule_config(src.scheduler_config),
        guidance=_guider_scale(src), model_name=src.name, weights_id=weights_id(src), quality=quality,
        cuda_graphs=cuda_graphs, prompt_upsampler=_upsampler_source(src),
    )  # fmt: skip
    return settle(
        pipe,
        src,
        fp8_text=fp8_text,
        budget=budget,
        offload_text_encoders=offload_text_encoders,
        device=device,
    )


def _upsampler_source(src: Sources) -> str | Path | None:
    """The prompt upsampler paired with these sources: a folder's `prompt_upsampler/`, else the registry's."""
    root = Path(src.transformer)
    if root.is_dir() and (root / "prompt_upsampler").is_dir():
        return root / "prompt_upsampler"
    spec = spec_for(src.name)
    return None if spec is None else spec.upsampler


def _schedule_config(scheduler: dict | None) -> ScheduleConfig:
    """The static shift of the folder's scheduler (FLUX.3 samples with 6.93), refusing settings it does not use."""
    if scheduler is None:
        return FLUX3_SCHEDULE
    unsupported = [
        k for k in ("use_dynamic_shifting", "shift_terminal", "use_karras_sigmas") if scheduler.get(k)
    ]
    if unsupported:
        raise WeightsError(
            f"scheduler_config.json asks for {', '.join(unsupported)}, which FLUX.3 sampling does not use"
        )
    return ScheduleConfig(
        num_train_timesteps=int(scheduler.get("num_train_timesteps", 1000)),
        shift=float(scheduler.get("shift", FLUX3_SCHEDULE.shift)),
    )


def _guider_scale(src: Sources) -> float:
    """The CFG scale of a folder's `guider/guider_config.json` (diffusers' modular layout), else 3.5."""
    root = Path(src.transformer)
    if not root.is_dir():
        return DEFAULT_GUIDANCE
    cfg = read_json_if_present(root / "guider" / "guider_config.json")
    scale = (cfg or {}).get("guidance_scale", DEFAULT_GUIDANCE)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise WeightsError(
            f"{root / 'guider' / 'guider_config.json'}: guidance_scale must be a number, got {scale!r}"
        )
    return float(scale)


def _open_text(
    src: Sources, text_encoder: str | Path | None, device: torch.device, dtype: torch.dtype
) -> Flux3TextEncoder:
    """The FLUX.3 text encoder for these sources (see `Flux3Pipe.from_sources`)."""
    spec = spec_for(src.name)
    if spec is not None and spec.builtin and text_encoder is None:
        return Flux3TextEncoder.tiny(device=device, dtype=dtype)
    if text_encoder is None and src.text is not None:
        return Flux3TextEncoder.from_pretrained(src.text, device=device, dtype=dtype)
    if text_encoder is not None:
        from flux_runtime.weights.hub import resolve

        root = resolve(text_encoder)
        if (root / "text_encoder").is_dir():  # a whole diffusers FLUX.3 folder
            return Flux3TextEncoder.from_pretrained(root, device=device, dtype=dtype)
        return Flux3TextEncoder.from_components(root, device=device, dtype=dtype)
    return Flux3TextEncoder.from_components(QWEN3_VL_4B_ID, device=device, dtype=dtype)
