"""What FLUX.2's recipe opens from its located sources: the transformer, the VAE and the one text encoder
([dev]: Mistral Small, [klein]: Qwen3), told by a folder's config or by BFL's pairing for a transformer file."""

from __future__ import annotations

from pathlib import Path

import torch

from flux_runtime.models.dit import Flux2Transformer
from flux_runtime.models.vae import Flux2VAE
from flux_runtime.parallel.group import World
from flux_runtime.parallel.ulysses import SequenceParallel
from flux_runtime.pipeline import placement, text_warmup
from flux_runtime.pipeline.checks import (
    check_latent_widths,
)
from flux_runtime.pipeline.core import Recipe, settle
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.provenance import weights_id
from flux_runtime.pipeline.sources import Sources, flux2_schedule_config
from flux_runtime.pipeline.tiers import Tier
from flux_runtime.registry import (
    FLUX2_DEV_TEXT_ENCODERS,
    KLEIN_TEXT_ENCODERS,
    MISTRAL_PROCESSOR_ID,
)
from flux_runtime.text.flux2 import Flux2TextEncoder, KleinTextEncoder
from flux_runtime.weights import load_transformer
from flux_runtime.weights.builtin import builtin as builtin_files
from flux_runtime.weights.checkpoint import TransformerCheckpoint
from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.vae import load_vae

__all__ = ["TextEncoder", "open_flux2"]

TextEncoder = Flux2TextEncoder | KleinTextEncoder


def open_flux2(
    cls: type[Recipe],
    src: Sources,
    *,
    device: torch.device,
    dtype: torch.dtype,
    quality: Tier = "lossless",
    text_encoder: str | Path | None = None,
    text_encoder_2: str | Path | None = None,
    cuda_graphs: bool = True,
    offload_text_encoders: bool = False,
    is_distilled: bool | None = None,
    fp8: bool = False,
    checkpoint: TransformerCheckpoint | None = None,
    budget: int | None = None,
    fp8_text: bool = False,
    parallel: World | None = None,
) -> Recipe:
    """`cls` (FLUX.2's recipe) with the parts `find_sources` located (arguments checked by `Pipeline.from_pretrained`;
    `checkpoint`: the transformer already opened there, so its headers are not read again).

    The text encoder: the folder's `text_encoder/` + `tokenizer/` (Mistral3 or Qwen3, told by its
    config.json); else `text_encoder` (a diffusers FLUX.2 folder or a model folder / cached id); else, for a
    BFL file set, BFL's choice for this transformer: Mistral Small 3.2 with Mistral Small 3.1's processor
    ([dev]), Qwen3-4B or Qwen3-8B by the transformer's text width ([klein]).
    `parallel`: this process's rank of a parallel run (the text encoder loads on rank 0 only).
    """
    if text_encoder_2 is not None:
        raise FluxError("FLUX.2 has one text encoder: pass text_encoder=, not text_encoder_2=")
    dit_device = placement.transformer_device(budget, checkpoint, dtype, fp8, device)
    vae = load_vae(src.vae, device=device, dtype=dtype)
    if not isinstance(vae, Flux2VAE):
        raise FluxError(f"{src.vae} is a {vae.config.family} autoencoder; FLUX.2 needs the FLUX.2 VAE")
    main = parallel is None or parallel.is_main  # only rank 0 encodes
    sources = [text_encoder] if text_encoder is not None else [src.text] if src.text is not None else None
    if builtin_files(src.name) is not None and text_encoder is None:
        sources = []  # a built-in model's small encoders
    text_device = placement.text_device(
        budget, device, offload_text_encoders, sources,
        beside=placement.checkpoint_bytes(checkpoint, dtype, fp8) if dit_device == device else 0,
    )  # fmt: skip

    def open_text(transformer: Flux2Transformer | None) -> TextEncoder:
        text = _open_text(src, text_encoder, transformer, text_device, dtype)
        if fp8_text:
            text.quantize_fp8()
        return text

    # on a GPU the text encoder loads first, warmed up while the transformer streams in (`text_warmup`), unless it
    # is the one BFL pairs with the transformer, told by the transformer's widths
    text = open_text(None) if main and text_warmup.loads_first(text_device, sources) else None
    with text_warmup.warming(text, text_device):
        transformer = load_transformer(checkpoint or src.transformer, device=dit_device, dtype=dtype, fp8=fp8)
    assert isinstance(transformer, Flux2Transformer)  # dispatched on the keys
    sharded = None if parallel is None else SequenceParallel(transformer, parallel)  # heads checked first
    check_latent_widths(transformer, vae, src.name)
    if main and text is None:
        text = open_text(transformer)
    distilled = (src.model_index or {}).get("is_distilled", False) if is_distilled is None else is_distilled
    if not isinstance(distilled, bool):
        raise WeightsError(f"model_index.json: is_distilled must be true or false, got {distilled!r}")
    pipe = cls(
        transformer,
        vae,
        text,
        schedule=flux2_schedule_config(src.scheduler_config),
        is_distilled=distilled,
        model_name=src.name,
        weights_id=weights_id(src),
        quality=quality,
        cuda_graphs=cuda_graphs,
    )
    return settle(
        pipe, src, fp8_text=fp8_text, budget=budget, offload_text_encoders=offload_text_encoders, device=device,
        parallel=parallel, sharded=sharded,
    )  # fmt: skip


