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

import logging
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from flux_runtime.models.dit import Flux2Transformer
from flux_runtime.models.vae import Flux2VAE
from flux_runtime.pipeline.arguments import reject_unknown
from flux_runtime.pipeline.checks import (
    check_guidance,
    check_latent_widths,
    check_prompt_embeds,
    check_prompts,
    check_sampling,
    check_size,
    check_steps,
    check_vae_tile,
)
from flux_runtime.pipeline.core import Recipe, RoPE
from flux_runtime.pipeline.errors import FluxError, warn_caller
from flux_runtime.pipeline.flux2_sources import TextEncoder, open_flux2
from flux_runtime.pipeline.graphs import GraphedDenoiser
from flux_runtime.pipeline.provenance import ReferenceImages, image_fingerprint, image_record
from flux_runtime.pipeline.sources import Sources
from flux_runtime.pipeline.state import Call, Conditioning, OutputType, PipelineOutput, Progress, Start
from flux_runtime.pipeline.step_caching import as_policy
from flux_runtime.pipeline.tiers import Tier
from flux_runtime.registry import (
    spec_for,
)
from flux_runtime.sampling import (
    bn_denormalize,
    encode_reference_images,
    flux2_image_ids,
    flux2_pack,
    flux2_prepare_noise,
    flux2_text_ids,
    flux2_unpack,
    klein_uses_cfg,
    latent_bn_stats,
    latent_size,
    preprocess_reference_images,
    unpatchify,
)
from flux_runtime.sampling.reference_images import not_pil
from flux_runtime.sampling.step_cache import CachePolicy
from flux_runtime.text.flux2 import MAX_SEQUENCE_LENGTH, NEGATIVE_PROMPT

__all__ = ["DEFAULT_GUIDANCE", "DEFAULT_STEPS", "Flux2Pipe", "image_fingerprint", "image_record"]

log = logging.getLogger(__name__)

# Flux2Pipeline.__call__ and Flux2KleinPipeline.__call__ defaults (both pipelines, every checkpoint).
DEFAULT_STEPS = 50
DEFAULT_GUIDANCE = 4.0
# diffusers' `default_sample_size`: the default side is 128 latent pixels times the VAE factor (1024 px).
DEFAULT_SAMPLE_SIZE = 128


