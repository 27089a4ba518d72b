"""`Pipeline`: FLUX.1 text to image with the same pixels as diffusers' FluxPipeline, and its variants.

The FLUX.1 recipe for the pipeline core: encode the prompt (CLIP pooled + T5 states; with true CFG also
the negative prompt), draw noise with a CPU generator in the text dtype, pack it, build the schedule from
the image token count, Euler-integrate the transformer's velocity, unpack, denormalise, decode. The
variants (img2img, inpainting, Kontext, Fill, Depth/Canny) change only how the latents start and what
conditions each step (`flux1_variants`). Every input is checked before any model runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image
from torch import Tensor

from flux_runtime.models.dit import Flux1Transformer, Flux2Transformer
from flux_runtime.models.vae import Flux1VAE, Flux2VAE
from flux_runtime.parallel.group import ParallelConfig, as_config, join, launched_world_size
from flux_runtime.parallel.ulysses import SequenceParallel
from flux_runtime.pipeline import placement
from flux_runtime.pipeline.arguments import reject_unknown, reject_unknown_load
from flux_runtime.pipeline.checks import (
    check_device,
    check_guidance,
    check_prompt_embeds,
    check_prompts,
    check_sampling,
    check_size,
    check_steps,
    check_vae_tile,
)
from flux_runtime.pipeline.core import (
    Call,
    Conditioning,
    OutputType,
    PipelineOutput,
    Progress,
    Recipe,
    RoPE,
    Start,
)
from flux_runtime.pipeline.downloads import fetch_model
from flux_runtime.pipeline.errors import FluxError, warn_caller
from flux_runtime.pipeline.parallel import attach
from flux_runtime.pipeline.provenance import weights_id
from flux_runtime.pipeline.sources import Sources, find_sources, open_family, schedule_config
from flux_runtime.pipeline.tiers import Tier
from flux_runtime.registry import MODEL_IDS, Variant, spec_for
from flux_runtime.sampling import (
    denormalize_latents,
    draw_noise,
    image_ids,
    latent_size,
    pack,
    unpack,
)
from flux_runtime.text.flux1 import MAX_SEQUENCE_LENGTH, Flux1TextEncoder
from flux_runtime.weights import load_transformer
from flux_runtime.weights.builtin import builtin
from flux_runtime.weights.download import downloads_allowed
from flux_runtime.weights.pinned_stream import keep_ring
from flux_runtime.weights.vae import load_vae

if TYPE_CHECKING:
    from flux_runtime.pipeline.flux2 import Flux2Pipe
    from flux_runtime.pipeline.flux3 import Flux3Pipe

__all__ = ["MODEL_IDS", "Pipeline", "PipelineOutput", "check_latent_widths"]

log = logging.getLogger(__name__)

# FluxPipeline.__call__ defaults: dev 28 steps at guidance 3.5, schnell 4; FluxFillPipeline's 50 at 30.
DEFAULT_STEPS, DISTILLED_STEPS, DEFAULT_GUIDANCE = 28, 4, 3.5
FILL_STEPS, FILL_GUIDANCE = 50, 30.0
DEFAULT_SIZE = 1024


class Pipeline(Recipe):
    """FLUX.1 [dev] / [schnell] text-to-image, true CFG, and the FLUX.1 variants. Build with `from_pretrained`.

    `variant` is what the checkpoint does besides text to image (`text2img`, `kontext`, `fill`,
    `control` for Depth / Canny); Fill and Depth/Canny are also told by the transformer's input width.
    """

    def __init__(
        self,
        transformer: Flux1Transformer,
        vae: Flux1VAE,
        text_encoder: Flux1TextEncoder | None,
        *,
        schedule: Any,
        model_name: str = "custom",
        weights_id: str = "",
        quality: Tier = "lossless",
        cuda_graphs: bool = True,
        offload_text_encoders: bool = False,
        variant: Variant | None = None,
    ) -> None:
        from flux_runtime.pipeline import flux1_variants

        self.variant: Variant = flux1_variants.variant_of(transformer, vae, variant, model_name)
        check_latent_widths(transformer, vae, model_name, self.variant)
        if text_encoder is not None:  # None on the ranks of a parallel run other than rank 0
            _check_text_widths(transformer, text_encoder, model_name)
        self._setup(
            transformer, vae, text_encoder, schedule=schedule, model_name=model_name, weights_id=weights_id,
            quality=quality, cuda_graphs=cuda_graphs, offload_text_encoders=offload_text_encoders,
        )  # fmt: skip

    # ------------------------------------------------------------------ construction
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
        """
        from flux_runtime.pipeline import flux1_variants

        reject_unknown_load(cls.from_pretrained, unknown)
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
        world = None
        config = None if parallel is None else as_config(parallel)
        if config is not None and (config.world_size > 1 or launched_world_size() is not None):
            world, device = join(config, device)
        budget = placement.budget_for(memory, device, offload_text_encoders) if world is None else None
        if parallel is None and downloads_allowed(download):
            fetch_model(path_or_id, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2)
        src = find_sources(path_or_id, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2)
        # the checkpoint is opened once: its headers tell the family and feed the loader
        family, ckpt = open_family(src)
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
        # with a budget the transformer loads to host memory unless it fits the device, the text encoders
        # to host memory always: the plan then puts on the device what it keeps there
        dit_device = placement.transformer_device(budget, ckpt, dtype, fp8, device)
        transformer = load_transformer(ckpt or src.transformer, device=dit_device, dtype=dtype, fp8=fp8)
        assert isinstance(transformer, Flux1Transformer)  # told by the keys
        sharded = None if world is None else SequenceParallel(transformer, world)  # heads checked first
        vae_model = load_vae(src.vae, device=device, dtype=dtype)
        if vae_model.config.family != "flux1":
            raise FluxError(
                f"{src.vae} is a {vae_model.config.family} autoencoder; FLUX.1 needs the FLUX.1 VAE"
            )
        named = flux1_variants.named_variant(src, variant)
        # before the text encoders load
        check_latent_widths(
            transformer,
            vae_model,
            src.name,
            flux1_variants.variant_of(transformer, vae_model, named, src.name),
        )
        main = world is None or world.is_main  # only rank 0 encodes
        text_device = placement.text_device(budget, device, offload_text_encoders, _text_sources(src))
        text = _open_text(src, text_device, dtype) if main else None
        if fp8_text and text is not None:
            text.quantize_fp8()
        pipe = cls(
            transformer,
            vae_model,
            text,
            schedule=schedule_config(src.scheduler_config, transformer.config.guidance_embed),
            model_name=src.name,
            weights_id=weights_id(src),
            quality=quality,
            cuda_graphs=cuda_graphs,
            variant=named,
        )
        pipe.fp8_text = fp8_text
        pipe.hub_revision = src.hub_revision
        placement.place(pipe, budget, offload_text_encoders, device)
        if world is not None:
            assert sharded is not None
            attach(pipe, world, sharded)
        return pipe

    @property
    def is_distilled(self) -> bool:
        """schnell: no guidance embedding, guidance is ignored."""
        return not self.transformer.config.guidance_embed

    @property
    def default_steps(self) -> int:
        if self.is_distilled:
            return DISTILLED_STEPS
        return FILL_STEPS if self.variant == "fill" else DEFAULT_STEPS

    @property
    def default_guidance(self) -> float:
        """3.5 (FluxPipeline, Kontext, control), 30 for Fill (FluxFillPipeline's), or a built-in model's own (the
        tiny FLUX.1's 2.5: its guidance embedding was distilled over [1, 3])."""
        spec = spec_for(self.model_name)
        if spec is not None and spec.builtin and spec.default_guidance is not None:
            return spec.default_guidance
        return FILL_GUIDANCE if self.variant == "fill" else DEFAULT_GUIDANCE

    @property
    def default_max_sequence_length(self) -> int:
        """Text tokens when a call does not say: 512 (diffusers'), or the length a built-in model trained with."""
        spec = spec_for(self.model_name)
        if spec is not None and spec.builtin and spec.max_sequence_length:
            return spec.max_sequence_length
        return MAX_SEQUENCE_LENGTH

    @property
    def default_size(self) -> int:
        """Default image side: 1024 (FLUX.1's native size), the registry's for a built-in model (tiny: 128)."""
        spec = spec_for(self.model_name)
        return spec.default_size if spec is not None and spec.default_size else DEFAULT_SIZE

    @property
    def latent_channels(self) -> int:
        """The VAE's latent channels (16 for FLUX.1's autoencoder), read from its config."""
        return self.vae.config.z_channels

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        *,
        height: int | None = None,
        width: int | None = None,
        num_steps: int | None = None,
        guidance: float | None = None,
        seed: int | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        max_sequence_length: int | None = None,
        num_images_per_prompt: int = 1,
        output_type: OutputType = "pil",
        prompt_embeds: Tensor | None = None,
        pooled_prompt_embeds: Tensor | None = None,
        quality: Tier | None = None,
        progress: Progress | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float = 1.0,
        image: Image.Image | None = None,
        mask_image: Image.Image | None = None,
        strength: float | None = None,
        control_image: Image.Image | None = None,
        auto_resize: bool = True,
        max_area: int | None = None,
        **unknown: Any,
    ) -> PipelineOutput:
        """Generate images. Arguments as diffusers' FluxPipeline (and its variants) where they overlap.

        `height`/`width` default `default_size` (img2img / inpainting: the input image's size); `num_steps`
        default 28 (dev) / 4 (schnell); `guidance` default 3.5 (dev), ignored with a warning on schnell.
        Exactly one of `seed` / `generator` (neither: seed 0). `prompt_embeds` (B, L, 4096) with
        `pooled_prompt_embeds` (B, 768) may replace `prompt`.
        `negative_prompt` with `true_cfg_scale > 1`: true classifier-free guidance (a second forward per step).
        `image` (+ `strength` in (0, 1], default 0.6): img2img as FluxImg2ImgPipeline; with `mask_image`
        (white = repaint): inpainting as FluxInpaintPipeline; on a Kontext checkpoint `image` is the
        reference to edit (`auto_resize`: to Kontext's preferred resolution nearest its aspect ratio; the
        output keeps `width / height` at `max_area` pixels, default 1024², as FluxKontextPipeline rescales
        it); on a Fill checkpoint `image` +
        `mask_image` are its conditioning. `control_image`: the depth map or edge image of a Depth / Canny
        checkpoint.
        """
        reject_unknown(type(self).__call__, unknown, self.model_name, "FLUX.1")
        if max_sequence_length is None:
            max_sequence_length = self.default_max_sequence_length
        call = Call(
            prompt, height, width, num_steps, guidance, seed, generator, max_sequence_length,
            num_images_per_prompt, output_type, quality or self.quality, progress, prompt_embeds,
            pooled_prompt_embeds,
            inputs=dict(
                negative_prompt=negative_prompt, true_cfg_scale=true_cfg_scale, image=image,
                mask_image=mask_image, strength=strength, control_image=control_image, auto_resize=auto_resize,
                max_area=max_area,
            ),
        )  # fmt: skip
        return self._run(call)

    # ------------------------------------------------------------------ the recipe
    def check(self, call: Call) -> None:
        from flux_runtime.pipeline import flux1_variants

        cfg = self.transformer.config
        if call.prompt_embeds is None:
            check_prompts(call.prompt)
        else:
            if call.prompt is not None:
                raise FluxError("pass either prompt or prompt_embeds, not both")
            if call.pooled_prompt_embeds is None:
                raise FluxError("prompt_embeds needs pooled_prompt_embeds too")
            check_prompt_embeds(call.prompt_embeds, cfg.context_in_dim, MAX_SEQUENCE_LENGTH, self.dtype)
            if call.pooled_prompt_embeds.shape != (call.prompt_embeds.shape[0], cfg.vec_in_dim):
                raise FluxError(
                    f"pooled_prompt_embeds must be ({call.prompt_embeds.shape[0]}, {cfg.vec_in_dim}), "
                    f"got {tuple(call.pooled_prompt_embeds.shape)}"
                )
        # the variant's inputs (images, masks, strength, negative prompt) and the default size they imply
        flux1_variants.check_inputs(self, call)
        call.height = self.default_size if call.height is None else call.height
        call.width = self.default_size if call.width is None else call.width
        f = self.vae.config.spatial_factor
        check_size(call.height, call.width, 2 * f)
        check_vae_tile(self.vae_tile, (call.height // f, call.width // f))
        call.steps = check_steps(call.num_steps, self.default_steps)
        if self.is_distilled:
            if call.guidance is not None:
                warn_caller(
                    f"{self.model_name} is guidance-distilled (schnell): guidance {call.guidance} is ignored"
                )
            call.guidance_used = None
        else:
            call.guidance_used = check_guidance(call.guidance, self.default_guidance)
        check_sampling(
            call.seed, call.generator, call.max_sequence_length, MAX_SEQUENCE_LENGTH,
            call.num_images_per_prompt, call.output_type, call.quality,
        )  # fmt: skip
        flux1_variants.check_after_size(self, call)

    def encode_prompt(
        self,
        prompt: str | list[str],
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`(prompt_embeds (B, L, 4096), pooled (B, 768), text_ids (L, 3))` on the pipeline's device."""
        (embeds, pooled), _ = self._encode_texts([prompt], max_sequence_length, num_images_per_prompt)
        return embeds, pooled, torch.zeros(embeds.shape[1], 3).to(device=self.device, dtype=embeds.dtype)

    def _encode_texts(
        self, prompts: list[str | list[str]], max_len: int, n: int
    ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor] | None]:
        """(embeds, pooled) of the first prompt and of the second (the negative) when there is one, the
        encoders on the device only meanwhile when the memory plan moves them; repeated prompts from the cache."""
        te = self.text_encoder

        def run() -> list[tuple[Tensor, Tensor]]:
            outs = [
                te.encode(p, max_sequence_length=max_len, num_images_per_prompt=n, device=self.device)
                for p in prompts
            ]
            return [(o.prompt_embeds, o.pooled_prompt_embeds) for o in outs]

        key = ("flux1", tuple(p if isinstance(p, str) else tuple(p) for p in prompts), max_len, n)
        pairs = self.cached_encode(key, run)
        return pairs[0], (pairs[1] if len(pairs) > 1 else None)

    def encode(self, call: Call) -> Conditioning:
        n = call.num_images_per_prompt
        negative = call.inputs["negative_prompt"] if call.true_cfg_scale > 1 else None
        if call.prompt_embeds is None:
            assert call.prompt is not None  # checked
            texts: list[str | list[str]] = [call.prompt] + ([negative] if negative is not None else [])
            (txt, vec), neg = self._encode_texts(texts, call.max_sequence_length, n)
        else:
            txt = call.prompt_embeds.to(device=self.device).repeat_interleave(n, dim=0)
            vec = call.pooled_prompt_embeds.to(device=self.device).repeat_interleave(n, dim=0)  # type: ignore[union-attr]
            neg = None
            if negative is not None:
                _, neg = self._encode_texts(["", negative], call.max_sequence_length, n)
        if neg is None:
            return Conditioning(txt, vec)
        return Conditioning(txt, vec, neg[0], neg[1])

    def prepare(self, call: Call, cond: Conditioning) -> Start:
        from flux_runtime.pipeline import flux1_variants

        return flux1_variants.prepare(self, call, cond)

    def text2img_start(
        self, call: Call, cond: Conditioning, generator: torch.Generator | list[torch.Generator] | None = None
    ) -> Start:
        """Noise in the text dtype (as FluxPipeline), packed to tokens, the full schedule; drawn from
        `generator` when an earlier draw of the call (a VAE sample) has already used it."""
        device, f = self.device, self.vae.config.spatial_factor
        assert call.height is not None and call.width is not None  # filled by check
        h, w = latent_size(call.height, call.width, f)
        # latent channels as diffusers' FluxPipeline: the transformer's input width / 4
        # (Fill / control: the VAE's latent channels, as FluxFillPipeline / FluxControlPipeline)
        by_model = self.variant in ("text2img", "kontext")
        channels = self.transformer.config.in_channels // 4 if by_model else self.latent_channels
        noise = draw_noise(
            (cond.batch, channels, h, w), dtype=cond.txt.dtype, device=device,
            seed=call.seed if generator is None else None, generator=call.generator if generator is None else generator,
        )  # fmt: skip
        latents = pack(noise)
        sigmas, timesteps = self._schedule(call.steps, latents.shape[1])
        return Start(
            latents, (h, w), sigmas, timesteps,
            img_ids=image_ids(h, w, dtype=cond.txt.dtype, device=device),
            txt_ids=self._text_ids(cond),
            rope_key=(h, w, cond.txt.shape[1], device),
        )  # fmt: skip

    def _text_ids(self, cond: Conditioning) -> Tensor:
        return torch.zeros(cond.txt.shape[1], 3).to(device=self.device, dtype=cond.txt.dtype)

    def guidance_tensor(self, call: Call, batch: int) -> Tensor | None:
        if call.guidance_used is None:
            return None
        return torch.full([1], call.guidance_used, device=self.device, dtype=torch.float32).expand(batch)

    def velocity(
        self, x: Tensor, t: Tensor, g: Tensor | None, txt: Tensor, vec: Tensor | None, mods: Tensor | None,
        ids: tuple[Tensor, Tensor], pe: RoPE,
    ) -> Tensor:  # fmt: skip
        img_ids, txt_ids = ids
        return self.transformer(x, img_ids, txt, txt_ids, t, vec, g, pe=pe, mods=mods)

    def modulation_table(
        self, call: Call, start: Start, vec: Tensor | None, g: Tensor | None
    ) -> Tensor | None:
        assert vec is not None  # FLUX.1 always has the pooled vector
        return self._modulation_table(start.timesteps, vec, g, vec.shape[0], start.latents.dtype)

    def _modulation_table(
        self, timesteps: Tensor, pooled: Tensor, guidance: Tensor | None, batch: int, dtype: torch.dtype
    ) -> Tensor:
        """(steps, B, total) adaLN projections for every step, computed as `denoise` rounds each step's t."""
        t = torch.stack([ti.expand(batch).to(dtype) / 1000 for ti in timesteps])  # (N, B), as denoise
        n = t.shape[0]
        g = None if guidance is None else guidance.repeat(n)
        vec_act = self.transformer.conditioning(t.reshape(-1), pooled.repeat(n, 1), g)
        return self.transformer.modulation_table(vec_act).view(n, batch, -1)

    def decoder_input(self, latents: Tensor, start: Start) -> Tensor:
        """Unpack, then denormalise in the latent dtype."""
        h, w = start.grid
        return denormalize_latents(
            unpack(latents, h, w), self.vae.config.scale_factor, self.vae.config.shift_factor
        )

    def record_inputs(self, call: Call) -> dict[str, Any]:
        from flux_runtime.pipeline import flux1_variants

        return flux1_variants.record_inputs(self, call)


def check_latent_widths(
    transformer: Flux1Transformer | Flux2Transformer,
    vae: Flux1VAE | Flux2VAE,
    name: str,
    variant: Variant = "text2img",
) -> None:
    """The transformer reads and predicts the VAE's latents packed 2x2 (Fill adds the masked image and its
    8x8 mask, Depth/Canny the control image's latents): fail at load, naming the checkpoint, not at the
    first step with a bare shape error. (FLUX.1 and FLUX.2 alike.)"""
    from flux_runtime.pipeline.flux1_variants import input_width

    z = vae.config.z_channels
    f = getattr(vae.config, "spatial_factor", 8)
    for layer, width, want in (
        ("img_in", transformer.config.in_channels, input_width(variant, z, f)),
        ("final_layer", transformer.config.out_channels, 4 * z),
    ):
        if width != want:
            raise FluxError(
                f"{name}: the transformer's {layer} has width {width}, but the VAE's {z} latent channels "
                f"packed 2x2 are {4 * z}" + ("" if want == 4 * z else f" ({variant}: {want})")
            )


def _check_text_widths(transformer: Flux1Transformer, text: Flux1TextEncoder, name: str) -> None:
    """The transformer reads T5's states (txt_in) and CLIP's pooled vector (vector_in) at their widths."""
    cfg = transformer.config
    for layer, width, encoder, given in (
        ("txt_in", cfg.context_in_dim, "T5 encoder", text.t5.config.d_model),
        ("vector_in", cfg.vec_in_dim, "CLIP encoder", text.clip.config.hidden_size),
    ):
        if width != given:
            raise FluxError(
                f"{name}: the transformer's {layer} has width {width}, but the {encoder} gives {given}"
            )


def _text_sources(src: Sources) -> list[str | Path]:
    """The files `_open_text` reads the encoders from (none for a built-in model: its encoders are small)."""
    spec = builtin(src.name)
    if spec is not None:
        return [spec.folder] if spec.trained else []
    if src.text is not None:
        return [src.text]
    return [p for p in (src.clip, src.t5) if p is not None]


def _open_text(src: Sources, device: torch.device | str, dtype: torch.dtype) -> Flux1TextEncoder:
    spec = builtin(src.name)
    if spec is not None and spec.trained:  # the encoders it was trained with, shipped beside it
        folder = spec.folder
        return Flux1TextEncoder.from_components(
            folder / "text_encoder", folder / "text_encoder_2", device=device, dtype=dtype
        )
    if spec is not None:
        return Flux1TextEncoder.tiny(device=device, dtype=dtype)
    if src.text is not None:
        return Flux1TextEncoder.from_pretrained(src.text, device=device, dtype=dtype)
    return Flux1TextEncoder.from_components(src.clip, src.t5, device=device, dtype=dtype)
