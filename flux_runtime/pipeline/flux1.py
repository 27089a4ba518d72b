"""`Pipeline`: FLUX.1 text to image with the same pixels as diffusers' FluxPipeline.

Order of work, as FluxPipeline: encode the prompt (CLIP pooled + T5 states), draw noise with a CPU
generator in the model dtype, pack it, build the schedule from the image token count, Euler-integrate
the transformer's velocity, unpack, denormalise, decode, postprocess. Every input is checked before any
model runs; RoPE tables are built once per image size and reused by every block of every step.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from flux_runtime.kernels import reset_fused_ops_report
from flux_runtime.models.dit import Flux1Transformer, Flux2Transformer
from flux_runtime.models.vae import Flux1VAE, Flux2VAE
from flux_runtime.pipeline.checks import (
    StepWatch,
    check_device,
    check_finite,
    check_guidance,
    check_prompts,
    check_sampling,
    check_size,
    check_steps,
    check_vae_tile,
)
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.graphs import GraphedDenoiser, kernels_used
from flux_runtime.pipeline.provenance import provenance, weights_id
from flux_runtime.pipeline.sources import MODEL_IDS, Sources, find_sources, schedule_config
from flux_runtime.pipeline.tiers import Tier, fused_tier, resolve_tier, tier_context
from flux_runtime.sampling import (
    ScheduleConfig,
    denoise,
    denormalize_latents,
    get_schedule,
    image_ids,
    latent_size,
    pack,
    prepare_noise,
    to_pil_images,
    unpack,
)
from flux_runtime.text.flux1 import MAX_SEQUENCE_LENGTH, Flux1TextEncoder
from flux_runtime.weights import load_transformer
from flux_runtime.weights.builtin import builtin
from flux_runtime.weights.flux2_transformer import is_flux2
from flux_runtime.weights.vae import load_vae

if TYPE_CHECKING:
    from flux_runtime.pipeline.flux2 import Flux2Pipe

__all__ = ["MODEL_IDS", "Pipeline", "PipelineOutput"]

log = logging.getLogger(__name__)

OutputType = Literal["pil", "pt", "np", "latent"]
Progress = Callable[[str, int, int], None]
"""`progress(stage, done, total)` with stage "encode", "denoise" or "decode"."""


@dataclass
class PipelineOutput:
    """`images`: PIL images, a float tensor (B, 3, H, W) in [0, 1], uint8 arrays, or latents.

    `latents` are the final packed latents (B, L, 64), FLUX.2 (B, L, 128), in the model dtype; `info` is the
    provenance (prompt, seed, size, steps, guidance, model, quality tier actually used, versions; FLUX.2 adds
    its reference images).
    """

    images: Any
    latents: Tensor
    info: dict[str, Any] = field(default_factory=dict)


class Pipeline:
    """FLUX.1 [dev] / [schnell] text-to-image. Build with `Pipeline.from_pretrained`."""

    def __init__(
        self,
        transformer: Flux1Transformer,
        vae: Flux1VAE,
        text_encoder: Flux1TextEncoder,
        *,
        schedule: ScheduleConfig,
        model_name: str = "custom",
        weights_id: str = "",
        quality: Tier = "lossless",
        cuda_graphs: bool = True,
        offload_text_encoders: bool = False,
    ) -> None:
        check_latent_widths(transformer, vae, model_name)
        _check_text_widths(transformer, text_encoder, model_name)
        self.transformer, self.vae, self.text_encoder = transformer, vae, text_encoder
        self.schedule = schedule
        self.model_name, self.weights_id = model_name, weights_id
        self.quality: Tier = quality
        self.cuda_graphs = cuda_graphs
        self.offload_text_encoders = offload_text_encoders
        # decode in tiles of this many latent pixels (bounds VAE memory for large images; not bit-identical
        # to a one-pass decode at the seams); None decodes in one pass, as diffusers does by default
        self.vae_tile: int | None = None
        self._graphed: dict[tuple, GraphedDenoiser] = {}
        self._rope: dict[tuple, tuple[Tensor, Tensor, tuple[Tensor, Tensor]]] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
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
    ) -> Pipeline | Flux2Pipe:
        """Open a FLUX.1 pipeline, or a FLUX.2 one (`Flux2Pipe`) when the transformer's keys are FLUX.2's.

        `path_or_id`: `tiny` / `tiny-flux2` (built in, trained on coloured shapes, offline; `tiny-random` /
        `tiny-flux2-random`: random weights for tests), `flux1-dev` / `flux1-schnell` /
        `flux2-dev` / `flux2-klein-4b` / `flux2-klein-9b` or any model id in the local Hugging Face cache, a
        diffusers pipeline folder, or a BFL transformer file (then `ae.safetensors` beside it, or `vae=`;
        FLUX.1: CLIP-L and T5 from `text_encoder` / `text_encoder_2`, folders or cached ids, default
        openai/clip-vit-large-patch14 and google/t5-v1_1-xxl; FLUX.2: its one LLM from `text_encoder`, default
        the one BFL pairs with the transformer, see `Flux2Pipe.from_sources`).
        `quality`: `lossless` (bit-identical to diffusers) or `high` (approximate fused kernels).
        `is_distilled` (FLUX.2 [klein] only): whether the model is step-distilled (no CFG); default: the
        folder's model_index.json, else False. BFL klein files carry no such flag: say so here.
        `fp8`: quantize the transformer's block projections to e4m3 at load (bf16 only; FP8 checkpoints
        load as FP8 without it). Precision is the model's, orthogonal to `quality`; the provenance records it.
        """
        if quality not in ("lossless", "high"):
            raise FluxError(f"unknown quality {quality!r}: choose 'lossless' or 'high'")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise FluxError(
                f"dtype {dtype} is not supported: use torch.bfloat16, torch.float16 or torch.float32"
            )
        device = check_device(device)
        if fp8 and dtype != torch.bfloat16:
            raise FluxError(
                f"fp8=True computes in bf16 between the FP8 GEMMs; pass dtype=torch.bfloat16, not {dtype}"
            )
        src = find_sources(path_or_id, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2)
        if is_flux2(src.transformer):  # reads the safetensors headers only
            from flux_runtime.pipeline.flux2 import Flux2Pipe

            return Flux2Pipe.from_sources(
                src, device=device, dtype=dtype, quality=quality, text_encoder=text_encoder,
                text_encoder_2=text_encoder_2, cuda_graphs=cuda_graphs, offload_text_encoders=offload_text_encoders,
                is_distilled=is_distilled, fp8=fp8,
            )  # fmt: skip
        if is_distilled is not None:
            raise FluxError("is_distilled is a FLUX.2 [klein] setting; this checkpoint is FLUX.1")
        transformer = load_transformer(src.transformer, device=device, dtype=dtype, fp8=fp8)
        if transformer.config.family != "flux1":
            raise FluxError(
                f"{src.name} is a {transformer.config.family} transformer; this pipeline runs FLUX.1"
            )
        vae_model = load_vae(src.vae, device=device, dtype=dtype)
        if vae_model.config.family != "flux1":
            raise FluxError(
                f"{src.vae} is a {vae_model.config.family} autoencoder; FLUX.1 needs the FLUX.1 VAE"
            )
        check_latent_widths(transformer, vae_model, src.name)  # before the text encoders load
        text_device = "cpu" if offload_text_encoders else device
        text = _open_text(src, text_device, dtype)
        return cls(
            transformer,
            vae_model,
            text,
            schedule=schedule_config(src.scheduler_config, transformer.config.guidance_embed),
            model_name=src.name,
            weights_id=weights_id(src),
            quality=quality,
            cuda_graphs=cuda_graphs,
            offload_text_encoders=offload_text_encoders,
        )

    @property
    def device(self) -> torch.device:
        return self.transformer.img_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.img_in.weight.dtype

    @property
    def is_distilled(self) -> bool:
        """schnell: no guidance embedding, guidance is ignored."""
        return not self.transformer.config.guidance_embed

    @property
    def default_steps(self) -> int:
        return 4 if self.is_distilled else 28

    @property
    def default_size(self) -> int:
        """Default image side: 1024 (FLUX.1's native size); a built-in model's own (`tiny`: 256, trained there)."""
        spec = builtin(self.model_name)
        return 1024 if spec is None else spec.default_size

    @property
    def default_max_sequence_length(self) -> int:
        """T5 tokens when the call does not say: 512 (diffusers'), or the length a built-in model trained with."""
        spec = builtin(self.model_name)
        return (
            MAX_SEQUENCE_LENGTH
            if spec is None or spec.max_sequence_length is None
            else spec.max_sequence_length
        )

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
    ) -> PipelineOutput:
        """Generate images. Arguments as diffusers' FluxPipeline where they overlap.

        `height`/`width` default `default_size`, `max_sequence_length` `default_max_sequence_length`; `num_steps` default 28 (dev) / 4 (schnell); `guidance` default 3.5 (dev), ignored with a warning
        on schnell. Exactly one of `seed` / `generator` (neither: seed 0). `prompt_embeds` (B, L, 4096) with
        `pooled_prompt_embeds` (B, 768) may replace `prompt`.
        """
        quality = quality or self.quality
        if max_sequence_length is None:
            max_sequence_length = self.default_max_sequence_length
        height = self.default_size if height is None else height
        width = self.default_size if width is None else width
        steps, g = self._check_call(
            prompt,
            height,
            width,
            num_steps,
            guidance,
            seed,
            generator,
            max_sequence_length,
            num_images_per_prompt,
            output_type,
            prompt_embeds,
            pooled_prompt_embeds,
            quality,
        )
        if seed is None and generator is None:
            seed = 0
        tier = resolve_tier(quality, self.device, self.dtype)
        try:
            return self._generate(
                prompt,
                height,
                width,
                steps,
                g,
                seed,
                generator,
                max_sequence_length,
                num_images_per_prompt,
                output_type,
                prompt_embeds,
                pooled_prompt_embeds,
                tier,
                progress,
            )
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise FluxError(
                f"out of GPU memory generating {num_images_per_prompt} image(s) of {width}x{height}: try a smaller "
                "size or batch, offload the text encoders (offload_text_encoders=True / --offload-text-encoders)"
            ) from None

    def _check_call(
        self,
        prompt,
        height,
        width,
        num_steps,
        guidance,
        seed,
        generator,
        max_sequence_length,
        num_images_per_prompt,
        output_type,
        prompt_embeds,
        pooled_prompt_embeds,
        quality,
    ) -> tuple[int, float | None]:
        if prompt_embeds is None:
            check_prompts(prompt)
        else:
            if prompt is not None:
                raise FluxError("pass either prompt or prompt_embeds, not both")
            if pooled_prompt_embeds is None:
                raise FluxError("prompt_embeds needs pooled_prompt_embeds too")
            cfg = self.transformer.config
            if prompt_embeds.ndim != 3 or prompt_embeds.shape[-1] != cfg.context_in_dim:
                raise FluxError(
                    f"prompt_embeds must be (B, L, {cfg.context_in_dim}), got {tuple(prompt_embeds.shape)}"
                )
            if pooled_prompt_embeds.shape != (prompt_embeds.shape[0], cfg.vec_in_dim):
                raise FluxError(
                    f"pooled_prompt_embeds must be ({prompt_embeds.shape[0]}, {cfg.vec_in_dim}), "
                    f"got {tuple(pooled_prompt_embeds.shape)}"
                )
        check_size(height, width, 2 * self.vae.config.spatial_factor)
        f = self.vae.config.spatial_factor
        check_vae_tile(self.vae_tile, (height // f, width // f))
        steps = check_steps(num_steps, self.default_steps)
        if self.is_distilled:
            if guidance is not None:
                warnings.warn(
                    f"{self.model_name} is guidance-distilled (schnell): guidance {guidance} is ignored",
                    stacklevel=3,
                )
            g = None
        else:
            g = check_guidance(guidance, 3.5)
        check_sampling(
            seed,
            generator,
            max_sequence_length,
            MAX_SEQUENCE_LENGTH,
            num_images_per_prompt,
            output_type,
            quality,
        )
        return steps, g

    def encode_prompt(
        self,
        prompt: str | list[str],
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`(prompt_embeds (B, L, 4096), pooled (B, 768), text_ids (L, 3))` on the pipeline's device."""
        te = self.text_encoder
        if self.offload_text_encoders:
            te.to(self.device)
        try:
            out = te.encode(
                prompt,
                max_sequence_length=max_sequence_length,
                num_images_per_prompt=num_images_per_prompt,
                device=self.device,
            )
        finally:
            if self.offload_text_encoders:
                te.offload()
        return out.prompt_embeds, out.pooled_prompt_embeds, out.text_ids

    def _generate(
        self,
        prompt,
        height,
        width,
        steps,
        guidance,
        seed,
        generator,
        max_sequence_length,
        num_images_per_prompt,
        output_type,
        prompt_embeds,
        pooled,
        tier,
        progress,
    ) -> PipelineOutput:
        device = self.device
        report = progress or (lambda stage, done, total: None)

        # text
        report("encode", 0, 1)
        if prompt_embeds is None:
            prompt_embeds, pooled, text_ids = self.encode_prompt(
                prompt, max_sequence_length=max_sequence_length, num_images_per_prompt=num_images_per_prompt
            )
        else:
            prompt_embeds = prompt_embeds.to(device=device).repeat_interleave(num_images_per_prompt, dim=0)
            pooled = pooled.to(device=device).repeat_interleave(num_images_per_prompt, dim=0)
            text_ids = torch.zeros(prompt_embeds.shape[1], 3).to(device=device, dtype=prompt_embeds.dtype)
        report("encode", 1, 1)
        batch = prompt_embeds.shape[0]

        # latents: noise in the text dtype (as FluxPipeline), packed to tokens
        f = self.vae.config.spatial_factor
        h, w = latent_size(height, width, f)
        noise = prepare_noise(
            batch,
            height,
            width,
            dtype=prompt_embeds.dtype,
            device=device,
            seed=seed,
            generator=generator,
            vae_scale_factor=f,
        )
        latents = pack(noise)
        img_ids = image_ids(h, w, dtype=prompt_embeds.dtype, device=device)
        sched = get_schedule(steps, latents.shape[1], config=self.schedule, device=device)
        g = (
            None
            if guidance is None
            else torch.full([1], guidance, device=device, dtype=torch.float32).expand(batch)
        )

        # RoPE tables once per image size, shared by every block and step
        pe_key = (h, w, text_ids.shape[0], device)
        if pe_key not in self._rope:
            self._rope[pe_key] = (img_ids, text_ids, self.transformer.rope(text_ids, img_ids))
        img_ids, text_ids, pe = self._rope[pe_key]
        model = self.transformer
        dispatch = fused_tier(tier, device, self.dtype)

        def velocity(
            x: Tensor, t: Tensor, gd: Tensor | None, txt: Tensor, y: Tensor, mods: Tensor | None = None
        ) -> Tensor:
            with tier_context(dispatch):
                return model(x, img_ids, txt, text_ids, t, y, gd, pe=pe, mods=mods)

        # high tier: every step's adaLN projections in one batched GEMM per projection (F13)
        table = (
            self._modulation_table(sched.timesteps, pooled, g, batch, latents.dtype)
            if dispatch == "high"
            else None
        )
        step = iter(range(steps))

        use_graphs = self.cuda_graphs and device.type == "cuda"
        if use_graphs:
            graphed = self._graphed.setdefault((pe_key, tier), GraphedDenoiser(velocity))

            def model_fn(x: Tensor, t: Tensor, gd: Tensor | None) -> Tensor:
                mods = None if table is None else table[next(step)]
                return graphed(x, t, gd, prompt_embeds, pooled, mods)
        else:

            def model_fn(x: Tensor, t: Tensor, gd: Tensor | None) -> Tensor:
                mods = None if table is None else table[next(step)]
                return velocity(x, t, gd, prompt_embeds, pooled, mods)

        report("denoise", 0, steps)
        reset_fused_ops_report()
        watch = StepWatch(steps, device)

        def after_step(i: int, t: Tensor, x: Tensor) -> None:
            watch(i, x)
            report("denoise", i + 1, steps)

        latents = denoise(model_fn, latents, sched.sigmas, sched.timesteps, guidance=g, callback=after_step)
        watch.raise_if_bad()  # a NaN step is an error naming the step, never a picture

        info = self._provenance(
            prompt, seed, height, width, steps, guidance, max_sequence_length, tier, use_graphs
        )
        # which kernels really ran: "off" (reference ops), "lossless", or "<tier>, partly reference"
        info["kernels"] = kernels_used(graphed if use_graphs else None)
        if output_type == "latent":
            return PipelineOutput(latents, latents, info)

        # decode: unpack, denormalise in the latent dtype, VAE
        report("decode", 0, 1)
        z = denormalize_latents(
            unpack(latents, h, w), self.vae.config.scale_factor, self.vae.config.shift_factor
        )
        decoded = self.vae.decode(z, tile=self.vae_tile)
        check_finite(decoded, "decoded images")
        report("decode", 1, 1)
        if output_type == "pil":
            images: Any = to_pil_images(decoded)
        elif output_type == "np":
            from flux_runtime.sampling import to_uint8_images

            images = to_uint8_images(decoded)
        else:
            images = (decoded * 0.5 + 0.5).clamp(0, 1)
        return PipelineOutput(images, latents, info)

    def _modulation_table(
        self, timesteps: Tensor, pooled: Tensor, guidance: Tensor | None, batch: int, dtype: torch.dtype
    ) -> Tensor:
        """(steps, B, total) adaLN projections for every step, computed as `denoise` rounds each step's t."""
        t = torch.stack([ti.expand(batch).to(dtype) / 1000 for ti in timesteps])  # (N, B), as denoise
        n = t.shape[0]
        g = None if guidance is None else guidance.repeat(n)
        vec_act = self.transformer.conditioning(t.reshape(-1), pooled.repeat(n, 1), g)
        return self.transformer.modulation_table(vec_act).view(n, batch, -1)

    def _provenance(
        self, prompt, seed, height, width, steps, guidance, max_len, tier, graphs
    ) -> dict[str, Any]:
        return provenance(
            prompt=prompt, seed=seed, height=height, width=width, steps=steps, guidance=guidance,
            max_sequence_length=max_len, tier=tier, cuda_graphs=graphs, model=self.model_name,
            weights=self.weights_id, dtype=self.dtype, device=self.device,
            precision=getattr(self.transformer, "precision", "bf16"),
                fp8_at_load=getattr(self.transformer, "quantized_at_load", False),
        )  # fmt: skip


def check_latent_widths(
    transformer: Flux1Transformer | Flux2Transformer, vae: Flux1VAE | Flux2VAE, name: str
) -> None:
    """The transformer reads and predicts the VAE's latents packed 2x2: fail at load, naming the checkpoint,
    not at the first step with a bare shape error. (FLUX.1 and FLUX.2 alike.)"""
    z = vae.config.z_channels
    for layer, width in (
        ("img_in", transformer.config.in_channels),
        ("final_layer", transformer.config.out_channels),
    ):
        if width != 4 * z:
            raise FluxError(
                f"{name}: the transformer's {layer} has width {width}, but the VAE's {z} latent channels "
                f"packed 2x2 are {4 * z}"
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


def _open_text(src: Sources, device: torch.device | str, dtype: torch.dtype) -> Flux1TextEncoder:
    spec = builtin(src.name)
    if spec is not None and spec.trained:
        folder = spec.folder
        return Flux1TextEncoder.from_components(
            folder / "text_encoder", folder / "text_encoder_2", device=device, dtype=dtype
        )
    if spec is not None:
        return Flux1TextEncoder.tiny(device=device, dtype=dtype)
    if src.text is not None:
        return Flux1TextEncoder.from_pretrained(src.text, device=device, dtype=dtype)
    return Flux1TextEncoder.from_components(src.clip, src.t5, device=device, dtype=dtype)
