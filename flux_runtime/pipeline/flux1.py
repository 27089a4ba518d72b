"""`Flux1Pipe`: FLUX.1 text to image with the same pixels as diffusers' FluxPipeline, and its variants.

The FLUX.1 recipe for the pipeline core: encode the prompt (CLIP pooled + T5 states; with true CFG also
the negative prompt), draw noise with a CPU generator in the text dtype, pack it, build the schedule from
the image token count, Euler-integrate the transformer's velocity, unpack, denormalise, decode. The
variants (img2img, inpainting, Kontext, Fill, Depth/Canny) change only how the latents start and what
conditions each step (`flux1_variants`). Every input is checked before any model runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from flux_runtime.models.dit import Flux1Transformer
from flux_runtime.models.vae import Flux1VAE
from flux_runtime.parallel.group import World
from flux_runtime.parallel.ulysses import SequenceParallel
from flux_runtime.pipeline import controlnets, flux1_variants, ip_adapter, placement, text_warmup
from flux_runtime.pipeline import redux as redux_stage
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
from flux_runtime.pipeline.core import Recipe, RoPE, settle
from flux_runtime.pipeline.errors import FluxError, warn_caller
from flux_runtime.pipeline.provenance import weights_id
from flux_runtime.pipeline.redux import Redux, open_redux
from flux_runtime.pipeline.sources import Sources, schedule_config
from flux_runtime.pipeline.state import (
    Call,
    Conditioning,
    OutputType,
    PipelineOutput,
    Progress,
    Start,
    WithExtra,
)
from flux_runtime.pipeline.step_caching import as_policy
from flux_runtime.pipeline.tiers import Tier
from flux_runtime.registry import Variant, spec_for
from flux_runtime.sampling import (
    denormalize_latents,
    draw_noise,
    image_ids,
    latent_size,
    pack,
    unpack,
)
from flux_runtime.sampling.step_cache import CachePolicy
from flux_runtime.text.flux1 import MAX_SEQUENCE_LENGTH, Flux1TextEncoder
from flux_runtime.weights import load_transformer
from flux_runtime.weights.builtin import builtin
from flux_runtime.weights.checkpoint import TransformerCheckpoint
from flux_runtime.weights.redux import ReduxFiles
from flux_runtime.weights.vae import load_vae

__all__ = ["Flux1Pipe"]

log = logging.getLogger(__name__)

# FluxPipeline.__call__ defaults: dev 28 steps at guidance 3.5, schnell 4; FluxFillPipeline's 50 at 30.
DEFAULT_STEPS, DISTILLED_STEPS, DEFAULT_GUIDANCE = 28, 4, 3.5
FILL_STEPS, FILL_GUIDANCE = 50, 30.0
DEFAULT_SIZE = 1024


class Flux1Pipe(Recipe):
    """FLUX.1 [dev] / [schnell] text-to-image, true CFG, and the FLUX.1 variants. Build with `from_pretrained`.

    `variant` is what the checkpoint does besides text to image (`text2img`, `kontext`, `fill`,
    `control` for Depth / Canny); Fill and Depth/Canny are also told by the transformer's input width.
    """

    family = "flux1"  # what callers branch on without importing every recipe
    redux: Redux | None = None  # FLUX.1 Redux: `image=` conditions a call in place of a prompt (load_redux)

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
        cache: str | CachePolicy | None = None,
        controlnet: Any = None,
    ) -> None:
        self.cache = as_policy(cache)
        self.variant: Variant = flux1_variants.variant_of(transformer, vae, variant, model_name)
        check_latent_widths(transformer, vae, model_name, self.variant)
        weight = transformer.img_in.weight
        self.controlnets = controlnets.as_controlnets(controlnet, device=weight.device, dtype=weight.dtype)
        controlnets.check_nets(self.controlnets, transformer, vae, model_name)
        if text_encoder is not None:  # None on the ranks of a parallel run other than rank 0
            _check_text_widths(transformer, text_encoder, model_name)
        self._setup(
            transformer, vae, text_encoder, schedule=schedule, model_name=model_name, weights_id=weights_id,
            quality=quality, cuda_graphs=cuda_graphs, offload_text_encoders=offload_text_encoders,
        )  # fmt: skip

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sources(
        cls,
        src: Sources,
        *,
        device: torch.device,
        dtype: torch.dtype,
        quality: Tier = "lossless",
        cuda_graphs: bool = True,
        offload_text_encoders: bool = False,
        fp8: bool = False,
        fp8_text: bool = False,
        variant: Variant | None = None,
        checkpoint: TransformerCheckpoint | None = None,
        budget: int | None = None,
        parallel: World | None = None,
        controlnet: Any = None,
        redux: ReduxFiles | None = None,
    ) -> Flux1Pipe:
        """Load the parts `find_sources` located (arguments checked by `Pipeline.from_pretrained`;
        `checkpoint`: the transformer already opened there, so its headers are not read again).

        The text encoders: the folder's CLIP-L and T5 (`text_encoder/`, `text_encoder_2/` and their tokenizers),
        else the ones `find_sources` was given or defaults to; a built-in model's small ones.
        `parallel`: this process's rank of a parallel run (the text encoders load on rank 0 only).
        `controlnet`: ControlNets (paths, ids or loaded models, one or a list) loaded beside the transformer.
        `redux`: a Redux (`find_redux`) to load beside the text encoders, where they load.
        """
        # ControlNets stay on the device in every plan (counted beside the autoencoder)
        nets = controlnets.as_controlnets(controlnet, device=device, dtype=dtype)
        left = None if budget is None else max(budget - placement.resident_adapter_bytes(nets), 0)
        # with a budget the transformer loads to host memory unless it fits the device, the text encoders
        # to host memory always: the plan then puts on the device what it keeps there
        dit_device = placement.transformer_device(left, checkpoint, dtype, fp8, device)
        vae_model = load_vae(src.vae, device=device, dtype=dtype)
        if vae_model.config.family != "flux1":
            raise FluxError(
                f"{src.vae} is a {vae_model.config.family} autoencoder; FLUX.1 needs the FLUX.1 VAE"
            )
        main = parallel is None or parallel.is_main  # only rank 0 encodes
        text_device = placement.text_device(
            left, device, offload_text_encoders, _text_sources(src),
            beside=placement.checkpoint_bytes(checkpoint, dtype, fp8) if dit_device == device else 0,
        )  # fmt: skip

        def open_text() -> Flux1TextEncoder:
            text = _open_text(src, text_device, dtype)
            if fp8_text:
                text.quantize_fp8()
            return text

        # on a GPU the text encoders load first, warmed up while the transformer streams in (`text_warmup`)
        first = main and text_warmup.loads_first(text_device, _text_sources(src))
        text = open_text() if first else None
        with text_warmup.warming(text, text_device):
            transformer = load_transformer(
                checkpoint or src.transformer, device=dit_device, dtype=dtype, fp8=fp8
            )
        assert isinstance(transformer, Flux1Transformer)  # told by the keys
        sharded = None if parallel is None else SequenceParallel(transformer, parallel)  # heads checked first
        named = flux1_variants.named_variant(src, variant)
        check_latent_widths(
            transformer,
            vae_model,
            src.name,
            flux1_variants.variant_of(transformer, vae_model, named, src.name),
        )
        if main and text is None:
            text = open_text()
        loaded = None
        if redux is not None and main:
            loaded = open_redux(redux, transformer, device=text_device, dtype=dtype, name=src.name)
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
            controlnet=nets or None,
        )
        pipe.redux = loaded  # before the plan, which counts it with the text encoders
        return settle(
            pipe, src, fp8_text=fp8_text, budget=budget, offload_text_encoders=offload_text_encoders,
            device=device, parallel=parallel, sharded=sharded,
        )  # fmt: skip

    def input_widened(self, name: str) -> None:
        """A LoRA (`name`) widened the transformer's input (a Control LoRA): the variant follows the new width,
        and the widths are checked again against the VAE."""
        self.variant = flux1_variants.variant_of(self.transformer, self.vae, None, self.model_name)
        check_latent_widths(self.transformer, self.vae, name, self.variant)

    def load_redux(self, path: str | Path, image_encoder: str | Path | None = None) -> Redux:
        """Attach FLUX.1 Redux: then `pipe(image=IMG)` generates from the image (see `flux_runtime.pipeline.redux`).

        `path`: the FLUX.1-Redux-dev diffusers folder (its SigLIP inside), or BFL's flux1-redux-dev.safetensors
        with `image_encoder`, SigLIP's folder (a FLUX.1-Redux-dev folder, or google/siglip-so400m-patch14-384).
        """
        return redux_stage.attach(self, path, image_encoder)

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
        cache: str | CachePolicy | None = None,
        negative_prompt: str | list[str] | None = None,
        true_cfg_scale: float = 1.0,
        image: Image.Image | list[Image.Image] | None = None,
        mask_image: Image.Image | None = None,
        strength: float | None = None,
        control_image: Image.Image | None = None,
        auto_resize: bool = True,
        max_area: int | None = None,
        controlnet_conditioning_scale: float | list[float] = 1.0,
        control_mode: int | str | list[int | str | None] | None = None,
        control_guidance_start: float | list[float] = 0.0,
        control_guidance_end: float | list[float] = 1.0,
        prompt_embeds_scale: float | list[float] = 1.0,
        pooled_prompt_embeds_scale: float | list[float] = 1.0,
        ip_adapter_image: Image.Image | None = None,
        negative_ip_adapter_image: Image.Image | None = None,
        ip_adapter_image_embeds: list[Tensor] | Tensor | None = None,
        negative_ip_adapter_image_embeds: list[Tensor] | Tensor | None = None,
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
        checkpoint; on a pipeline with ControlNets, their control images (one, or a list: one per ControlNet,
        each the output's size, which it sets when height/width are not given), with per ControlNet (one
        value for all, or a list) `controlnet_conditioning_scale`, `control_mode` (a union ControlNet's:
        an index or a name such as "canny", "depth") and the fraction of the steps it acts in,
        `control_guidance_start` to `control_guidance_end`, as diffusers' FluxControlNetPipeline.
        With a Redux attached (`redux=` / `load_redux`) `image` is instead the Redux image (or a list of them),
        which conditions the call in place of the prompt, as FluxPriorReduxPipeline then FluxPipeline; `prompt`
        is optional there, `prompt_embeds_scale` / `pooled_prompt_embeds_scale` weigh each image (one number,
        or one per image); img2img, Kontext and Fill, which read `image` too, are refused.
        `ip_adapter_image` (with an IP-Adapter loaded, `load_ip_adapter`): the image prompt;
        `negative_ip_adapter_image`: the negative branch's under true CFG (default: a black image).
        `ip_adapter_image_embeds` / `negative_ip_adapter_image_embeds`: that branch's CLIP image embeddings in
        place of its image, a list of one tensor (1, num_images, E) as `encode_ip_adapter_image` returns, or
        that tensor alone (so an image prompt is encoded once and reused across calls); the same bits as the
        image, repeated over the images as the image's embedding is.
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
                max_area=max_area, controlnet_conditioning_scale=controlnet_conditioning_scale,
                control_mode=control_mode, control_guidance_start=control_guidance_start,
                control_guidance_end=control_guidance_end,
                prompt_embeds_scale=prompt_embeds_scale, pooled_prompt_embeds_scale=pooled_prompt_embeds_scale,
                ip_adapter_image=ip_adapter_image, negative_ip_adapter_image=negative_ip_adapter_image,
                ip_adapter_image_embeds=ip_adapter_image_embeds,
                negative_ip_adapter_image_embeds=negative_ip_adapter_image_embeds,
            ),
            cache=self.cache if cache is None else as_policy(cache),
        )  # fmt: skip
        return self._run(call)

    # ------------------------------------------------------------------ the recipe
    def check(self, call: Call) -> None:
        cfg = self.transformer.config
        redux_call = redux_stage.check_call(self, call)  # the Redux image(s) and scales; a prompt is optional
        if call.prompt_embeds is None:
            if not redux_call:
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
        # the ControlNets' inputs (taking control_image), then the variant's (images, masks, strength,
        # negative prompt) and the default size they imply
        controlnets.check_call(self, call)
        flux1_variants.check_inputs(self, call)
        ip_adapter.check_call(self, call)
        default_h, default_w = controlnets.default_size(call) or (self.default_size, self.default_size)
        call.height = default_h if call.height is None else call.height
        call.width = default_w if call.width is None else call.width
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
        controlnets.check_sizes(call)

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
        if "redux_images" in call.inputs:
            return redux_stage.encode(self, call)
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
        cond = Conditioning(txt, vec) if neg is None else Conditioning(txt, vec, neg[0], neg[1])
        if ip_adapter.loaded(self) is not None:
            cond.extra, cond.negative_extra = ip_adapter.encode_images(self, call, cond.batch)
        return cond

    def fixed_extra(self, extra: Any) -> Any:
        """The IP-Adapter's image tokens from the branch's CLIP image embeddings, once per generation (diffusers
        projects them at every step: the same ops on the same inputs)."""
        return self.transformer.project_image(extra)

    # ------------------------------------------------------------------ IP-Adapter
    def load_ip_adapter(
        self,
        path: str | Path,
        scale: float | list[float] = 1.0,
        *,
        image_encoder: str | Path | None = None,
        image_encoder_dtype: torch.dtype = torch.float16,
    ) -> ip_adapter.LoadedIPAdapter:
        """Load the XLabs FLUX.1 IP-Adapter (as diffusers' `load_ip_adapter`): `path` a .safetensors file, a
        folder holding `ip_adapter.safetensors`, or a cached Hugging Face id; `scale` one number or one per
        double block. `image_encoder`: the CLIP vision encoder (CLIPVisionModelWithProjection folder or cached
        id; default `image_encoder/` beside the adapter, else openai/clip-vit-large-patch14 from the cache),
        run in `image_encoder_dtype` (diffusers' default fp16). Calls then take `ip_adapter_image`."""
        return ip_adapter.load_ip_adapter(
            self, path, scale, image_encoder=image_encoder, image_encoder_dtype=image_encoder_dtype
        )

    @torch.no_grad()
    def encode_ip_adapter_image(self, image: Image.Image) -> list[Tensor]:
        """The loaded IP-Adapter's CLIP image embedding of `image`: `[tensor (1, 1, E)]` in the image encoder's
        dtype on the pipeline's device, what a call takes as `ip_adapter_image_embeds` (or the negative one)
        in place of the image, with the same result. Encode an image prompt once and reuse it across calls;
        `torch.cat(..., dim=1)` of several makes one prompt of several images, as diffusers reads it.
        (Not diffusers' `prepare_ip_adapter_image_embeds`, which also repeats over a batch: a call does that.)"""
        return ip_adapter.encode_image(self, image)

    def unload_ip_adapter(self) -> None:
        """Take the IP-Adapter and its image encoder off: calls run as the plain pipeline again."""
        ip_adapter.unload_ip_adapter(self)

    def set_ip_adapter_scale(self, scale: float | list[float]) -> None:
        """The loaded IP-Adapter's scale: one number, or one per double block."""
        ip_adapter.set_ip_adapter_scale(self, scale)

    def prepare(self, call: Call, cond: Conditioning) -> Start:
        if "controlnet" not in call.prepared:
            return flux1_variants.prepare(self, call, cond)
        if call.inputs["image"] is None:
            return controlnets.prepare(
                self, call, cond, lambda g: self.text2img_start(call, cond, generator=g)
            )
        return controlnets.prepare(
            self, call, cond, lambda g: flux1_variants.img2img_start(self, call, cond, g)
        )

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
        ip = None
        if isinstance(txt, WithExtra):  # the branch's IP-Adapter image tokens
            txt, ip = txt
        return self.transformer(x, img_ids, txt, txt_ids, t, vec, g, pe=pe, mods=mods, ip=ip)

    def controlled_velocity(
        self, x: Tensor, t: Tensor, g: Tensor | None, txt: Tensor, vec: Tensor | None, mods: Tensor | None,
        ids: tuple[Tensor, Tensor], pe: RoPE, control: Any, active: tuple,
    ) -> Tensor:  # fmt: skip
        residuals = controlnets.residuals(self.controlnets, control, active, x, t)
        img_ids, txt_ids = ids
        ip = None
        if isinstance(txt, WithExtra):  # the branch's IP-Adapter image tokens (the ControlNets read none)
            txt, ip = txt
        return self.transformer(
            x, img_ids, txt, txt_ids, t, vec, g, pe=pe, mods=mods, ip=ip, control=residuals
        )

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
        return {
            **flux1_variants.record_inputs(self, call),
            **controlnets.record(self, call),
            **redux_stage.record_inputs(self, call),
            **ip_adapter.record_inputs(self, call),
        }

    def planned_tokens(self, call: Call | None) -> tuple[int, int]:
        """The text window, and with Redux (a default call on a Redux pipeline too) its image tokens after it."""
        text, extra = super().planned_tokens(call)
        if self.redux is not None and (call is None or "redux_images" in call.inputs):
            text += self.redux.tokens
        return text, extra


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
