"""The pipeline core: one order of work for every FLUX family and variant.

check → encode → latents → schedule → denoise → decode → provenance. The core owns what every family
shares: the call record (`Call`, the arguments written once), the tier (resolved once per call), the
RoPE-table and CUDA-graph caches, true classifier-free guidance, the NaN watch, out-of-memory handling,
output types and the provenance. A family or variant is a `Recipe` subclass that fills in the few
steps that differ (`check`, `encode`, `prepare`, `velocity`, `decoder_input`, `record_inputs`):
`Pipeline` (FLUX.1 and its variants), `Flux2Pipe` (FLUX.2 [dev] / [klein]) and `Flux3Pipe` (FLUX.3 Image
Klein, which also fills in `rope_tables` and `sample`).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor

from flux_runtime.kernels import fused_ops_report, reset_fused_ops_report, warmup
from flux_runtime.kernels.attention_backends import attention_preference, reset_attention_record
from flux_runtime.pipeline import loras as fused_loras
from flux_runtime.pipeline import parallel as par
from flux_runtime.pipeline.cached_graphs import SplitGraphs
from flux_runtime.pipeline.checks import StepWatch, check_finite
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.graphs import GraphedDenoiser, attention_used, kernels_used
from flux_runtime.pipeline.memory import VAE_TILE, Plan, gib
from flux_runtime.pipeline.placement import check_free_memory
from flux_runtime.pipeline.provenance import provenance
from flux_runtime.pipeline.state import Call, Conditioning, PipelineOutput, Start, WithExtra
from flux_runtime.pipeline.step_caching import CacheRun, check_policy
from flux_runtime.pipeline.tiers import (
    BATCHED_MODULATION,
    FAST_FP8_ACCUMULATION,
    FP8_ATTENTION,
    FUSED_DECODE,
    RunTier,
    Tier,
    record_approximations,
    resolve_tier,
)
from flux_runtime.sampling import ScheduleConfig, denoise, get_schedule, to_pil_images, to_uint8_images

if TYPE_CHECKING:
    from flux_runtime.pipeline.loras import LoadedLora

log = logging.getLogger(__name__)

RoPE = tuple[Tensor, Tensor]
PROMPT_CACHE = 8  # encoded prompts kept per pipeline


class Recipe:
    """The shared machinery of a FLUX pipeline; subclasses supply the family's steps.

    Subclasses set `transformer`, `vae`, `text_encoder`, `schedule`, `model_name`, `weights_id`, `quality`,
    `cuda_graphs`, `offload_text_encoders` through `_setup` and implement the hooks below.
    """

    transformer: Any
    vae: Any
    text_encoder: Any
    schedule: ScheduleConfig
    oom_hint = ""  # extra advice in the out-of-memory message
    parallel: Any = None  # this process's `flux_runtime.parallel.World` in a parallel run (`parallel.attach`)
    hub_revision: tuple[str, str] | None = None  # (repo, commit) of a transformer read from the Hub's cache
    # the step-cache policy a call uses when it passes no `cache=` (`flux_runtime.sampling.step_cache`)
    cache: Any = None
    # a vision encoder that takes turns with the text encoders under a memory plan (the IP-Adapter's CLIP)
    image_encoder: Any = None

    def _setup(
        self,
        transformer: Any,
        vae: Any,
        text_encoder: Any,
        *,
        schedule: ScheduleConfig,
        model_name: str,
        weights_id: str,
        quality: Tier,
        cuda_graphs: bool,
        offload_text_encoders: bool,
    ) -> None:
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
        self._rope: dict[tuple, tuple[Tensor, Tensor, RoPE]] = {}
        # where the weights live between and during stages (`set_memory`); None: all on the device
        self.placement: Any = None
        self.memory_plan = Plan("resident", None)
        self.fp8_text = False
        self._prompts: dict[tuple, Any] = {}  # encoded prompts, newest last (`cached_encode`)
        if offload_text_encoders:
            self.set_memory(None, offload_text_encoders=True)

    @property
    def device(self) -> torch.device:
        if self.placement is not None:
            return self.placement.device
        return self.transformer.img_in.weight.device

    # ------------------------------------------------------------------ memory
    def set_memory(
        self, memory: str | int | None = "auto", *, offload_text_encoders: bool = False,
        device: torch.device | None = None,
    ) -> Plan:  # fmt: skip
        """Choose and apply a memory plan: `memory` is "auto" (the GPU's free memory), a size ("24GB",
        "512MB", bytes) or None (no budget: everything on the device). `offload_text_encoders` starts the
        search at the `offload-text` plan. Weights move, bits do not change. Returns the plan (also in
        `memory_plan` and each output's provenance)."""
        from flux_runtime.pipeline import placement

        return placement.apply(self, memory, offload_text_encoders, device or self.device)

    @contextmanager
    def using(self, model: str, *, enter: bool = True) -> Iterator[None]:
        """Run a stage of `model` ("text" or "dit") with its weights on the device as the plan says
        (`enter=False`: hold the text encoders across several encodes, see `Placement.using`)."""
        with self.placement.using(model, enter=enter) if self.placement is not None else nullcontext():
            yield

    def cached_encode(self, key: tuple, encode: Callable[[], Any]) -> Any:
        """`encode()` (under `using("text")`), or its earlier result for the same prompt settings `key`.

        Prompt embeddings are a pure function of the prompt, the settings and the encoder weights, so a
        repeated prompt skips the text encoder (and, on a tight budget, the weights moving for it)."""
        if key in self._prompts:
            self._prompts[key] = self._prompts.pop(key)  # most recently used last
            return self._prompts[key]
        with self.using("text"):
            out = encode()
        self._prompts[key] = out
        while len(self._prompts) > PROMPT_CACHE:
            self._prompts.pop(next(iter(self._prompts)))
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.img_in.weight.dtype

    # ------------------------------------------------------------------ the hooks a recipe fills in
    def check(self, call: Call) -> None:
        """Validate `call` and fill in `steps`, `guidance_used`, `true_cfg_scale`, `prepared` (no model runs)."""
        raise NotImplementedError

    def encode(self, call: Call) -> Conditioning:
        raise NotImplementedError

    def prepare(self, call: Call, cond: Conditioning) -> Start:
        """Noise (or noised image latents), ids and the schedule; may run the VAE encoder."""
        raise NotImplementedError

    def velocity(
        self, x: Tensor, t: Tensor, g: Tensor | None, txt: Tensor, vec: Tensor | None, mods: Tensor | None,
        ids: tuple[Tensor, Tensor], pe: RoPE,
    ) -> Tensor:  # fmt: skip
        raise NotImplementedError

    def conditioned_velocity(
        self, x: Tensor, cond: Tensor, t: Tensor, g: Tensor | None, txt: Tensor, vec: Tensor | None,
        mods: Tensor | None, ids: tuple[Tensor, Tensor], pe: RoPE,
    ) -> Tensor:  # fmt: skip
        """`velocity` with `Start.channel_cond`: concatenated on the channels (Fill, Depth/Canny); FLUX.3 reads it
        as its own reference-token stream instead."""
        return self.velocity(torch.cat([x, cond], dim=2), t, g, txt, vec, mods, ids, pe)

    def controlled_velocity(
        self, x: Tensor, t: Tensor, g: Tensor | None, txt: Tensor, vec: Tensor | None, mods: Tensor | None,
        ids: tuple[Tensor, Tensor], pe: RoPE, control: Any, active: tuple,
    ) -> Tensor:  # fmt: skip
        """`velocity` with ControlNets (`Start.control`): `control` the call's ControlNet tensors, `active` which
        of them run at this step and at what scale (only recipes that take ControlNets implement it)."""
        raise NotImplementedError

    def fixed_conditioning(
        self, txt: Tensor, cond: Tensor | None, ids: tuple[Tensor, Tensor], pe: Any
    ) -> tuple[Any, Tensor | None]:
        """What every step of one branch reads as its text (`velocity`'s `txt`) and its `conditioned_velocity`
        input, computed once per generation: by default the embeddings and `Start.channel_cond` as they are.
        A model whose text and reference streams do not depend on the step (FLUX.3's base model) returns them
        already run through their own blocks (a tuple of tensors; `cond` None when folded into it), which is
        lossless: the same ops on the same inputs, once instead of once per step."""
        return txt, cond

    def fixed_extra(self, extra: Any) -> Any:
        """A branch's extra step input (`Conditioning.extra`) as every step reads it, computed once per
        generation on the transformer's device (FLUX.1: the IP-Adapter's image tokens)."""
        return extra

    def guidance_tensor(self, call: Call, batch: int) -> Tensor | None:
        """What the transformer's guidance embedder is fed (B,) fp32, or None for a model without one."""
        raise NotImplementedError

    def planned_tokens(self, call: Call | None) -> tuple[int, int]:
        """(text tokens, conditioning tokens in the sequence beside the image's) that the memory planner
        budgets a checked `call` with (None: a default call): by default the text window's cap and none."""
        return (self.default_max_sequence_length if call is None else call.max_sequence_length), 0

    def decoder_input(self, latents: Tensor, start: Start) -> Tensor:
        """The VAE decoder's input from the final packed latents."""
        raise NotImplementedError

    def latent_output(self, latents: Tensor, start: Start) -> Tensor:
        """What `output_type="latent"` returns in `images` (diffusers' choice for this pipeline)."""
        return latents

    def record_inputs(self, call: Call) -> dict[str, Any]:
        """Provenance fields beyond the common ones (input images, strength, negative prompt)."""
        return {}

    def modulation_table(
        self, call: Call, start: Start, vec: Tensor | None, g: Tensor | None
    ) -> Tensor | None:
        """High tier: every step's adaLN projections in one GEMM, (steps, B, total); None where unused."""
        return None

    def load_ip_adapter(self, path: str | Path, scale: float | list[float] = 1.0, **kw: Any) -> Any:
        """IP-Adapters are FLUX.1's (`Flux1Pipe.load_ip_adapter`); other families refuse them in one line."""
        raise FluxError(f"IP-Adapters are for FLUX.1 models; {self.model_name} is not one")

    def encode_ip_adapter_image(self, image: Any) -> Any:
        """An IP-Adapter's image embedding (`Flux1Pipe.encode_ip_adapter_image`): other families have no adapter
        to encode for and refuse in one line, as `load_ip_adapter`."""
        raise FluxError(f"IP-Adapters are for FLUX.1 models; {self.model_name} is not one")

    # ------------------------------------------------------------------ LoRAs
    def load_lora(self, path: str | Path, scale: float = 1.0) -> LoadedLora:
        """Fuse a LoRA into the weights (as diffusers' `load_lora_weights` + `fuse_lora(lora_scale=scale)`).

        `path`: a .safetensors file, a folder holding one, or a Hugging Face id in the local cache; the
        layout is read from its keys. Repeatable (one scale each); `unload_loras()` takes them all out.
        """
        return fused_loras.load_lora(self, path, scale)

    def unload_loras(self) -> None:
        """Restore the base weights of every layer the LoRAs touched, bit for bit."""
        fused_loras.unload_loras(self)

    @property
    def loras(self) -> list[LoadedLora]:
        """The fused LoRAs, in the order they were loaded."""
        return list(fused_loras.holder(self).loaded)

    def rope_tables(self, start: Start) -> Any:
        """The RoPE tables of this token layout, built once and handed to every `velocity` call as `pe`."""
        return self.transformer.rope(start.txt_ids, start.img_ids)

    def sample(
        self, model_fn: Callable[..., Tensor], latents: Tensor, sigmas: Tensor, timesteps: Tensor, **kw: Any
    ) -> Tensor:
        """The sampling loop: FLUX.1's and FLUX.2's Euler `denoise` (a family with other roundings overrides it)."""
        return denoise(model_fn, latents, sigmas, timesteps, **kw)

    # ------------------------------------------------------------------ the one order of work
    def _run(self, call: Call) -> PipelineOutput:
        """check → encode → latents → schedule → denoise → decode → provenance, one FluxError on OOM."""
        self.check(call)
        if call.cache is not None:
            check_policy(call.cache, self.transformer, self.model_name)
        if call.seed is None and call.generator is None:
            call.seed = 0
        tier = resolve_tier(call.quality, self.device, self.dtype)
        warmup.finish()  # the load's side thread (Triton's key) done before the first kernel needs it
        if self.placement is not None:
            self.placement.check_call(self, call)
        else:
            check_free_memory(self, call)
        try:
            latents, images, graphs, kernels, decode_kernels = self._generate(call, tier)
        except torch.cuda.OutOfMemoryError:
            oom = True  # handled below: out here the failed frames, and the tensors they held, are gone
        else:
            oom = False
        if oom:
            self._out_of_memory(call)
        info = {
            **provenance(
                prompt=call.prompt, seed=call.seed, height=call.height, width=call.width, steps=call.steps,
                guidance=call.guidance_used, max_sequence_length=call.max_sequence_length, tier=tier.quality,
                cuda_graphs=graphs, model=self.model_name, weights=self.weights_id, dtype=self.dtype,
                device=self.device, precision=getattr(self.transformer, "precision", "bf16"),
                fp8_at_load=getattr(self.transformer, "quantized_at_load", False),
            ),
            "memory_plan": self.memory_plan.describe(),
            "approximations": record_approximations(
                tier, call.prepared.get("approximations", set()), self.model_name,
                getattr(self.transformer, "precision", "bf16"),
            ),
            "fp8_text": self.fp8_text,
            **self._hub_record(),
            **self.record_inputs(call),
            **fused_loras.provenance_fields(self),  # each fused LoRA: file, sha256, scale
            **({"parallel": call.prepared["parallel"]} if "parallel" in call.prepared else {}),
            # step caching: the policy and the steps whose transformer ran in full ("off": every step did)
            "cache": call.prepared["cache"].record() if "cache" in call.prepared else "off",
            # which kernels really ran: "off" (reference ops), "lossless", or "<tier>, partly reference"
            "kernels": kernels,
            # the attention backend that ran and why ("sdpa" in lossless; "fa3-fp8" where high could run it)
            **call.prepared.get("attention", {}),
            # the decode's: "off" (the reference ops), or the high tier's fused GroupNorm + SiLU
            **({} if decode_kernels is None else {"decode_kernels": decode_kernels}),
        }  # fmt: skip
        return PipelineOutput(images, latents, info)

    def _hub_record(self) -> dict[str, Any]:
        """The provenance's `hub` field: the repo and commit the transformer was read from (none for a path
        outside the Hugging Face cache or a built-in model)."""
        if self.hub_revision is None:
            return {}
        repo, revision = self.hub_revision
        return {"hub": {"repo": repo, "revision": revision}}

    def _out_of_memory(self, call: Call) -> NoReturn:
        """After an out-of-memory: nothing left on the device that the plan does not keep there, then one
        FluxError naming the budget, the plan and what to try."""
        if self.placement is not None:
            self.placement.reset()
        self._graphed.clear()
        gc.collect()  # activations held in reference cycles through the failed frames
        torch.cuda.empty_cache()
        plan = self.memory_plan
        budget = "no memory budget" if plan.budget is None else f"a {gib(plan.budget)} budget"
        raise FluxError(
            f"out of GPU memory generating {call.num_images_per_prompt} image(s) of {call.width}x{call.height} "
            f"under the {plan.name} plan with {budget}: try a smaller size or batch, {self.oom_hint}"
            "a smaller memory budget than the GPU's (memory='20GB' / --memory 20GB) or --fp8"
        )

    def _generate(self, call: Call, tier: RunTier) -> tuple[Tensor, Any, bool, str, str | None]:
        """(packed latents, images as `output_type` asks, CUDA graphs used, kernels that ran, and the
        decode's kernels (None: no decode))."""
        call.report("encode", 0, 1)
        world = self.parallel
        if world is None:
            cond = self.encode(call)
        else:  # rank 0 holds the text encoders
            cond = par.share_conditioning(world, self.encode(call) if world.is_main else None)
        start = self.prepare(call, cond)
        plan = None
        if world is not None:  # all start from rank 0's latents; with CFG the halves split the branches
            par.share_start(world, start)
            plan = world.plan(cfg=cond.negative_txt is not None)
            call.prepared["parallel"] = world.record(plan)
        call.report("encode", 1, 1)
        with self.using("dit"):
            return self._denoise_decode(call, tier, cond, start, world, plan)

    def _denoise_decode(
        self, call: Call, tier: RunTier, cond: Conditioning, start: Start, world: Any, plan: Any
    ) -> tuple[Tensor, Any, bool, str, str | None]:
        """`_generate` after the encode: `world` / `plan` the parallel run's group and split (None: one process)."""
        batch, steps = cond.batch, call.steps
        g = self.guidance_tensor(call, batch)

        # RoPE tables once per image size and token layout, shared by every block and step
        if start.rope_key not in self._rope:
            self._rope[start.rope_key] = (start.img_ids, start.txt_ids, self.rope_tables(start))
        img_ids, txt_ids, pe = self._rope[start.rope_key]
        ids = (img_ids, txt_ids)
        channel_cond = start.channel_cond

        control = start.control  # ControlNets: their inputs, and which run at each step

        def velocity(
            x: Tensor, t: Tensor, gd: Tensor | None, txt: Any, vec: Tensor | None, mods: Tensor | None,
            cc: Tensor | None, ctl: Any = None, active: tuple = (),
        ) -> Tensor:  # fmt: skip
            with tier.mounted():
                if (
                    active
                ):  # ControlNets run this step (their tensors in `ctl`, which and how strong in `active`)
                    return self.controlled_velocity(x, t, gd, txt, vec, mods, ids, pe, ctl, active)
                if cc is not None:  # Fill / Control latents, FLUX.3 references
                    return self.conditioned_velocity(x, cc, t, gd, txt, vec, mods, ids, pe)
                return self.velocity(x, t, gd, txt, vec, mods, ids, pe)

        # step caching decides on the host, step by step: with CUDA graphs, each step replays the probe's graph,
        # then the rest's or the reuse's (`SplitGraphs`)
        cache_run = (
            None
            if call.cache is None
            else CacheRun(call.cache, self.transformer, len(start.timesteps), par.sequence_means(world))
        )
        if cache_run is not None:
            call.prepared["cache"] = cache_run
        use_graphs = self._graphs_enabled()
        graph_keys: dict[str, tuple] = {}  # each branch's graph of the last step (whose kernels are reported)
        # what `high` approximated in this call (see `record_approximations`)
        approximations: set[str] = set()

        def branch(
            name: str, txt: Tensor, vec: Tensor | None, extra: Any
        ) -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
            # the batched table reads every block's weights at once: not while the blocks stream
            batched = tier.batched_modulation and not self.memory_plan.streams_dit
            table = self.modulation_table(call, start, vec, g) if batched else None
            if table is not None:
                approximations.add(BATCHED_MODULATION)
            step = iter(range(steps))
            with tier.mounted():  # the branch's step-invariant streams, once per generation
                text, cc = self.fixed_conditioning(txt, channel_cond, ids, pe)
                if extra is not None:  # a fixed input of the step too, so a graph replays this branch's
                    text = WithExtra(text, self.fixed_extra(extra))
            ctl = None if control is None else control.tensors

            def step_inputs() -> tuple[Tensor | None, tuple]:
                """This step's row of the modulation table and its active ControlNets."""
                i = next(step)
                return (None if table is None else table[i]), (() if control is None else control.active(i))

            if not use_graphs:

                def eager(x: Tensor, t: Tensor, gd: Tensor | None) -> Tensor:
                    m, active = step_inputs()
                    return velocity(x, t, gd, text, vec, m, cc, ctl, active)

                return eager if cache_run is None else cache_run.wrap(name, eager)

            # one graph per branch (a replay overwrites its static output, and CFG needs both at once) and
            # set of active ControlNets with their scales (a graph holds the Python numbers it was captured with) and
            # attention backend setting (and the backend it chose)
            # and step cache (a cached branch's graphs are split at the probe: `SplitGraphs`)
            def graphed(x: Tensor, t: Tensor, gd: Tensor | None) -> Tensor:
                m, active = step_inputs()
                cached = cache_run is not None
                key = (start.rope_key, tier, name, active, attention_preference(), cached)
                graph_keys[name] = key
                if key not in self._graphed:
                    fn = partial(velocity, active=active)
                    self._graphed[key] = self._new_split_graph(fn) if cached else self._new_graph(fn)
                inputs = (x, t, gd, text, vec, m, cc, ctl if active else None)
                if cache_run is None:
                    return self._graphed[key](*inputs)
                return self._graphed[key](cache_run.cache(name), *inputs)

            return graphed

        call.report("denoise", 0, steps)
        reset_fused_ops_report()
        reset_attention_record()
        watch = StepWatch(steps, self.device)

        def after_step(i: int, t: Tensor, x: Tensor) -> None:
            watch(i, x)
            call.report("denoise", i + 1, steps)

        def uncond() -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
            assert cond.negative_txt is not None
            return branch("uncond", cond.negative_txt, cond.negative_vec, cond.negative_extra)

        # in a parallel run with CFG, each half of the ranks builds and runs one branch
        model_fn, negative = par.branches(
            world, plan, lambda: branch("cond", cond.txt, cond.vec, cond.extra),
            None if cond.negative_txt is None else uncond,
        )  # fmt: skip
        with par.running(world, plan):
            latents = self.sample(
                model_fn,
                start.latents,
                start.sigmas,
                start.timesteps,
                guidance=g,
                negative_model_fn=negative,
                true_cfg_scale=call.true_cfg_scale,
                reference_tokens=start.reference_tokens,
                callback=after_step,
                after_step=start.blend,
            )
        if cache_run is not None:
            par.share_cache_records(world, plan, cache_run)
        watch.raise_if_bad()  # a NaN step is an error naming the step, never a picture
        kernels = kernels_used(self._graphed.get(graph_keys.get("cond", ())) if use_graphs else None)
        attention = attention_used(self._graphed.get(graph_keys.get("cond", ())) if use_graphs else None)
        call.prepared["attention"] = attention
        if "fa3-fp8" in attention["attention"]:
            approximations.add(FP8_ATTENTION)
        # FP8 GEMMs accumulate fast in `high` (a bf16 / fp16 / fp32 or GGUF model runs none)
        if tier.kernels == "high" and getattr(self.transformer, "precision", "bf16").startswith("fp8"):
            approximations.add(FAST_FP8_ACCUMULATION)
        call.prepared["approximations"] = approximations

        if world is not None and not world.is_main and call.output_type != "latent":
            return latents, None, use_graphs, kernels, None  # rank 0 decodes
        if call.output_type == "latent":
            return latents, self.latent_output(latents, start), use_graphs, kernels, None
        z = self.decoder_input(latents, start)
        call.report("decode", 0, 1)
        decoded, decode_kernels, fused_decode = self._decode(z, tier)
        if fused_decode:
            approximations.add(FUSED_DECODE)
        if start.crop is not None:  # FLUX.3: back to a single reference's box on its canvas
            left, top, right, bottom = start.crop
            decoded = decoded[..., top:bottom, left:right]
        check_finite(decoded, "decoded images")
        call.report("decode", 1, 1)
        if call.output_type == "pil":
            images: Any = to_pil_images(decoded)
        elif call.output_type == "np":
            images = to_uint8_images(decoded)
        else:
            images = (decoded * 0.5 + 0.5).clamp(0, 1)
        return latents, images, use_graphs, kernels, decode_kernels

    def _decode(self, z: Tensor, tier: RunTier) -> tuple[Tensor, str, bool]:
        """The autoencoder's decode, what it ran (the reference ops, "off": diffusers' bits, or in the high
        tier its fused GroupNorm + SiLU kernels: "high", or "high, partly reference" if a guard refused) and
        whether any fused kernel ran.

        The high decode runs channels-last: a channels-last input makes every convolution take cuDNN's NHWC
        kernels without converting each activation to NHWC and back, and the fused GroupNorm keeps the
        layout (aten's GroupNorm is slow on it, which is why the lossless decode stays NCHW).
        """
        tile = (
            self.vae_tile if self.vae_tile is not None else VAE_TILE if self.memory_plan.vae_tiled else None
        )
        if tier.kernels != "high":
            return self.vae.decode(z, tile=tile), "off", False
        reset_fused_ops_report()
        with tier.mounted():
            decoded = self.vae.decode(z.contiguous(memory_format=torch.channels_last), tile=tile)
        report = fused_ops_report()
        return decoded, report.tier_used, bool(report.fused_calls)

    def _schedule(self, steps: int, image_seq_len: int, strength: float = 1.0) -> tuple[Tensor, Tensor]:
        """(sigmas (N' + 1,), timesteps (N',)) fp32 on the device: the full schedule, or with `strength` < 1
        its tail from `first_step(steps, strength)`, as diffusers' img2img `get_timesteps` cuts it."""
        sched = get_schedule(steps, image_seq_len, config=self.schedule, device=self.device)
        begin = first_step(steps, strength)
        return sched.sigmas[begin:], sched.timesteps[begin:]

    def _graphs_enabled(self) -> bool:
        """CUDA graphs run where they can: asked for, the model on a CUDA device, its blocks not streaming
        (a ring's copies and waits are issued from Python between blocks), and one process (the collectives
        of a parallel run are not captured)."""
        return (
            self.cuda_graphs
            and self.device.type == "cuda"
            and not self.memory_plan.streams_dit
            and self.parallel is None
        )

    def _new_graph(self, fn: Callable[..., Tensor]) -> GraphedDenoiser:
        return GraphedDenoiser(fn)

    def _new_split_graph(self, fn: Callable[..., Tensor]) -> SplitGraphs:
        return SplitGraphs(fn, self.transformer)


def settle(
    pipe: Recipe,
    src: Any,
    *,
    fp8_text: bool,
    budget: int | None,
    offload_text_encoders: bool,
    device: torch.device,
    parallel: Any = None,
    sharded: Any = None,
) -> Recipe:
    """The end of every family's load: record the text encoders' precision and the hub revision the sources
    came from, place the models by the memory plan for `budget`, and, on a rank of a parallel run, give the
    pipeline its sequence-parallel transformer `sharded`."""
    from flux_runtime.pipeline import placement

    pipe.fp8_text = fp8_text
    pipe.hub_revision = src.hub_revision
    placement.place(pipe, budget, offload_text_encoders, device)
    if parallel is not None:
        assert sharded is not None
        par.attach(pipe, parallel, sharded)
    return pipe


def first_step(steps: int, strength: float) -> int:
    """The step img2img starts at: `int(steps - min(steps * strength, steps))` (diffusers' `get_timesteps`)."""
    return int(max(steps - min(steps * strength, steps), 0))