def _open_text(
    src: Sources,
    text_encoder: str | Path | None,
    transformer: Flux2Transformer | None,
    device: torch.device,
    dtype: torch.dtype,
) -> TextEncoder:
    """The FLUX.2 text encoder for these sources (see `Flux2Pipe.from_sources`); `transformer` is needed (and
    only then) for a BFL file set with no `text_encoder`, whose encoder BFL pairs with the transformer."""
    spec = builtin_files(src.name)
    if spec is not None and spec.trained and text_encoder is None:  # the encoder it was trained with
        return KleinTextEncoder.from_components(spec.folder / "text_encoder", device=device, dtype=dtype)
    if spec is not None and text_encoder is None:
        return KleinTextEncoder.tiny(device=device, dtype=dtype)
    if text_encoder is None and src.text is not None:
        return _encoder_class(src.text / "text_encoder").from_pretrained(src.text, device=device, dtype=dtype)
    if text_encoder is not None:
        from flux_runtime.weights.hub import resolve

        root = resolve(text_encoder)
        if (root / "text_encoder").is_dir():  # a whole diffusers FLUX.2 folder
            return _encoder_class(root / "text_encoder").from_pretrained(root, device=device, dtype=dtype)
        if _encoder_class(root) is Flux2TextEncoder:
            return Flux2TextEncoder.from_components(root, MISTRAL_PROCESSOR_ID, device=device, dtype=dtype)
        return KleinTextEncoder.from_components(root, device=device, dtype=dtype)
    # a BFL file set: the encoder BFL pairs with this transformer
    assert transformer is not None  # `open_flux2` loads the encoder after the transformer here
    cfg = transformer.config
    if cfg.guidance_embed:
        return Flux2TextEncoder.from_components(*FLUX2_DEV_TEXT_ENCODERS, device=device, dtype=dtype)
    if cfg.context_in_dim not in KLEIN_TEXT_ENCODERS:
        raise FluxError(
            f"no known [klein] text encoder is {cfg.context_in_dim} wide: pass text_encoder=<Qwen3 folder or id>"
        )
    return KleinTextEncoder.from_components(
        KLEIN_TEXT_ENCODERS[cfg.context_in_dim], device=device, dtype=dtype
    )


def _encoder_class(folder: Path) -> type[Flux2TextEncoder] | type[KleinTextEncoder]:
    """Mistral3 ([dev]) or Qwen3 ([klein]), told by the model folder's config.json `model_type`."""
    config = folder / "config.json"
    if not config.is_file():
        raise WeightsError(f"{folder}: no config.json; expected a Mistral3 or Qwen3 text encoder")
    model_type = read_json_object(config).get("model_type")
    for cls in (Flux2TextEncoder, KleinTextEncoder):
        if model_type == cls.model_type:
            return cls
    raise WeightsError(
        f"{folder} holds a {model_type!r} model; FLUX.2 reads Mistral3 ([dev]) or Qwen3 ([klein])"
    )