class Flux2Pipe(Recipe):
    """FLUX.2 [dev] / [klein] text-to-image and reference-image editing.

    Built by `Pipeline.from_pretrained` for FLUX.2 checkpoints, or from loaded parts. `is_distilled` marks a
    step-distilled [klein] checkpoint (no CFG; `guidance` is ignored).
    """

    family = "flux2"  # what callers branch on without importing every recipe

    oom_hint = "fewer reference images, "

    def __init__(
        self,
        transformer: Flux2Transformer,
        vae: Flux2VAE,
        text_encoder: TextEncoder | None,
        *,
        schedule: Any,
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
        if (
            text_encoder is not None and text_encoder.output_dim != width
        ):  # None: not rank 0 of a parallel run
            raise FluxError(
                f"{model_name}: the {text_encoder.family} text encoder gives {text_encoder.output_dim}-wide embeddings but the "
                f"transformer reads {width} (FLUX.2 [dev] takes Mistral Small, [klein] 4B Qwen3-4B, 9B Qwen3-8B)"
            )
        if transformer.config.guidance_embed and is_distilled:
            raise FluxError(
                "is_distilled is a FLUX.2 [klein] setting; this transformer embeds guidance ([dev])"
            )
        self.is_distilled = is_distilled
        self._setup(
            transformer, vae, text_encoder, schedule=schedule, model_name=model_name, weights_id=weights_id,
            quality=quality, cuda_graphs=cuda_graphs, offload_text_encoders=offload_text_encoders,
        )  # fmt: skip

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sources(cls, src: Sources, **options: Any) -> Flux2Pipe:
        """Load the parts `find_sources` located (see `flux2_sources.open_flux2` for the options)."""
        return open_flux2(cls, src, **options)

    @property
    def is_dev(self) -> bool:
        """FLUX.2 [dev]: the transformer embeds guidance (Flux2Pipeline); otherwise [klein] (Flux2KleinPipeline)."""
        return self.transformer.config.guidance_embed

    @property
    def default_steps(self) -> int:
        """50, diffusers' default for both pipelines (the distilled [klein] models are made for 4)."""
        return DEFAULT_STEPS

    @property
    def default_max_sequence_length(self) -> int:
        """Text tokens when a call does not say: 512 (diffusers'), or the length a built-in model trained with."""
        spec = spec_for(self.model_name)
        if spec is not None and spec.builtin and spec.max_sequence_length:
            return spec.max_sequence_length
        return MAX_SEQUENCE_LENGTH

    @property
    def default_size(self) -> int:
        """Default image side: diffusers' 128 latent pixels x the VAE factor (1024), the registry's for a built-in
        model (tiny-flux2: 128, fast on a CPU). With reference images the first one's size is the default instead."""
        spec = spec_for(self.model_name)
        if spec is not None and spec.default_size:
            return spec.default_size
        return DEFAULT_SAMPLE_SIZE * self.vae.config.spatial_factor

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
        cache: str | CachePolicy | None = None,
        **unknown: Any,
    ) -> PipelineOutput:
        """Generate (or, with `image`, edit) images. Arguments as `Pipeline.__call__` and diffusers' FLUX.2 pipelines.

        `image`: reference PIL image(s) to edit or compose from (each ≥ 64 px a side, aspect ≤ 8; shrunk to
        ≤ 1024² px and center-cropped to a multiple of 16, as diffusers does); `height`/`width` then default to
        the first one's size, else `default_size`. `num_steps` default 50, `guidance` default 4.0 (diffusers'
        defaults): [dev] embeds it; [klein] uses it as the CFG scale (CFG when > 1 and not distilled; a
        distilled model ignores it, with a warning when given). Exactly one of `seed` / `generator` (neither:
        seed 0). `prompt_embeds` (B, L, context_in_dim) may replace `prompt` (the CFG negative is still
        encoded). `output_type="latent"` returns in `images` what diffusers returns: [dev] the packed latents
        (B, L, 128), [klein] the decoder's input (B, 32, h, w); `latents` is always the packed (B, L, 128).
        """
        reject_unknown(type(self).__call__, unknown, self.model_name, "FLUX.2")
        if max_sequence_length is None:
            max_sequence_length = self.default_max_sequence_length
        call = Call(
            prompt, height, width, num_steps, guidance, seed, generator, max_sequence_length,
            num_images_per_prompt, output_type, quality or self.quality, progress, prompt_embeds,
            inputs={"image": image},
            cache=self.cache if cache is None else as_policy(cache),
        )  # fmt: skip
        return self._run(call)

    # ------------------------------------------------------------------ the recipe
    def _check_images(self, image: ReferenceImages | None) -> list[Tensor]:
        """The preprocessed reference images (fp32, (1, 3, h, w) in [-1, 1]); [] without any."""
        if image is None:
            return []
        if not isinstance(image, (Image.Image, list, tuple)):
            raise FluxError(not_pil("image", image, "a PIL image or a list of them"))
        if not isinstance(image, Image.Image) and not image:
            raise FluxError("image is an empty list: pass None for no reference images")
        try:
            return preprocess_reference_images(image, vae_scale_factor=self.vae.config.spatial_factor)
        except ValueError as e:
            raise FluxError(str(e)) from None

    def planned_tokens(self, call: Call | None) -> tuple[int, int]:
        """The text window's cap and the reference images' tokens, which join the image's in the sequence."""
        text, _ = super().planned_tokens(call)
        if call is None:
            return text, 0
        token = 2 * self.vae.config.spatial_factor  # pixels per side of one packed token
        return text, sum((r.shape[-2] // token) * (r.shape[-1] // token) for r in call.prepared["refs"])

    def check(self, call: Call) -> None:
        """Defaults filled in, or one FluxError naming the problem; no model runs."""
        refs = self._check_images(call.inputs["image"])
        call.prepared["refs"] = refs
        if refs:
            ref_h, ref_w = refs[0].shape[-2:]
            call.height = ref_h if call.height is None else call.height
            call.width = ref_w if call.width is None else call.width
        call.height = self.default_size if call.height is None else call.height
        call.width = self.default_size if call.width is None else call.width
        if call.prompt_embeds is None:
            batch = check_prompts(call.prompt)
        else:
            if call.prompt is not None:
                raise FluxError("pass either prompt or prompt_embeds, not both")
            dim = self.transformer.config.context_in_dim
            batch = check_prompt_embeds(call.prompt_embeds, dim, MAX_SEQUENCE_LENGTH, self.dtype)
        check_size(call.height, call.width, 2 * self.vae.config.spatial_factor)
        f = self.vae.config.spatial_factor
        check_vae_tile(self.vae_tile, (call.height // f, call.width // f))
        call.steps = check_steps(call.num_steps, self.default_steps)
        g = check_guidance(call.guidance, DEFAULT_GUIDANCE)
        if self.is_distilled:
            if call.guidance is not None and call.guidance > 1:
                # Flux2KleinPipeline.check_inputs logs the same
                warn_caller(
                    f"{self.model_name} is step-distilled: guidance {call.guidance} is ignored (no CFG)"
                )
            call.guidance_used = None
        else:
            call.guidance_used = g
        check_sampling(
            call.seed, call.generator, call.max_sequence_length, MAX_SEQUENCE_LENGTH,
            call.num_images_per_prompt, call.output_type, call.quality,
        )  # fmt: skip
        n = call.num_images_per_prompt
        generator = call.generator
        if isinstance(generator, list) and (
            len(generator) != batch * n or not all(isinstance(x, torch.Generator) for x in generator)
        ):
            raise FluxError(
                f"a list of generators needs one torch.Generator per image: {batch * n}, got {len(generator)}"
            )
        cfg = call.guidance_used is not None and self.uses_cfg(call.guidance_used)
        call.true_cfg_scale = call.guidance_used if cfg and call.guidance_used is not None else 1.0

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
        only meanwhile when the memory plan moves it; repeated prompts from the cache."""
        te = self.text_encoder

        def encode(prompts: str | list[str]) -> Tensor:
            key = ("flux2", prompts if isinstance(prompts, str) else tuple(prompts), max_len, n)
            return self.cached_encode(
                key,
                lambda: (
                    te.encode(
                        prompts, max_sequence_length=max_len, num_images_per_prompt=n, device=self.device
                    ).prompt_embeds
                ),
            )

        with self.using("text", enter=False):
            if prompt_embeds is None:
                assert prompt is not None  # checked
                embeds = encode(prompt)
                batch = 1 if isinstance(prompt, str) else len(prompt)
            else:
                # diffusers' encode_prompt: repeat(1, n, 1).view(B * n, L, D), i.e. each row n times in a row
                embeds = prompt_embeds.to(self.device).repeat_interleave(n, dim=0)
                batch = prompt_embeds.shape[0]
            # Flux2KleinPipeline.__call__: "" once per prompt, encoded with the same settings
            # (KleinTextEncoder.encode_negative; written out so any FLUX.2 encoder can serve)
            negative = encode([NEGATIVE_PROMPT] * batch) if cfg else None
        return embeds, negative

    def encode(self, call: Call) -> Conditioning:
        embeds, negative = self._encode(
            call.prompt, call.prompt_embeds, call.true_cfg_scale > 1, call.max_sequence_length,
            call.num_images_per_prompt,
        )  # fmt: skip
        return Conditioning(embeds, negative_txt=negative)

    def prepare(self, call: Call, cond: Conditioning) -> Start:
        """The reference images through the VAE encoder, 128-channel noise in the text dtype (as
        Flux2Pipeline) packed to tokens, ids with the references after the noise tokens."""
        device, vae, refs = self.device, self.vae, call.prepared["refs"]
        batch, txt_len = cond.txt.shape[:2]
        f = vae.config.spatial_factor
        mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
        assert call.height is not None and call.width is not None  # filled by check
        h, w = latent_size(call.height, call.width, f)
        ref_tokens: Tensor | None = None
        ref_ids: Tensor | None = None
        if refs:
            # in the VAE's dtype (diffusers' `vae.dtype`), as Flux2Pipeline.prepare_image_latents
            vae_dtype = vae.encoder.conv_in.weight.dtype
            ref_tokens, ref_ids = encode_reference_images(
                refs, vae.encode, mean, std, batch=batch, dtype=vae_dtype, device=device
            )
        noise = flux2_prepare_noise(
            batch, call.height, call.width, dtype=cond.txt.dtype, device=device, seed=call.seed,
            generator=call.generator, vae_scale_factor=f,
        )  # fmt: skip
        latents = flux2_pack(noise)  # (B, L, 128)
        # the schedule counts the generated image's tokens only
        sigmas, timesteps = self._schedule(call.steps, latents.shape[1])
        img_ids = flux2_image_ids(h, w, device=device)
        if ref_ids is not None:
            img_ids = torch.cat([img_ids, ref_ids])  # (L + L_ref, 4): references after the noise tokens
        ref_layout = tuple(tuple(r.shape[-2:]) for r in refs)
        return Start(
            latents, (h, w), sigmas, timesteps, img_ids=img_ids, txt_ids=flux2_text_ids(txt_len, device=device),
            rope_key=(h, w, ref_layout, txt_len, device), reference_tokens=ref_tokens,
        )  # fmt: skip

    def guidance_tensor(self, call: Call, batch: int) -> Tensor | None:
        if not self.is_dev or call.guidance_used is None:
            return None
        return torch.full([1], call.guidance_used, device=self.device, dtype=torch.float32).expand(batch)

    def velocity(
        self, x: Tensor, t: Tensor, g: Tensor | None, txt: Tensor, vec: Tensor | None, mods: Tensor | None,
        ids: tuple[Tensor, Tensor], pe: RoPE,
    ) -> Tensor:  # fmt: skip
        img_ids, txt_ids = ids
        # latent_model_input.to(transformer.dtype): (B, L + L_ref, 128)
        return self.transformer(x.to(self.dtype), img_ids, txt, txt_ids, t, g, pe=pe)

    def _decoder_latents(self, latents: Tensor, start: Start) -> Tensor:
        """Unpack, BatchNorm-denormalise and unpatchify in the latents' dtype: (B, 32, h, w)."""
        vae = self.vae
        mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
        h, w = start.grid
        return unpatchify(bn_denormalize(flux2_unpack(latents, h, w), mean, std))

    def decoder_input(self, latents: Tensor, start: Start) -> Tensor:
        return self._decoder_latents(latents, start)

    def latent_output(self, latents: Tensor, start: Start) -> Tensor:
        """[dev]: the packed latents (Flux2Pipeline); [klein]: the decoder's input (Flux2KleinPipeline)."""
        return latents if self.is_dev else self._decoder_latents(latents, start)

    def record_inputs(self, call: Call) -> dict[str, Any]:
        """`reference_images`: per image its file (PIL's `filename`, or None for an image made in memory),
        size and `image_fingerprint`, so a replay can tell a changed file."""
        image = call.inputs["image"]
        given = [] if image is None else [image] if isinstance(image, Image.Image) else list(image)
        return {"reference_images": [image_record(im) for im in given]}

    def _new_graph(self, fn: Callable[..., Tensor]) -> GraphedDenoiser:
        # through this module's name, so a test can stand a CPU fake in for the CUDA graphs
        return GraphedDenoiser(fn)
