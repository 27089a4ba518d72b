"""`Pipeline`, the one way in: `Pipeline.from_pretrained` reads a checkpoint's family once and builds its recipe.

The family is told by the transformer's tensors (`open_family`), never by a name alone; the arguments every
family shares are checked here once, before anything loads, and the family's recipe (`Flux1Pipe`, `Flux2Pipe`,
`Flux3Pipe`) loads its parts from the located sources. `Pipeline` is also the FLUX.1 recipe under its public
name, so `Pipeline(transformer, vae, text_encoder, ...)` builds a FLUX.1 pipeline from its parts and a FLUX.1
checkpoint opens as a `Pipeline`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flux_runtime.kernels import warmup
from flux_runtime.parallel.group import ParallelConfig, as_config, join, launched_world_size
from flux_runtime.pipeline import flux1_variants, placement
from flux_runtime.pipeline.arguments import reject_unknown_load
from flux_runtime.pipeline.checks import check_device
from flux_runtime.pipeline.downloads import fetch_model
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.flux1 import Flux1Pipe
from flux_runtime.pipeline.sources import find_sources, open_family
from flux_runtime.pipeline.step_caching import as_policy
from flux_runtime.pipeline.tiers import Tier
from flux_runtime.registry import Variant
from flux_runtime.sampling.step_cache import CachePolicy
from flux_runtime.weights.download import downloads_allowed
from flux_runtime.weights.pinned_stream import keep_ring
from flux_runtime.weights.redux import find_redux

if TYPE_CHECKING:
    from flux_runtime.pipeline.flux2 import Flux2Pipe
    from flux_runtime.pipeline.flux3 import Flux3Pipe

__all__ = ["Pipeline"]


class Pipeline(Flux1Pipe):
    """A FLUX pipeline. Open any family's with `from_pretrained`; built from parts, FLUX.1 [dev] / [schnell]
    text to image, true CFG and the FLUX.1 variants (see `Flux1Pipe`)."""

    @classmethod
    @keep_ring()  # every component's GPU load shares one pinned ring
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        quality: Tier = "lossless",
        vae: str | Path | None = None,
        text_encoder: str | Path | None = None,
        text_encoder_2: str | Path | None = None,
        cuda_graphs: bool = True,
        offload_text_encoders: bool = False,
        is_distilled: bool | None = None,
        fp8: bool = False,
        variant: Variant | None = None,
        memory: str | int | None = "auto",
        fp8_text: bool = False,
        parallel: ParallelConfig | int | None = None,
        download: bool = True,
        cache: str | CachePolicy | None = None,
        controlnet: Any = None,
        redux: str | Path | None = None,
        redux_image_encoder: str | Path | None = None,
        **unknown: Any,
    ) -> Pipeline | Flux2Pipe | Flux3Pipe:
        """Open a FLUX.1 pipeline, or a FLUX.2 one (`Flux2Pipe`) or FLUX.3 one (`Flux3Pipe`) when the transformer's
        keys are theirs.

        `path_or_id`: `tiny` / `tiny-flux2` (built in, random, offline), a registry name (`flux1-dev`,
        `flux1-schnell`, `flux1-kontext-dev`, `flux1-fill-dev`, `flux1-depth-dev`, `flux1-canny-dev`,
        `flux2-dev`, `flux2-klein-4b`, `flux2-klein-9b`) or any Hugging Face model id, a diffusers pipeline
        folder, or a BFL transformer file (then `ae.safetensors` beside it, or `vae=`;
        FLUX.1: CLIP-L and T5 from `text_encoder` / `text_encoder_2`, folders or cached ids, default
        openai/clip-vit-large-patch14 and google/t5-v1_1-xxl; FLUX.2: its one LLM from `text_encoder`, default
        the one BFL pairs with the transformer, see `Flux2Pipe.from_sources`).
        `quality`: `lossless` (bit-identical to diffusers) or `high` (approximate fused kernels).
        `is_distilled` (FLUX.2 [klein] only): whether the model is step-distilled (no CFG); default: the
        folder's model_index.json, else False. BFL klein files carry no such flag: say so here.
        `fp8`: quantize the transformer's block projections to e4m3 at load (bf16 only; FP8 checkpoints
        load as FP8 without it). Precision is the model's, orthogonal to `quality`; the provenance records it.
        `variant` (FLUX.1): `kontext` for a Kontext checkpoint that is neither a diffusers folder saying so
        (model_index.json) nor a registry name; Fill and Depth/Canny are told by the transformer's width.
        `memory`: the GPU memory budget, "auto" (the GPU's free memory; off a GPU: no plan), a size ("24GB",
        "512MB", bytes) or None (everything on the device, as before plans). The plan it picks (resident,
        offload-text, swap, stream; see `flux_runtime.pipeline.memory`) is logged once and recorded in the
        provenance; it moves weights, never changes bits. `offload_text_encoders` asks for at least the
        offload-text plan. `fp8_text`: quantize the text encoders' layers (T5 / Qwen3 / Mistral) to FP8 at
        load (bf16 only), as `fp8` does the transformer's.
        `parallel`: spread each image over this many processes (an int, or a `ParallelConfig`), one per
        GPU, started together by `torchrun` or `flux-gen --gpus N`: the sequence split over the ranks
        (Ulysses) and, with CFG, the two branches on two halves of them. Every rank loads the transformer
        and the VAE; rank 0 alone loads the text encoders, and returns the images (the others: None).
        Memory plans are for one GPU: a parallel run keeps every model resident.
        `download`: fetch what the load reads and the local Hugging Face cache lacks, on first use, exactly those
        files (`flux_runtime.pipeline.downloads`); False, or HF_HUB_OFFLINE=1, never touches the network. A
        parallel run reads the cache only (fetch first: `flux-gen --download-only`).
        `cache`: step caching for every call that passes none, a spec string (`"first-block:threshold=0.1"`,
        `"taylor:order=1,refresh=2"`) or a policy object (`flux_runtime.sampling.step_cache`); off by default.
        It approximates (orthogonal to `quality`); the provenance records the policy and the steps computed.
        `controlnet` (FLUX.1): one ControlNet or a list (paths, cached ids or `load_controlnet` models), run in
        that order by calls that give their `control_image`s (see `Flux1Pipe.__call__`).
        `redux` (FLUX.1): attach FLUX.1 Redux, so that `pipe(image=IMG)` generates from an image (`load_redux`):
        the FLUX.1-Redux-dev folder, or BFL's flux1-redux-dev.safetensors with `redux_image_encoder`, its SigLIP
        (a FLUX.1-Redux-dev folder or google/siglip-so400m-patch14-384); local paths or cached ids.
        """
        reject_unknown_load(cls.from_pretrained, unknown)
        policy = as_policy(cache)
        pipe = cls._open(
            path_or_id, device=device, dtype=dtype, quality=quality, vae=vae, text_encoder=text_encoder,
            text_encoder_2=text_encoder_2, cuda_graphs=cuda_graphs, offload_text_encoders=offload_text_encoders,
            is_distilled=is_distilled, fp8=fp8, variant=variant, memory=memory, fp8_text=fp8_text,
            parallel=parallel, download=download, controlnet=controlnet, redux=redux,
            redux_image_encoder=redux_image_encoder,
        )  # fmt: skip
        pipe.cache = policy
        return pipe

    @classmethod
    def _open(
        cls,
        path_or_id: str | Path,
        *,
        device: torch.device | str | None,
        dtype: torch.dtype,
        quality: Tier,
        vae: str | Path | None,
        text_encoder: str | Path | None,
        text_encoder_2: str | Path | None,
        cuda_graphs: bool,
        offload_text_encoders: bool,
        is_distilled: bool | None,
        fp8: bool,
        variant: Variant | None,
        memory: str | int | None,
        fp8_text: bool,
        parallel: ParallelConfig | int | None,
        download: bool,
        controlnet: Any = None,
        redux: str | Path | None = None,
        redux_image_encoder: str | Path | None = None,
    ) -> Pipeline | Flux2Pipe | Flux3Pipe:
        """`from_pretrained` after its own checks: the family read from the checkpoint, its recipe built."""
        flux1_variants.check_variant_name(variant)
        if quality not in ("lossless", "high"):
            raise FluxError(f"unknown quality {quality!r}: choose 'lossless' or 'high'")
        for flag, value in (
            ("fp8", fp8),
            ("fp8_text", fp8_text),
            ("cuda_graphs", cuda_graphs),
            ("download", download),
        ):
            if not isinstance(value, bool):
                raise FluxError(f"{flag} must be True or False, got {value!r}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise FluxError(
                f"dtype {dtype} is not supported: use torch.bfloat16, torch.float16 or torch.float32"
            )
        device = check_device(device)
        for flag, on in (("fp8", fp8), ("fp8_text", fp8_text)):
            if on and dtype != torch.bfloat16:
                raise FluxError(
                    f"{flag}=True computes in bf16 between the FP8 GEMMs; pass dtype=torch.bfloat16, not {dtype}"
                )
        if parallel is not None and (offload_text_encoders or memory not in ("auto", None)):
            raise FluxError(
                "memory budgets and text-encoder offload plan one GPU; a parallel run keeps every model resident: "
                "drop memory= / offload_text_encoders, or parallel="
            )
        if controlnet is not None:
            check_controlnet_arguments(controlnet, parallel)
        if redux is None and redux_image_encoder is not None:
            raise FluxError("redux_image_encoder is the SigLIP of a Redux: give redux= too")
        if redux is not None and parallel is not None:
            raise FluxError("Redux runs on one GPU for now: drop redux= (--redux) or parallel= (--gpus)")
        redux_files = None if redux is None else find_redux(redux, redux_image_encoder)  # before any load
        world = None
        config = None if parallel is None else as_config(parallel)
        if config is not None and (config.world_size > 1 or launched_world_size() is not None):
            world, device = join(config, device)
        budget = placement.budget_for(memory, device, offload_text_encoders) if world is None else None
        nets = (
            []
            if controlnet is None
            else controlnet
            if isinstance(controlnet, (list, tuple))
            else [controlnet]
        )
        if parallel is None and downloads_allowed(download):
            fetch_model(
                path_or_id, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                controlnets=[n for n in nets if isinstance(n, (str, Path))],
            )  # fmt: skip
        check_controlnet_files(nets)
        src = find_sources(path_or_id, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2)
        warmup.start(device)  # Triton's per-process key, hashed while the weights load
        # the checkpoint is opened once: its headers tell the family and feed the loader
        family, ckpt = open_family(src)
        if redux_files is not None and family != "flux1":
            name = {"flux2": "FLUX.2", "flux3": "FLUX.3"}.get(family, family)
            raise FluxError(f"Redux conditions FLUX.1 models; {path_or_id} is {name}")
        # a family's recipe is imported when a checkpoint of it opens: FLUX.2's and FLUX.3's text encoders
        # bring in `transformers`, seconds that a FLUX.1 run need not pay
        if family != "flux1" and controlnet is not None:
            raise FluxError(f"ControlNets are FLUX.1 models; this checkpoint is {family}: drop controlnet=")
        if family == "flux2":
            from flux_runtime.pipeline.flux2 import Flux2Pipe

            if variant is not None:
                raise FluxError(f"variant {variant!r} is a FLUX.1 setting; this checkpoint is FLUX.2")
            return Flux2Pipe.from_sources(
                src, device=device, dtype=dtype, quality=quality, text_encoder=text_encoder,
                text_encoder_2=text_encoder_2, cuda_graphs=cuda_graphs, offload_text_encoders=offload_text_encoders,
                is_distilled=is_distilled, fp8=fp8, checkpoint=ckpt, budget=budget, fp8_text=fp8_text,
                parallel=world,
            )  # fmt: skip
        if family == "flux3":
            from flux_runtime.pipeline.flux3 import Flux3Pipe

            if variant is not None or is_distilled is not None or text_encoder_2 is not None:
                raise FluxError(
                    "variant, is_distilled and text_encoder_2 are not FLUX.3 settings (a FLUX.3 checkpoint says "
                    "itself whether it is the flow map)"
                )
            if parallel is not None:
                raise FluxError("parallel is not available for FLUX.3 yet: drop it (one GPU runs FLUX.3)")
            return Flux3Pipe.from_sources(
                src, device=device, dtype=dtype, quality=quality, text_encoder=text_encoder,
                cuda_graphs=cuda_graphs, offload_text_encoders=offload_text_encoders, checkpoint=ckpt,
                fp8=fp8, fp8_text=fp8_text, budget=budget,
            )  # fmt: skip
        if is_distilled is not None:
            raise FluxError("is_distilled is a FLUX.2 [klein] setting; this checkpoint is FLUX.1")
        return cls.from_sources(
            src, device=device, dtype=dtype, quality=quality, cuda_graphs=cuda_graphs,
            offload_text_encoders=offload_text_encoders, fp8=fp8, fp8_text=fp8_text, variant=variant,
            checkpoint=ckpt, budget=budget, parallel=world, controlnet=controlnet, redux=redux_files,
        )  # fmt: skip


def check_controlnet_arguments(controlnet: Any, parallel: Any) -> None:
    """`from_pretrained(controlnet=...)` checked before anything is fetched or loaded: paths, ids or ControlNets,
    on one process."""
    from flux_runtime.models.dit.controlnet import Flux1ControlNet

    if parallel is not None:
        raise FluxError("ControlNets run on one GPU for now: drop controlnet= or parallel= (--gpus)")
    items = controlnet if isinstance(controlnet, (list, tuple)) else [controlnet]
    for item in items:
        if not isinstance(item, (str, Path, Flux1ControlNet)):
            raise FluxError(
                f"controlnet= takes ControlNets (load_controlnet), paths or ids, or a list of them; got "
                f"{type(item).__name__}"
            )


def check_controlnet_files(nets: list[Any]) -> None:
    """Each ControlNet given by path or id names a ControlNet's files (located, no tensor read), before the
    transformer loads."""
    from flux_runtime.weights.controlnet import controlnet_files
    from flux_runtime.weights.errors import WeightsError

    for item in nets:
        if isinstance(item, (str, Path)):
            try:
                controlnet_files(item)
            except WeightsError as e:
                raise FluxError(f"controlnet: {e}") from None
