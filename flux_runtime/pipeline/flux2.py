"""`Flux2Pipe`: FLUX.2 [dev] / [klein] text to image and editing, with the pixels of diffusers' Flux2Pipeline
and Flux2KleinPipeline.

Open it with `Pipeline.from_pretrained` (which returns this class when the transformer's keys are FLUX.2's).
Order of work, as `Flux2Pipeline.__call__` / `Flux2KleinPipeline.__call__` (diffusers 0.42.1; the sampling
module docstring lists the same steps): encode the prompts (klein with CFG: also the empty negative prompt),
preprocess and VAE-encode the reference images, draw 128-channel noise with a CPU generator in the text
dtype, build the schedule from the generated image's token count (empirical mu), Euler-integrate the
transformer's velocity with the reference tokens appended, unpack, BatchNorm-denormalise, unpatchify,
decode, postprocess.

What [dev] and [klein] do differently is decided by the checkpoint, as diffusers decides it:
- the transformer embeds guidance ([dev], `config.guidance_embed`): `guidance` is fed to the model, one
  forward per step, no CFG;
- it does not ([klein]): `guidance` is the classifier-free guidance scale; CFG runs (a second forward with
  the negative prompt `""` per step) when `guidance > 1` and the checkpoint is not step-distilled.
  `is_distilled` comes from the diffusers folder's `model_index.json` (`Flux2KleinPipeline` registers it
  there); without one (a BFL file set, `tiny-flux2`) it is False, diffusers' default.

Every input is checked before any model runs; RoPE tables are built once per image size and reference
layout; on CUDA each denoiser branch (conditional, unconditional) replays its own CUDA graph.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from flux_runtime.kernels import reset_fused_ops_report
from flux_runtime.models.dit import Flux2Transformer
from flux_runtime.models.vae import Flux2VAE
from flux_runtime.pipeline.checks import (
    StepWatch,
    check_finite,
    check_guidance,
    check_prompts,
    check_sampling,
    check_size,
    check_steps,
    check_vae_tile,
)
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.flux1 import OutputType, PipelineOutput, Progress, check_latent_widths
from flux_runtime.pipeline.graphs import GraphedDenoiser, kernels_used
from flux_runtime.pipeline.provenance import provenance, weights_id
from flux_runtime.pipeline.sources import Sources, flux2_schedule_config
from flux_runtime.pipeline.tiers import Tier, fused_tier, resolve_tier, tier_context
from flux_runtime.sampling import (
    ScheduleConfig,
    bn_denormalize,
    denoise,
    encode_reference_images,
    flux2_image_ids,
    flux2_pack,
    flux2_prepare_noise,
    flux2_text_ids,
    flux2_unpack,
    get_schedule,
    klein_uses_cfg,
    latent_bn_stats,
    latent_size,
    preprocess_reference_images,
    to_pil_images,
    to_uint8_images,
    unpatchify,
)
from flux_runtime.text.flux2 import (
    MAX_SEQUENCE_LENGTH,
    MISTRAL_PROCESSOR_ID,
    MISTRAL_SMALL_ID,
    NEGATIVE_PROMPT,
    QWEN3_4B_ID,
    QWEN3_8B_ID,
    Flux2TextEncoder,
    KleinTextEncoder,
)
from flux_runtime.weights import load_transformer
from flux_runtime.weights.builtin import builtin
from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.vae import load_vae

__all__ = ["DEFAULT_GUIDANCE", "DEFAULT_STEPS", "Flux2Pipe", "image_fingerprint"]

log = logging.getLogger(__name__)

TextEncoder = Flux2TextEncoder | KleinTextEncoder
ReferenceImages = Image.Image | Sequence[Image.Image]

# Flux2Pipeline.__call__ and Flux2KleinPipeline.__call__ defaults (both pipelines, every checkpoint).
DEFAULT_STEPS = 50
DEFAULT_GUIDANCE = 4.0
# diffusers' `default_sample_size`: the default side is 128 latent pixels times the VAE factor (1024 px).
DEFAULT_SAMPLE_SIZE = 128
# Text width (3 x hidden size) of each [klein] encoder: Qwen3-4B for klein 4B, Qwen3-8B for klein 9B.
_KLEIN_ENCODERS = {3 * 2560: QWEN3_4B_ID, 3 * 4096: QWEN3_8B_ID}


def image_fingerprint(image: Image.Image) -> str:
    """sha256 over a PIL image's mode, size and pixels: what the pipeline saw, whatever file it came from."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class Flux2Pipe:
    """FLUX.2 [dev] / [klein] text-to-image and reference-image editing.

    Built by `Pipeline.from_pretrained` for FLUX.2 checkpoints, or from loaded parts. `is_distilled` marks a
    step-distilled [klein] checkpoint (no CFG; `guidance` is ignored).
    """

    def __init__(
        self,
        transformer: Flux2Transformer,
        vae: Flux2VAE,
        text_encoder: TextEncoder,
        *,
        schedule: ScheduleConfig,
        is_distilled: bool = False,
        model_name: str = "custom",
        weights_id: str = "",
        quality: Tier = "lossless",
        cuda_graphs: bool = True,
        offload_text_encoders: bool = False,
    ) -> None:
        if transformer.config.family != "flux2":
            raise FluxError(
                f"{model_name} is a {transformer.config.family} transformer; this pipeline runs FLUX.2"
            )
        if vae.config.family != "flux2":
            raise FluxError(f"the autoencoder is a {vae.config.family} one; FLUX.2 needs the FLUX.2 VAE")
        check_latent_widths(transformer, vae, model_name)
        width = transformer.config.context_in_dim
        if text_encoder.output_dim != width:
            raise FluxError(
                f"{model_name}: the {text_encoder.family} text encoder gives {text_encoder.output_dim}-wide embeddings but the "
                f"transformer reads {width} (FLUX.2 [dev] takes Mistral Small, [klein] 4B Qwen3-4B, 9B Qwen3-8B)"
            )
        if transformer.config.guidance_embed and is_distilled:
            raise FluxError(
                "is_distilled is a FLUX.2 [klein] setting; this transformer embeds guidance ([dev])"
            )
        self.transformer, self.vae, self.text_encoder = transformer, vae, text_encoder
        self.schedule = schedule
        self.is_distilled = is_distilled
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
    def from_sources(
        cls,
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
    ) -> Flux2Pipe:
        """Load the parts `find_sources` located (arguments checked by `Pipeline.from_pretrained`).

        The text encoder: the folder's `text_encoder/` + `tokenizer/` (Mistral3 or Qwen3, told by its
        config.json); else `text_encoder` (a diffusers FLUX.2 folder or a model folder / cached id); else, for a
        BFL file set, BFL's choice for this transformer: Mistral Small 3.2 with Mistral Small 3.1's processor
        ([dev]), Qwen3-4B or Qwen3-8B by the transformer's text width ([klein]).
        """
        if text_encoder_2 is not None:
            raise FluxError("FLUX.2 has one text encoder: pass text_encoder=, not text_encoder_2=")
        transformer = load_transformer(src.transformer, device=device, dtype=dtype, fp8=fp8)
        assert isinstance(transformer, Flux2Transformer)  # dispatched on the keys
        vae = load_vae(src.vae, device=device, dtype=dtype)
        if not isinstance(vae, Flux2VAE):
            raise FluxError(f"{src.vae} is a {vae.config.family} autoencoder; FLUX.2 needs the FLUX.2 VAE")
        check_latent_widths(transformer, vae, src.name)  # before the text encoder loads
        text_device = torch.device("cpu") if offload_text_encoders else device
        text = _open_text(src, text_encoder, transformer, text_device, dtype)
        distilled = (
            (src.model_index or {}).get("is_distilled", False) if is_distilled is None else is_distilled
        )
        if not isinstance(distilled, bool):
            raise WeightsError(f"model_index.json: is_distilled must be true or false, got {distilled!r}")
        return cls(
            transformer,
            vae,
            text,
            schedule=flux2_schedule_config(src.scheduler_config),
            is_distilled=distilled,
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
    def is_dev(self) -> bool:
        """FLUX.2 [dev]: the transformer embeds guidance (Flux2Pipeline); otherwise [klein] (Flux2KleinPipeline)."""
        return self.transformer.config.guidance_embed

    @property
    def default_steps(self) -> int:
        """50, diffusers' default for both pipelines (the distilled [klein] models are made for 4)."""
        return DEFAULT_STEPS

    @property
    def default_size(self) -> int:
        """Default image side: diffusers' 128 latent pixels x the VAE factor (1024), or a built-in model's own
        (`tiny-flux2`: 256, trained there). With reference images the first one's size is the default instead."""
        spec = builtin(self.model_name)
        return DEFAULT_SAMPLE_SIZE * self.vae.config.spatial_factor if spec is None else spec.default_size

    @property
    def default_max_sequence_length(self) -> int:
        """Text tokens when the call does not say: 512 (diffusers'), or the length a built-in model trained with."""
        spec = builtin(self.model_name)
        return (
            MAX_SEQUENCE_LENGTH
            if spec is None or spec.max_sequence_length is None
            else spec.max_sequence_length
        )

    def uses_cfg(self, guidance: float) -> bool:
        """Whether a call with this guidance runs classifier-free guidance: [klein], not distilled, guidance > 1."""
        return not self.is_dev and klein_uses_cfg(guidance, self.is_distilled)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        *,
        image: ReferenceImages | None = None,
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
        quality: Tier | None = None,
        progress: Progress | None = None,
    ) -> PipelineOutput:
        """Generate (or, with `image`, edit) images. Arguments as `Pipeline.__call__` and diffusers' FLUX.2 pipelines.

        `image`: reference PIL image(s) to edit or compose from (each ≥ 64 px a side, aspect ≤ 8; shrunk to
        ≤ 1024² px and center-cropped to a multiple of 16, as diffusers does); `height`/`width` then default to
        the first one's size, else `default_size`; `max_sequence_length` `default_max_sequence_length`. `num_steps` default 50, `guidance` default 4.0 (diffusers'
        defaults): [dev] embeds it; [klein] uses it as the CFG scale (CFG when > 1 and not distilled; a
        distilled model ignores it, with a warning when given). Exactly one of `seed` / `generator` (neither:
        seed 0). `prompt_embeds` (B, L, context_in_dim) may replace `prompt` (the CFG negative is still
        encoded). `output_type="latent"` returns in `images` what diffusers returns: [dev] the packed latents
        (B, L, 128), [klein] the decoder's input (B, 32, h, w); `latents` is always the packed (B, L, 128).
        """
        quality = quality or self.quality
        if max_sequence_length is None:
            max_sequence_length = self.default_max_sequence_length
        refs = self._check_images(image)
        if refs:
            ref_h, ref_w = refs[0].shape[-2:]
            height = ref_h if height is None else height
            width = ref_w if width is None else width
        height = self.default_size if height is None else height
        width = self.default_size if width is None else width
        steps, g, cfg = self._check_call(
            prompt, height, width, num_steps, guidance, seed, generator, max_sequence_length,
            num_images_per_prompt, output_type, prompt_embeds, quality,
        )  # fmt: skip
        if seed is None and generator is None:
            seed = 0
        tier = resolve_tier(quality, self.device, self.dtype)
        try:
            latents, images, use_graphs, kernels = self._generate(
                prompt, refs, height, width, steps, g, cfg, seed, generator, max_sequence_length,
                num_images_per_prompt, output_type, prompt_embeds, tier, progress,
            )  # fmt: skip
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise FluxError(
                f"out of GPU memory generating {num_images_per_prompt} image(s) of {width}x{height}: try a smaller "
                "size or batch, fewer reference images, offload the text encoders "
                "(offload_text_encoders=True / --offload-text-encoders)"
            ) from None
        info = self._provenance(
            prompt, image, seed, height, width, steps, g, max_sequence_length, tier, use_graphs
        )
        # which kernels really ran: "off" (reference ops), "lossless", or "<tier>, partly reference"
        info["kernels"] = kernels
        return PipelineOutput(images, latents, info)

    def _check_images(self, image: ReferenceImages | None) -> list[Tensor]:
        """The preprocessed reference images (fp32, (1, 3, h, w) in [-1, 1]); [] without any."""
        if image is None:
            return []
        if not isinstance(image, (Image.Image, list, tuple)):
            raise FluxError(f"image must be a PIL image or a list of them, got {type(image).__name__}")
        if not isinstance(image, Image.Image) and not image:
            raise FluxError("image is an empty list: pass None for no reference images")
        try:
            return preprocess_reference_images(image, vae_scale_factor=self.vae.config.spatial_factor)
        except ValueError as e:
            raise FluxError(str(e)) from None

    def _check_call(
        self,
        prompt: str | list[str] | None,
        height: int,
        width: int,
        num_steps: int | None,
        guidance: float | None,
        seed: int | None,
        generator: torch.Generator | list[torch.Generator] | None,
        max_sequence_length: int,
        num_images_per_prompt: int,
        output_type: str,
        prompt_embeds: Tensor | None,
        quality: str,
    ) -> tuple[int, float | None, bool]:
        """(steps, guidance to use and record (None when ignored), CFG on) or one FluxError naming the problem."""
        if prompt_embeds is None:
            batch = check_prompts(prompt)
        else:
            if prompt is not None:
                raise FluxError("pass either prompt or prompt_embeds, not both")
            dim = self.transformer.config.context_in_dim
            if (
                not isinstance(prompt_embeds, Tensor)
                or prompt_embeds.ndim != 3
                or prompt_embeds.shape[-1] != dim
                or not 1 <= prompt_embeds.shape[1] <= MAX_SEQUENCE_LENGTH
                or not prompt_embeds.is_floating_point()
            ):
                shape = (
                    tuple(prompt_embeds.shape)
                    if isinstance(prompt_embeds, Tensor)
                    else type(prompt_embeds).__name__
                )
                raise FluxError(
                    f"prompt_embeds must be a float tensor (B, L <= {MAX_SEQUENCE_LENGTH}, {dim}), got {shape}"
                )
            if prompt_embeds.dtype != self.dtype:
                # the noise is drawn in the embeddings' dtype, as diffusers does: they must be the model's
                raise FluxError(f"prompt_embeds are {prompt_embeds.dtype}; this pipeline runs {self.dtype}")
            batch = prompt_embeds.shape[0]
        check_size(height, width, 2 * self.vae.config.spatial_factor)
        f = self.vae.config.spatial_factor
        check_vae_tile(self.vae_tile, (height // f, width // f))
        steps = check_steps(num_steps, self.default_steps)
        g = check_guidance(guidance, DEFAULT_GUIDANCE)
        if self.is_distilled:
            if guidance is not None and guidance > 1:
                # Flux2KleinPipeline.check_inputs logs the same
                warnings.warn(
                    f"{self.model_name} is step-distilled: guidance {guidance} is ignored (no CFG)",
                    stacklevel=3,
                )
            g_used: float | None = None
        else:
            g_used = g
        check_sampling(
            seed,
            generator,
            max_sequence_length,
            MAX_SEQUENCE_LENGTH,
            num_images_per_prompt,
            output_type,
            quality,
        )
        n = num_images_per_prompt
        if isinstance(generator, list) and (
            len(generator) != batch * n or not all(isinstance(x, torch.Generator) for x in generator)
        ):
            raise FluxError(
                f"a list of generators needs one torch.Generator per image: {batch * n}, got {len(generator)}"
            )
        return steps, g_used, g_used is not None and self.uses_cfg(g_used)

    def encode_prompt(
        self,
        prompt: str | list[str],
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
    ) -> tuple[Tensor, Tensor]:
        """`(prompt_embeds (B * n, L, context_in_dim), text_ids (B * n, L, 4) int64)` on the pipeline's device,
        as the diffusers pipeline's `encode_prompt`."""
        embeds, _ = self._encode(prompt, None, False, max_sequence_length, num_images_per_prompt)
        return embeds, flux2_text_ids(embeds.shape[1], device=self.device).expand(embeds.shape[0], -1, -1)

    def _encode(
        self, prompt: str | list[str] | None, prompt_embeds: Tensor | None, cfg: bool, max_len: int, n: int
    ) -> tuple[Tensor, Tensor | None]:
        """Positive embeddings (B * n, L, D) and, with CFG, the negative `""` ones, the encoder on the device
        only meanwhile when offloading."""
        te = self.text_encoder
        need_encoder = prompt_embeds is None or cfg
        if self.offload_text_encoders and need_encoder:
            te.to(self.device)
        try:
            if prompt_embeds is None:
                assert prompt is not None  # checked
                embeds = te.encode(
                    prompt, max_sequence_length=max_len, num_images_per_prompt=n, device=self.device
                ).prompt_embeds
                batch = 1 if isinstance(prompt, str) else len(prompt)
            else:
                # diffusers' encode_prompt: repeat(1, n, 1).view(B * n, L, D), i.e. each row n times in a row
                embeds = prompt_embeds.to(self.device).repeat_interleave(n, dim=0)
                batch = prompt_embeds.shape[0]
            negative = None
            if cfg:
                # Flux2KleinPipeline.__call__: "" once per prompt, encoded with the same settings
                # (KleinTextEncoder.encode_negative; written out so any FLUX.2 encoder can serve)
                negative = te.encode(
                    [NEGATIVE_PROMPT] * batch,
                    max_sequence_length=max_len,
                    num_images_per_prompt=n,
                    device=self.device,
                ).prompt_embeds
        finally:
            if self.offload_text_encoders and need_encoder:
                te.offload()
        return embeds, negative

    def _generate(
        self,
        prompt: str | list[str] | None,
        refs: list[Tensor],
        height: int,
        width: int,
        steps: int,
        guidance: float | None,
        cfg: bool,
        seed: int | None,
        generator: torch.Generator | list[torch.Generator] | None,
        max_sequence_length: int,
        num_images_per_prompt: int,
        output_type: OutputType,
        prompt_embeds: Tensor | None,
        tier: Tier,
        progress: Progress | None,
    ) -> tuple[Tensor, Any, bool, str]:
        """(packed latents, images as `output_type` asks, CUDA graphs used, kernels that ran)."""
        device, model_dtype = self.device, self.dtype
        report = progress or (lambda stage, done, total: None)

        # text (and the negative prompt for CFG), then the reference images through the VAE encoder
        report("encode", 0, 1)
        embeds, negative = self._encode(
            prompt, prompt_embeds, cfg, max_sequence_length, num_images_per_prompt
        )
        batch, txt_len = embeds.shape[:2]
        vae = self.vae
        f = vae.config.spatial_factor
        mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
        h, w = latent_size(height, width, f)
        ref_tokens: Tensor | None = None
        ref_ids: Tensor | None = None
        if refs:
            # in the VAE's dtype (diffusers' `vae.dtype`), as Flux2Pipeline.prepare_image_latents
            vae_dtype = vae.encoder.conv_in.weight.dtype
            ref_tokens, ref_ids = encode_reference_images(
                refs, vae.encode, mean, std, batch=batch, dtype=vae_dtype, device=device
            )
        report("encode", 1, 1)

        # latents: 128-channel noise in the text dtype (as Flux2Pipeline), packed to tokens
        noise = flux2_prepare_noise(
            batch, height, width, dtype=embeds.dtype, device=device, seed=seed, generator=generator,
            vae_scale_factor=f,
        )  # fmt: skip
        latents = flux2_pack(noise)  # (B, L, 128)
        # the schedule counts the generated image's tokens only
        sched = get_schedule(steps, latents.shape[1], config=self.schedule, device=device)
        g = (
            torch.full([1], guidance, device=device, dtype=torch.float32).expand(batch)
            if self.is_dev and guidance is not None
            else None
        )

        # RoPE tables once per image size, reference layout and text length, shared by every block and step
        ref_layout = tuple(tuple(r.shape[-2:]) for r in refs)
        pe_key = (h, w, ref_layout, txt_len, device)
        if pe_key not in self._rope:
            img_ids = flux2_image_ids(h, w, device=device)
            if ref_ids is not None:
                img_ids = torch.cat([img_ids, ref_ids])  # (L + L_ref, 4): references after the noise tokens
            txt_ids = flux2_text_ids(txt_len, device=device)
            self._rope[pe_key] = (img_ids, txt_ids, self.transformer.rope(txt_ids, img_ids))
        img_ids, txt_ids, pe = self._rope[pe_key]
        model = self.transformer
        dispatch = fused_tier(tier, device, model_dtype)

        def velocity(x: Tensor, t: Tensor, gd: Tensor | None, txt: Tensor) -> Tensor:
            with tier_context(dispatch):
                # latent_model_input.to(transformer.dtype): (B, L + L_ref, 128)
                return model(x.to(model_dtype), img_ids, txt, txt_ids, t, gd, pe=pe)

        use_graphs = self._graphs_enabled()

        def branch(name: str, txt: Tensor) -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
            if not use_graphs:
                return lambda x, t, gd: velocity(x, t, gd, txt)
            # one graph per branch: a replay overwrites its static output, and CFG needs both at once
            key = (pe_key, tier, name)
            if key not in self._graphed:
                self._graphed[key] = GraphedDenoiser(velocity)
            graphed = self._graphed[key]
            return lambda x, t, gd: graphed(x, t, gd, txt)

        report("denoise", 0, steps)
        reset_fused_ops_report()
        watch = StepWatch(steps, device)

        def after_step(i: int, t: Tensor, x: Tensor) -> None:
            watch(i, x)
            report("denoise", i + 1, steps)

        latents = denoise(
            branch("cond", embeds),
            latents,
            sched.sigmas,
            sched.timesteps,
            guidance=g,
            negative_model_fn=branch("uncond", negative) if negative is not None else None,
            true_cfg_scale=guidance if cfg and guidance is not None else 1.0,
            reference_tokens=ref_tokens,
            callback=after_step,
        )
        watch.raise_if_bad()  # a NaN step is an error naming the step, never a picture
        kernels = kernels_used(self._graphed.get((pe_key, tier, "cond")) if use_graphs else None)

        if output_type == "latent" and self.is_dev:
            return latents, latents, use_graphs, kernels  # Flux2Pipeline: the packed latents
        # unpack, BatchNorm-denormalise and unpatchify in the latents' dtype: the decoder's input (B, 32, h, w)
        z = unpatchify(bn_denormalize(flux2_unpack(latents, h, w), mean, std))
        if output_type == "latent":
            return latents, z, use_graphs, kernels  # Flux2KleinPipeline: the decoder's input
        report("decode", 0, 1)
        decoded = vae.decode(z, tile=self.vae_tile)
        check_finite(decoded, "decoded images")
        report("decode", 1, 1)
        if output_type == "pil":
            images: Any = to_pil_images(decoded)
        elif output_type == "np":
            images = to_uint8_images(decoded)
        else:
            images = (decoded * 0.5 + 0.5).clamp(0, 1)
        return latents, images, use_graphs, kernels

    def _graphs_enabled(self) -> bool:
        """CUDA graphs run where they can: asked for, and the model on a CUDA device."""
        return self.cuda_graphs and self.device.type == "cuda"

    def _provenance(
        self,
        prompt: str | list[str] | None,
        image: ReferenceImages | None,
        seed: int | None,
        height: int,
        width: int,
        steps: int,
        guidance: float | None,
        max_len: int,
        tier: Tier,
        graphs: bool,
    ) -> dict[str, Any]:
        """FLUX.1's provenance keys, plus `reference_images`: per image its file (PIL's `filename`, or None
        for an image made in memory), size and `image_fingerprint`, so a replay can tell a changed file."""
        given = [] if image is None else [image] if isinstance(image, Image.Image) else list(image)
        return {
            **provenance(
                prompt=prompt,
                seed=seed,
                height=height,
                width=width,
                steps=steps,
                guidance=guidance,
                max_sequence_length=max_len,
                tier=tier,
                cuda_graphs=graphs,
                model=self.model_name,
                weights=self.weights_id,
                dtype=self.dtype,
                device=self.device,
                precision=getattr(self.transformer, "precision", "bf16"),
                fp8_at_load=getattr(self.transformer, "quantized_at_load", False),
            ),
            "reference_images": [
                {
                    "path": getattr(im, "filename", "") or None,
                    "width": im.width,
                    "height": im.height,
                    "sha256": image_fingerprint(im),
                }
                for im in given
            ],
        }


def _open_text(
    src: Sources,
    text_encoder: str | Path | None,
    transformer: Flux2Transformer,
    device: torch.device,
    dtype: torch.dtype,
) -> TextEncoder:
    """The FLUX.2 text encoder for these sources (see `Flux2Pipe.from_sources`)."""
    spec = builtin(src.name)
    if spec is not None and spec.trained and text_encoder is None:
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
    cfg = transformer.config
    if cfg.guidance_embed:
        return Flux2TextEncoder.from_components(
            MISTRAL_SMALL_ID, MISTRAL_PROCESSOR_ID, device=device, dtype=dtype
        )
    if cfg.context_in_dim not in _KLEIN_ENCODERS:
        raise FluxError(
            f"no known [klein] text encoder is {cfg.context_in_dim} wide: pass text_encoder=<Qwen3 folder or id>"
        )
    return KleinTextEncoder.from_components(_KLEIN_ENCODERS[cfg.context_in_dim], device=device, dtype=dtype)


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
