"""`Flux3Pipe`: FLUX.3 Image Klein text to image, with the pixels of diffusers' FLUX.3 modular pipeline.

Open it with `Pipeline.from_pretrained` (which returns this class when the transformer's keys are FLUX.3's).
Order of work, as diffusers 0.42.1's `Flux3AutoBlocks` / `Flux3DistilledAutoBlocks` run it (the prompt
upsampler left out): encode the one prompt with Qwen3-VL (the base model with CFG: also the empty negative
prompt, its own text length), prepare and VAE-encode the reference images if any (`sampling.flux3_references`:
one kept whole on a reflect-padded canvas, several centre-cropped), draw 128-channel noise in float32 and cast
it, build the static-shift schedule, integrate (`sampling.flux3`; the references as their own token stream at
every step), unpack, BatchNorm-denormalise, unpatchify, decode, crop back to a single reference's box (when no
size was given), postprocess.

Base or flow map is the checkpoint's (`config.flow_map`, told by its target-timestep embedder):
- base (`flux3-klein-base`): 50 steps, CFG at `guidance` (default 3.5, or the folder's guider config), the
  conditional and unconditional prompts in separate forwards; `guidance` 1 runs no CFG;
- flow map (`flux3-klein`): 16 steps, no CFG (`guidance` is ignored), each step told the time it jumps to.

Every input is checked before any model runs; RoPE tables are built once per image size and text length; on
CUDA each branch replays its own CUDA graph.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from flux_runtime.models.dit.flux3 import Flux3Fixed, Flux3RoPE, Flux3Transformer
from flux_runtime.models.vae import Flux2VAE
from flux_runtime.pipeline import flux3_upsample
from flux_runtime.pipeline.arguments import reject_unknown
from flux_runtime.pipeline.checks import (
    check_guidance,
    check_latent_widths,
    check_prompt_embeds,
    check_sampling,
    check_size,
    check_steps,
    check_vae_tile,
)
from flux_runtime.pipeline.core import Recipe
from flux_runtime.pipeline.errors import FluxError, warn_caller
from flux_runtime.pipeline.flux3_sources import DEFAULT_GUIDANCE, open_flux3
from flux_runtime.pipeline.graphs import GraphedDenoiser
from flux_runtime.pipeline.provenance import ReferenceImages, image_record
from flux_runtime.pipeline.sources import Sources
from flux_runtime.pipeline.state import Call, Conditioning, OutputType, PipelineOutput, Progress, Start
from flux_runtime.pipeline.step_caching import as_policy
from flux_runtime.pipeline.tiers import Tier
from flux_runtime.registry import spec_for
from flux_runtime.sampling import (
    bn_denormalize,
    flux2_pack,
    flux2_unpack,
    latent_bn_stats,
    latent_size,
    unpatchify,
)
from flux_runtime.sampling.flux3 import FLUX3_SCHEDULE, flux3_denoise, flux3_image_ids, flux3_prepare_noise
from flux_runtime.sampling.flux3_references import (
    PreparedReferences,
    encode_flux3_references,
    prepare_flux3_references,
)
from flux_runtime.sampling.schedule import ScheduleConfig
from flux_runtime.sampling.step_cache import CachePolicy
from flux_runtime.text.flux3 import MAX_SEQUENCE_LENGTH, NEGATIVE_PROMPT, Flux3TextEncoder, text_ids
from flux_runtime.text.flux3_upsampler import MAX_NEW_TOKENS as UPSAMPLER_MAX_NEW_TOKENS

__all__ = ["BASE_STEPS", "DEFAULT_GUIDANCE", "FLOW_MAP_STEPS", "Flux3Pipe"]

log = logging.getLogger(__name__)

# diffusers' FLUX.3 defaults: steps (base, flow map), the image side (the CFG scale: flux3_sources).
BASE_STEPS = 50
FLOW_MAP_STEPS = 16
DEFAULT_SIZE = 1024
# The text windows a memory plan budgets: a default call's (a long prompt's window), and an upsampled caption's
# (the upsampler writes at most MAX_NEW_TOKENS tokens; its chat template adds a few dozen, rounded up to 80).
PLANNED_TEXT_TOKENS = 512
UPSAMPLED_TEXT_TOKENS = math.ceil((UPSAMPLER_MAX_NEW_TOKENS + 64) / 80) * 80


@dataclass
class Flux3Start(Start):
    """`Start` plus the text lengths of the branches (conditional first): each has its own RoPE tables.

    With references, `img_ids` holds the generated image's ids then the references' (l = -1, -2, ...), and
    `channel_cond` the reference tokens (B, L_ref, 128), their own stream in the transformer."""

    txt_lengths: tuple[int, ...] = ()


class Flux3Pipe(Recipe):
    """FLUX.3 Image Klein text-to-image, base or flow map (step-distilled)."""

    family = "flux3"  # what callers branch on without importing every recipe

    def __init__(
        self,
        transformer: Flux3Transformer,
        vae: Flux2VAE,
        text_encoder: Flux3TextEncoder,
        *,
        schedule: ScheduleConfig = FLUX3_SCHEDULE,
        guidance: float = DEFAULT_GUIDANCE,
        model_name: str = "custom",
        weights_id: str = "",
        quality: Tier = "lossless",
        cuda_graphs: bool = True,
        offload_text_encoders: bool = False,
        prompt_upsampler: str | Path | None = None,
    ) -> None:
        if transformer.config.family != "flux3":
            raise FluxError(
                f"{model_name} is a {transformer.config.family} transformer; this pipeline runs FLUX.3"
            )
        if vae.config.family != "flux2":
            raise FluxError(f"the autoencoder is a {vae.config.family} one; FLUX.3 needs the FLUX.2 VAE")
        check_latent_widths(transformer, vae, model_name)
        width = transformer.config.context_in_dim
        if text_encoder.output_dim != width:
            raise FluxError(
                f"{model_name}: the text encoder gives {text_encoder.output_dim}-wide embeddings but the transformer "
                f"reads {width} (FLUX.3 Image Klein takes Qwen3-VL-4B)"
            )
        self.default_guidance = guidance
        self.prompt_upsampler = flux3_upsample.UpsamplerSetting(prompt_upsampler)
        self._setup(
            transformer, vae, text_encoder, schedule=schedule, model_name=model_name, weights_id=weights_id,
            quality=quality, cuda_graphs=cuda_graphs, offload_text_encoders=offload_text_encoders,
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.transformer.txt_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.txt_in.weight.dtype

    @property
    def is_flow_map(self) -> bool:
        """The step-distilled release: no CFG, 16 steps, each step told its target time."""
        return self.transformer.config.flow_map

    @property
    def default_steps(self) -> int:
        return FLOW_MAP_STEPS if self.is_flow_map else BASE_STEPS

    @property
    def default_max_sequence_length(self) -> int:
        """The longest text window a call reads by default (Qwen3-VL tokens)."""
        return MAX_SEQUENCE_LENGTH

    @property
    def default_size(self) -> int:
        """1024, or the registry's side for a built-in model (fast on a CPU)."""
        spec = spec_for(self.model_name)
        return spec.default_size if spec is not None and spec.default_size else DEFAULT_SIZE

    def set_prompt_upsampler(
        self, path_or_id: str | Path | None, *, prompts: str | Path | None = None
    ) -> None:
        """Use the prompt upsampler in `path_or_id` (a folder or cached id; None: no upsampler), with its system
        prompts from `prompts` (a JSON file; default: `system_prompts.json` in the upsampler's folder). Opened on the
        first call that upsamples."""
        self.prompt_upsampler = flux3_upsample.UpsamplerSetting(path_or_id, prompts)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sources(cls, src: Sources, **options: Any) -> Flux3Pipe:
        """Load the parts `find_sources` located (see `flux3_sources.open_flux3` for the options)."""
        return open_flux3(cls, src, **options)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def __call__(
        self,
        prompt: str | None = None,
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
        upsample: bool | None = None,
        upsampled_prompt: str | None = None,
        boxes: list[dict[str, Any]] | None = None,
        **unknown: Any,
    ) -> PipelineOutput:
        """Generate `num_images_per_prompt` images of one prompt (FLUX.3 takes one per call, as diffusers does).

        `image`: 1 to 10 reference PIL images. One is kept whole: shrunk to fit a 4 MP canvas (sides rounded up to
        16 px, 64..4096), reflect-padded to it; without `height`/`width` the image is generated at that canvas and
        cropped back to the reference (the output has the reference's shrunk size). Several are each shrunk to
        ≤ 1 MP and centre-cropped to multiples of 16; the size then defaults to the first one's.
        `height`/`width` default to `default_size` (multiples of 16); `num_steps` 50 (base) or 16 (flow map);
        `guidance` the base model's CFG scale (default 3.5; 1 runs no CFG), ignored by a flow map (a warning when
        given). `max_sequence_length` caps the text window (default 8192). Exactly one of `seed` / `generator` (neither: seed 0). `prompt_embeds` (1, L, context_in_dim) may
        replace `prompt` (the CFG negative is still encoded). `latents` is the final packed (B, L, 128).

        `upsample`: run the prompt upsampler first (with the references, in its edit mode) and encode its caption;
        None (default) does when the pipeline has one (`flux3-klein*`: black-forest-labs/flux-3-image-klein-pup,
        which must be in the local cache), False never. `upsampled_prompt`: an earlier run's caption
        (`info["upsampled_prompt"]`), encoded as is without running the upsampler. The record's `upsample` says
        which ran ("on", "given", "off", "unavailable"). `boxes`: a layout for the upsampler (its layout modes), each
        `{"id", "desc", "bbox"}` or, with references, `{"id", "desc", "from": "target" | "ref_image_N", "src_bbox",
        "tgt_bbox"}`, boxes `[y_min, x_min, y_max, x_max]` in 0-1; the caption cites them and ends with their table.
        """
        reject_unknown(type(self).__call__, unknown, self.model_name, "FLUX.3")
        if max_sequence_length is None:
            max_sequence_length = MAX_SEQUENCE_LENGTH
        call = Call(
            prompt, height, width, num_steps, guidance, seed, generator, max_sequence_length,
            num_images_per_prompt, output_type, quality or self.quality, progress, prompt_embeds,
            inputs={
                "image": image, "upsample": upsample, "upsampled_prompt": upsampled_prompt, "boxes": boxes,
            },
            cache=self.cache if cache is None else as_policy(cache),
        )  # fmt: skip
        return self._run(call)

    # ------------------------------------------------------------------ the recipe
    def check(self, call: Call) -> None:
        """Defaults filled in, or one FluxError naming the problem; no model runs."""
        refs = self._check_images(call.inputs["image"])
        call.prepared["refs"] = refs
        if refs is not None:
            # a given size is used as is and turns the crop-back off; a missing one is the first reference's
            call.prepared["crop"] = refs.crop if call.height is None and call.width is None else None
            ref_h, ref_w = refs.size
            call.height = ref_h if call.height is None else call.height
            call.width = ref_w if call.width is None else call.width
        if call.prompt_embeds is None:
            if isinstance(call.prompt, list) and len(call.prompt) == 1:
                call.prompt = call.prompt[0]
            if not isinstance(call.prompt, str):
                raise FluxError(
                    f"FLUX.3 takes one prompt (a string) per call, got {type(call.prompt).__name__}; "
                    "use num_images_per_prompt for several images"
                )
        else:
            if call.prompt is not None:
                raise FluxError("pass either prompt or prompt_embeds, not both")
            dim = self.transformer.config.context_in_dim
            if check_prompt_embeds(call.prompt_embeds, dim, MAX_SEQUENCE_LENGTH, self.dtype) != 1:
                raise FluxError("FLUX.3 takes one prompt per call: prompt_embeds must be (1, L, D)")
        call.height = self.default_size if call.height is None else call.height
        call.width = self.default_size if call.width is None else call.width
        f = self.vae.config.spatial_factor
        check_size(call.height, call.width, 2 * f)
        check_vae_tile(self.vae_tile, (call.height // f, call.width // f))
        call.steps = check_steps(call.num_steps, self.default_steps)
        g = check_guidance(call.guidance, self.default_guidance)
        if self.is_flow_map:
            if call.guidance is not None:
                warn_caller(
                    f"{self.model_name} is a flow map (step-distilled): guidance {call.guidance} is ignored (no CFG)"
                )
            call.guidance_used = None
        else:
            call.guidance_used = g
        check_sampling(
            call.seed, call.generator, call.max_sequence_length, MAX_SEQUENCE_LENGTH,
            call.num_images_per_prompt, call.output_type, call.quality,
        )  # fmt: skip
        n = call.num_images_per_prompt
        if isinstance(call.generator, list) and (
            len(call.generator) != n or not all(isinstance(x, torch.Generator) for x in call.generator)
        ):
            raise FluxError(
                f"a list of generators needs one torch.Generator per image: {n}, got {len(call.generator)}"
            )
        # diffusers' guider: CFG unless the scale is 1
        cfg = call.guidance_used is not None and not math.isclose(call.guidance_used, 1.0)
        call.true_cfg_scale = call.guidance_used if cfg and call.guidance_used is not None else 1.0
        flux3_upsample.plan(self, call)  # last: the prompt and the references are checked

    def _check_images(self, image: ReferenceImages | None) -> PreparedReferences | None:
        """The prepared reference images, or None without any; a FluxError for bad ones."""
        if image is None:
            return None
        try:
            return prepare_flux3_references(image, multiple=2 * self.vae.config.spatial_factor)
        except ValueError as e:
            raise FluxError(str(e)) from None

    def encode(self, call: Call) -> Conditioning:
        """The upsampler's caption (or the prompt) and, with CFG, the empty negative, through Qwen3-VL: the encoder
        on the device only meanwhile when the memory plan moves it; repeated prompts from the cache."""
        caption = flux3_upsample.caption(self, call)
        te, n, max_len = self.text_encoder, call.num_images_per_prompt, call.max_sequence_length

        def encode(text: str) -> Tensor:
            return self.cached_encode(
                ("flux3", text, max_len, n),
                lambda: te.encode(text, max_sequence_length=max_len, num_images_per_prompt=n, device=self.device)
                .prompt_embeds,
            )  # fmt: skip

        with self.using("text", enter=False):
            if call.prompt_embeds is None:
                assert isinstance(call.prompt, str)  # checked
                embeds = encode(caption or call.prompt)
            else:
                embeds = call.prompt_embeds.to(self.device).repeat_interleave(n, dim=0)
            # the base model's CFG: the empty negative, encoded the same way (Flux3TextEncoder.encode_negative)
            negative = encode(NEGATIVE_PROMPT) if call.true_cfg_scale != 1.0 else None
        return Conditioning(embeds, negative_txt=negative)

    def planned_tokens(self, call: Call | None) -> tuple[int, int]:
        """The text window the memory plan budgets (a default call: 512 tokens; a checked one: its prompt's
        window, the upsampler's longest caption when it runs, or the embeddings' length) and the reference
        images' tokens."""
        if call is None:
            return PLANNED_TEXT_TOKENS, 0
        max_len = call.max_sequence_length
        if call.prompt_embeds is not None:
            text = call.prompt_embeds.shape[1]
        elif call.prepared.get("upsample") == "on":
            text = min(max_len, UPSAMPLED_TEXT_TOKENS)
        else:
            assert isinstance(call.prompt, str)  # checked
            text = self.text_encoder.text_window(call.inputs.get("upsampled_prompt") or call.prompt, max_len)
        refs: PreparedReferences | None = call.prepared.get("refs")
        token = 2 * self.vae.config.spatial_factor  # pixels per side of one packed token
        extra = (
            0 if refs is None else sum((p.shape[-2] // token) * (p.shape[-1] // token) for p in refs.pixels)
        )
        return text, extra

    def uses_cfg(self, guidance: float) -> bool:
        """Whether a call at `guidance` runs CFG (the base model, unless the scale is 1)."""
        return not self.is_flow_map and not math.isclose(guidance, 1.0)

    def prepare(self, call: Call, cond: Conditioning) -> Start:
        """128-channel noise drawn in float32, cast to the text dtype, packed; ids and the static-shift schedule."""
        assert call.height is not None and call.width is not None  # filled by check
        f = self.vae.config.spatial_factor
        h, w = latent_size(call.height, call.width, f)
        noise = flux3_prepare_noise(
            cond.batch, call.height, call.width, dtype=cond.txt.dtype, device=self.device, seed=call.seed,
            generator=call.generator, vae_scale_factor=f,
        )  # fmt: skip
        latents = flux2_pack(noise)  # (B, L, 128)
        sigmas, timesteps = self._schedule(call.steps, latents.shape[1])
        lengths = (cond.txt.shape[1],) + (() if cond.negative_txt is None else (cond.negative_txt.shape[1],))
        img_ids = flux3_image_ids(h // 2, w // 2, device=self.device)
        refs: PreparedReferences | None = call.prepared["refs"]
        ref_tokens = None
        if refs is not None:
            vae = self.vae
            mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
            ref_tokens, ref_ids = encode_flux3_references(
                refs.pixels, vae.encode, mean, std, batch=cond.batch, vae_dtype=vae.encoder.conv_in.weight.dtype,
                dtype=self.dtype, device=self.device,
            )  # fmt: skip
            img_ids = torch.cat([img_ids, ref_ids])  # (L + L_ref, 4): the references after the image
        layout = () if refs is None else tuple(tuple(p.shape[-2:]) for p in refs.pixels)
        return Flux3Start(
            latents, (h, w), sigmas, timesteps, img_ids=img_ids, txt_ids=text_ids(lengths[0], self.device),
            rope_key=(h, w, lengths, layout, self.device), channel_cond=ref_tokens, crop=call.prepared.get("crop"),
            txt_lengths=lengths,
        )  # fmt: skip

    def rope_tables(self, start: Start) -> dict[int, Flux3RoPE]:
        """One set of tables per text length (the CFG branches' prompts have their own windows)."""
        assert isinstance(start, Flux3Start)
        img_ids, ref_ids = _split_ids(start.img_ids, start.latents.shape[1])
        return {
            n: self.transformer.rope(text_ids(n, self.device), img_ids, ref_ids) for n in start.txt_lengths
        }

    def guidance_tensor(self, call: Call, batch: int) -> Tensor | None:
        return None  # FLUX.3 embeds no guidance; the sampler fills this slot with a flow map's target time

    def sample(
        self, model_fn: Callable[..., Tensor], latents: Tensor, sigmas: Tensor, timesteps: Tensor, **kw: Any
    ) -> Tensor:
        return flux3_denoise(
            model_fn, latents, sigmas, timesteps, flow_map=self.is_flow_map,
            negative_model_fn=kw["negative_model_fn"], guidance_scale=kw["true_cfg_scale"],
            reference_tokens=kw["reference_tokens"], callback=kw["callback"], after_step=kw["after_step"],
        )  # fmt: skip

    def fixed_conditioning(
        self, txt: Tensor, cond: Tensor | None, ids: tuple[Tensor, Tensor], pe: Any
    ) -> tuple[Any, Tensor | None]:
        """The base model's text and reference streams through their per-mode blocks, once per generation and
        CFG branch (they see t = 0 at every step); a flow map's embed each step's target time, so it keeps them."""
        if self.is_flow_map:
            return txt, cond
        tables: Flux3RoPE = pe[txt.shape[1]]
        img_ids, txt_ids = ids
        ref_ids = None
        if cond is not None:
            img_ids, ref_ids = _split_ids(img_ids, img_ids.shape[0] - cond.shape[1])
        fixed = self.transformer.fixed_streams(txt, txt_ids, img_ids, ref=cond, ref_ids=ref_ids, pe=tables)
        return fixed, None

    def velocity(
        self, x: Tensor, t: Tensor, g: Tensor | None, txt: Tensor | Flux3Fixed, vec: Tensor | None,
        mods: Tensor | None, ids: tuple[Tensor, Tensor], pe: Any,
    ) -> Tensor:  # fmt: skip
        """The velocity from the embeddings `txt`, or from a base model's `Flux3Fixed` streams (which hold the
        references too)."""
        img_ids, txt_ids = ids  # the tables already hold the positions
        if isinstance(txt, Flux3Fixed):
            tables: Flux3RoPE = pe[txt.txt.shape[1]]
            img_ids, ref_ids = _split_ids(img_ids, x.shape[1])
            return self.transformer(
                x.to(self.dtype), img_ids, None, txt_ids, t, ref_ids=ref_ids, pe=tables, fixed=txt
            )
        tables = pe[txt.shape[1]]
        # latents.to(transformer.dtype); g: the flow map's target time (None for the base model)
        return self.transformer(x.to(self.dtype), img_ids, txt, txt_ids, t, target_timesteps=g, pe=tables)

    def conditioned_velocity(
        self, x: Tensor, cond: Tensor, t: Tensor, g: Tensor | None, txt: Tensor, vec: Tensor | None,
        mods: Tensor | None, ids: tuple[Tensor, Tensor], pe: Any,
    ) -> Tensor:  # fmt: skip
        """The velocity with the reference tokens `cond` (B, L_ref, 128) as the transformer's `image_cond` stream."""
        tables: Flux3RoPE = pe[txt.shape[1]]
        img_ids, ref_ids = _split_ids(ids[0], x.shape[1])
        return self.transformer(
            x.to(self.dtype),
            img_ids,
            txt,
            ids[1],
            t,
            ref=cond,
            ref_ids=ref_ids,
            target_timesteps=g,
            pe=tables,
        )

    def record_inputs(self, call: Call) -> dict[str, Any]:
        """`reference_images`: per image its file (or None), size and fingerprint, so a replay can tell a changed
        one; `reference_crop`: the box the output was cropped back to (a single reference, no size given)."""
        upsampling = flux3_upsample.record(self, call)
        image = call.inputs["image"]
        if image is None:
            return upsampling
        given = [image] if isinstance(image, Image.Image) else list(image)
        crop = call.prepared.get("crop")
        return {
            **upsampling,
            "reference_images": [image_record(im) for im in given],
            **({} if crop is None else {"reference_crop": list(crop)}),
        }

    def decoder_input(self, latents: Tensor, start: Start) -> Tensor:
        """Unpack, BatchNorm-denormalise and unpatchify in the latents' dtype: (B, 32, h, w)."""
        vae = self.vae
        mean, std = latent_bn_stats(vae.bn.running_mean, vae.bn.running_var, vae.config.batch_norm_eps)
        h, w = start.grid
        return unpatchify(bn_denormalize(flux2_unpack(latents, h, w), mean, std))

    def _new_graph(self, fn: Callable[..., Tensor]) -> GraphedDenoiser:
        return GraphedDenoiser(fn)


def _split_ids(ids: Tensor, n_img: int) -> tuple[Tensor, Tensor | None]:
    """(the generated image's ids, the references' or None) from `Flux3Start.img_ids`."""
    return ids[:n_img], (ids[n_img:] if ids.shape[0] > n_img else None)
