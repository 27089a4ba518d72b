"""A pipeline's models placed by its memory plan: sizes measured, the plan chosen, stages run in it.

`apply` measures the loaded models (bytes outside their layers and per layer), estimates the activations
of a default call, asks `memory.plan_memory` for the plan and puts each model in its mode
(`streaming.ModelPlacement`). `Placement.using(model)` brackets each stage; `check_call` refuses, before
any model runs, a call whose activations the plan has no room for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flux_runtime.pipeline.dequant_memory import dequant_bytes
from flux_runtime.pipeline.memory import (
    UNLIMITED,
    VAE_TILE,
    WORKSPACE,
    Footprint,
    MemoryBudgetError,
    Plan,
    budget_needed,
    decode_activations,
    denoise_activations,
    encode_activations,
    gib,
    plan_memory,
    resolve_budget,
    usable,
)
from flux_runtime.pipeline.streaming import ModelPlacement, part_of

log = logging.getLogger(__name__)

DEFAULT_GUIDANCE = 4.0  # FLUX.2's default: whether a default call runs CFG


class Placement:
    """The text encoders and the transformer under one plan, moved stage by stage (the VAE stays)."""

    def __init__(self, device: torch.device, models: dict[str, ModelPlacement], graphs: dict) -> None:
        self.device, self.models, self.graphs = device, models, graphs
        self.plan = Plan("resident", None)
        self.weights_at_denoise = 0  # bytes on the device while the transformer runs
        self._depth: dict[str, int] = {}

    @contextmanager
    def using(self, name: str, *, enter: bool = True) -> Iterator[None]:
        """`name`'s weights on the device for one stage; with `together=False` whatever else is on the device
        leaves first. The text encoders leave when the outermost `using("text")` ends, so `enter=False`
        around several encodes (positive and negative prompt) holds them in between without bringing them
        in for prompts that the cache answers."""
        model = self.models[name]
        depth = self._depth.get(name, 0)
        if enter and not model.on_device:
            if name == "text" and self.plan.together and self.plan.budget is not None and self.graphs:
                # under a budget the text encoder never comes in beside captured graphs' memory pools (the
                # size of the denoising activations, and reserved beyond what they hold): they go first and
                # the next denoise captures again
                self.graphs.clear()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            if not self.plan.together:
                for other_name, other in self.models.items():
                    if other_name != name:
                        if other_name == "dit" and other.on_device and other.mode != "resident":
                            # graphs hold the weights' addresses and a memory pool: both go with them
                            self.graphs.clear()
                        other.leave()
            model.enter()
            if name == "dit":
                self.graphs.clear()  # captured graphs hold the old weight addresses
        self._depth[name] = depth + 1
        try:
            yield
        finally:
            self._depth[name] = depth
            if depth == 0 and name == "text":
                model.leave()

    def reset(self) -> None:
        """After an error: every model that is not resident off the device, nothing in flight."""
        for model in self.models.values():
            model.leave()

    def check_call(self, pipe: Any, call: Any) -> None:
        """A FluxError before any model runs when this call's activations cannot fit the plan's room."""
        plan = self.plan
        if plan.budget is None:
            return
        cfg = call.true_cfg_scale > 1
        batch = _batch(call)
        text_tokens, extra_tokens = pipe.planned_tokens(call)
        act = _denoise(pipe, call.height, call.width, text_tokens, batch, cfg, extra_tokens, self.device)
        dec = _decode(pipe, call.height, call.width, batch, tiled=plan.vae_tiled or pipe.vae_tile is not None)
        graphs = pipe._graphs_enabled()  # a captured pool stays beside the decode
        need = self.weights_at_denoise + max(act, dec + (act if graphs else 0))
        workspace = _workspace(self.device)
        if need > usable(plan.budget, workspace):
            raise MemoryBudgetError(
                f"{call.width}x{call.height} x {batch} image(s) needs about {gib(budget_needed(need, workspace))} under "
                f"the {plan.name} plan, more than the {gib(plan.budget)} budget: make fewer or smaller images, or "
                "give a larger budget"
            )


def check_free_memory(pipe: Any, call: Any) -> None:
    """A FluxError before any model runs when a CPU call (made without a memory plan) needs more working
    memory at once than the machine has free: there the kernel's OOM killer would end the process part way,
    with no error at all. (On a GPU an out-of-memory is caught and named, `Recipe._out_of_memory`.)

    The planner's estimates are generous bounds (about twice the measured peaks, see `memory`), so the call
    is refused only when half of the largest stage estimate (encode, denoise or decode) exceeds what is free:
    a call that would surely run out of memory, never one that would fit."""
    free = free_memory(pipe.device)
    if free is None:
        return
    cfg = call.true_cfg_scale > 1
    batch = _batch(call)
    text_tokens, extra_tokens = pipe.planned_tokens(call)
    # a parallel run's other ranks hold no text encoder: rank 0 encodes and shares the embeddings
    text_roots = text_parts(pipe)[0]
    stages = (
        encode_bytes(text_roots, text_tokens, 2 if cfg else 1),
        _denoise(pipe, call.height, call.width, text_tokens, batch, cfg, extra_tokens),
        _decode(pipe, call.height, call.width, batch, tiled=pipe.vae_tile is not None),
    )
    need = max(stages) // 2
    if need > free:
        raise MemoryBudgetError(
            f"{call.width}x{call.height} x {batch} image(s) in one call need at least {gib(need)} of working "
            f"memory, more than the {gib(free)} free on {pipe.device}: make fewer images per call "
            "(num_images_per_prompt / --num-images) or smaller ones"
        )


def free_memory(device: torch.device) -> int | None:
    """Bytes this process can still allocate on a CPU `device` (Linux's `MemAvailable`); None on any other
    device or where it cannot be read."""
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _batch(call: Any) -> int:
    prompts = 1 if call.prompt is None or isinstance(call.prompt, str) else len(call.prompt)
    if call.prompt_embeds is not None:
        prompts = call.prompt_embeds.shape[0]
    return prompts * call.num_images_per_prompt


def _workspace(device: torch.device) -> int:
    return WORKSPACE if device.type == "cuda" else 0


def denoise_bytes(
    config: Any, dtype: torch.dtype, height: int, width: int, max_len: int, batch: int, cfg: bool,
    extra_tokens: int = 0,
) -> int:  # fmt: skip
    """The planner's activation estimate for the transformer (`config`, a `DiTConfig`) at this size, with
    `extra_tokens` conditioning tokens in the sequence beside the image's (FLUX.3's references)."""
    tokens = (height // 16) * (width // 16) + extra_tokens
    act = denoise_activations(
        tokens, max_len, config.hidden_size, config.mlp_hidden_dim, config.family in ("flux2", "flux3"), batch,
        torch.empty((), dtype=dtype).element_size(),
    )  # fmt: skip
    return 2 * act if cfg else act  # one CUDA-graph pool per branch


def decode_bytes(config: Any, dtype: torch.dtype, height: int, width: int, batch: int, *, tiled: bool) -> int:
    """The planner's activation estimate for the VAE decode (`config`, a VAE config) at this size."""
    tile_px = VAE_TILE * config.spatial_factor if tiled else None
    return decode_activations(
        height, width, batch, torch.empty((), dtype=dtype).element_size(), config.ch, tile_px
    )


def _denoise(
    pipe: Any, height: int, width: int, max_len: int, batch: int, cfg: bool, extra_tokens: int = 0,
    device: torch.device | None = None,
) -> int:  # fmt: skip
    """`denoise_bytes` for `pipe`'s transformer, plus what dequantizing its largest GGUF projection holds on
    `device` (default: the pipeline's), once per CUDA-graph pool as the activations are counted (0 for a model
    without GGUF layers)."""
    act = denoise_bytes(pipe.transformer.config, pipe.dtype, height, width, max_len, batch, cfg, extra_tokens)
    dequant = dequant_bytes(pipe.transformer, kernel=(device or pipe.device).type == "cuda")
    return act + (2 if cfg else 1) * dequant


def dit_layers(transformer: nn.Module) -> list[nn.Module]:
    """The transformer blocks a plan may stream, in the order every step runs them: FLUX.1/FLUX.2's double
    then single blocks; FLUX.3's image blocks then its joint blocks. FLUX.3's text and reference blocks stay
    with the rest of the model: the base model runs them once per generation and a text-to-image call not
    at all (references), so a ring streaming them would lose its order at every step."""
    if transformer.config.family == "flux3":
        return [*transformer.content_mode_blocks["image"], *transformer.single_blocks]
    return [*transformer.double_blocks, *transformer.single_blocks]


def _decode(pipe: Any, height: int, width: int, batch: int, *, tiled: bool) -> int:
    return decode_bytes(pipe.vae.config, pipe.dtype, height, width, batch, tiled=tiled)


def text_parts(pipe: Any) -> tuple[list[nn.Module], list[nn.Module]]:
    """The text stage's models and repeated layers: the text encoders' (none on a pipeline without them), a
    FLUX.1 Redux's SigLIP and embedder and the IP-Adapter's CLIP vision model, which run in that stage and move
    with the encoders, whole."""
    roots, layers = pipe.text_encoder.parts() if pipe.text_encoder is not None else ([], [])
    redux = getattr(pipe, "redux", None)
    image = getattr(pipe, "image_encoder", None)
    extra = [*(redux.modules() if redux is not None else []), *([image] if image is not None else [])]
    return [*roots, *extra], list(layers)


def replan_text(pipe: Any) -> Plan:
    """After a model joined the text stage of a placed pipeline (`load_redux`): the text stage placed anew
    with it, and the plan made again for the same budget (the text encoders already packed are packed
    again with it, briefly holding their host bytes twice)."""
    device = pipe.placement.device
    old = pipe.placement.models["text"]
    old.leave()
    roots, layers = text_parts(pipe)
    pipe.placement.models["text"] = ModelPlacement("text encoder", roots, layers, device)
    plan = pipe.memory_plan
    return apply_budget(pipe, plan.budget, plan.name == "offload-text" or pipe.offload_text_encoders, device)


def encode_bytes(roots: list[nn.Module], max_len: int, batch: int) -> int:
    """The planner's activation estimate for the text encoders `roots` (transformers models) on `batch`
    prompts of `max_len` tokens."""
    total = 0
    for root in roots:
        config = getattr(root, "config", None)
        if config is None:
            continue
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden = getattr(c, "hidden_size", None) or getattr(c, "d_model", 0)
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "num_layers", 0)
        inter = getattr(c, "intermediate_size", None) or getattr(c, "d_ff", 0)
        total += encode_activations(batch * max_len, hidden, layers, inter, getattr(c, "vocab_size", 0), 4)
    return total


def footprint(pipe: Any, device: torch.device | None = None) -> Footprint:
    """Weights of the loaded models and the activations of a default call (default size, one image, the
    model's default text length; FLUX.2 [klein] base: with CFG), planned for `device` (default: the
    pipeline's)."""
    text_roots, text_layers = text_parts(pipe)
    t = pipe.transformer
    size, (max_len, _) = pipe.default_size, pipe.planned_tokens(None)
    uses_cfg = getattr(pipe, "uses_cfg", None)
    cfg = bool(uses_cfg(DEFAULT_GUIDANCE)) if uses_cfg is not None else False
    return Footprint(
        text=part_of(text_roots, text_layers),
        dit=part_of([t], dit_layers(t)),
        vae=part_of([pipe.vae], []).rest + resident_adapter_bytes(getattr(pipe, "controlnets", ())),
        act_encode=encode_bytes(text_roots, max_len, 2 if cfg else 1),
        act_denoise=_denoise(pipe, size, size, max_len, 1, cfg, device=device)
        + control_residual_bytes(pipe, size, size, 1),
        act_decode=_decode(pipe, size, size, 1, tiled=False),
        act_decode_tiled=_decode(pipe, size, size, 1, tiled=True),
        workspace=_workspace(device or pipe.device),
        graphs=bool(pipe.cuda_graphs) and (device or pipe.device).type == "cuda" and pipe.parallel is None,
    )


def resident_adapter_bytes(nets: Sequence[nn.Module]) -> int:
    """The weights of ControlNets, which stay on the device in every plan (the footprint counts them with the
    autoencoder's)."""
    return sum(part_of([net], []).rest for net in nets)


def control_residual_bytes(pipe: Any, height: int, width: int, batch: int) -> int:
    """What a step with ControlNets holds beside the transformer's activations: their residuals, one image state
    (B, L_img, D) per ControlNet block in the model dtype, twice (a ControlNet's own and the running sum); 0
    without ControlNets."""
    nets = getattr(pipe, "controlnets", ())
    if not nets:
        return 0
    f = pipe.vae.config.spatial_factor
    tokens = (height // (2 * f)) * (width // (2 * f))
    cfg = nets[0].config
    blocks = cfg.depth + cfg.depth_single_blocks
    return 2 * blocks * batch * tokens * cfg.hidden_size * pipe.dtype.itemsize


def replan(pipe: Any) -> None:
    """After the models changed (an adapter joined or left, a LoRA swapped a layer for a larger one): graphs
    dropped (they hold the old modules' addresses) and, under a memory plan, the plan made again with the
    weights as they are now (a plan named outright: the same plan; one chosen for a budget: chosen again)."""
    pipe._graphed.clear()
    if pipe.placement is None:
        return
    device, plan = pipe.placement.device, pipe.memory_plan
    pipe.placement.reset()  # all that moves is off the device: the new placement packs it again from there
    pipe.placement = None
    if plan.budget is None:
        apply_plan(pipe, plan, device)
    else:
        apply_budget(pipe, plan.budget, pipe.offload_text_encoders, device)


def apply(pipe: Any, memory: str | int | None, offload_text_encoders: bool, device: torch.device) -> Plan:
    """Choose `pipe`'s plan for `memory` on `device` and place its models by it (see `Recipe.set_memory`)."""
    budget = budget_for(memory, device, offload_text_encoders)
    return apply_budget(pipe, budget, offload_text_encoders, device)


def apply_budget(pipe: Any, budget: int | None, offload_text_encoders: bool, device: torch.device) -> Plan:
    """`apply` for a budget already resolved to bytes (`budget_for`), which is not checked against the device
    again: loading takes some memory outside the allocator (CUDA modules, library workspaces), so an "auto"
    budget resolved before the load would now read as more than the process can have."""
    fp = footprint(pipe, device)
    plan = plan_memory(fp, budget, force="offload-text" if offload_text_encoders else None)
    apply_plan(pipe, plan, device, fp)
    log.info("%s", plan.describe())
    return plan


def apply_plan(pipe: Any, plan: Plan, device: torch.device, fp: Footprint | None = None) -> None:
    """Place `pipe`'s models by `plan` (any plan: the tests and benchmarks name one outright)."""
    fp = fp or footprint(pipe, device)
    if not plan.layers:
        plan = replace(plan, layers={"text": len(fp.text.layers), "dit": len(fp.dit.layers)})
    if pipe.placement is None:
        text_roots, text_layers = text_parts(pipe)
        t = pipe.transformer
        models = {
            "text": ModelPlacement("text encoder", text_roots, text_layers, device),
            "dit": ModelPlacement("transformer", [t], dit_layers(t), device),
        }
        pipe.placement = Placement(device, models, pipe._graphed)
    placement: Placement = pipe.placement
    placement.plan = plan
    pipe._graphed.clear()
    for name, mode, streamed in (
        ("text", plan.text, plan.streamed_text),
        ("dit", plan.dit, plan.streamed_dit),
    ):
        placement.models[name].set_mode(mode, streamed, plan.slots)
    pipe.vae.to(device)
    placement.weights_at_denoise = _weights_at_denoise(fp, plan)
    pipe.memory_plan = plan


def _weights_at_denoise(fp: Footprint, plan: Plan) -> int:
    """Bytes of weights on the device while the transformer runs under `plan`."""
    dit = fp.dit.total
    if plan.dit == "streamed":
        streamed = [fp.dit.layers[i] for i in plan.streamed_dit]
        dit = dit - sum(streamed) + min(plan.slots, len(streamed)) * max(streamed, default=0)
    text = fp.text.total if plan.text == "resident" else 0
    return dit + fp.vae + text


# ------------------------------------------------------------------------------------------- at load time


def budget_for(memory: str | int | None, device: torch.device, offload_text_encoders: bool) -> int | None:
    """The budget a load plans for, resolved once before anything loads ("auto": free memory now)."""
    budget = resolve_budget(memory, device)
    return UNLIMITED if budget is None and offload_text_encoders else budget


def text_device(
    budget: int | None,
    device: torch.device,
    offload: bool,
    sources: Sequence[str | Path] | None,
    beside: int = 0,
) -> torch.device:
    """Where the text encoders load. Without a budget: the device. With one: the device too when the plan will
    keep them there (no offload asked, and their weights, by the sizes of their files `sources`, fit beside
    what the device holds now and `beside` bytes still to load there (the transformer, when the encoders load
    first), with a fifth of the budget to spare), so they stream straight onto the GPU; otherwise host memory
    (also when their size is not known), and the plan moves them as it says."""
    if budget is None:
        return device
    if offload or device.type != "cuda" or sources is None:
        return torch.device("cpu")
    size = files_bytes(sources)
    if size is None or torch.cuda.memory_allocated(device) + beside + size > 0.8 * budget:
        return torch.device("cpu")
    return device


def files_bytes(sources: Sequence[str | Path]) -> int | None:
    """The bytes of the safetensors weights under `sources` (files, folders or cached ids; a pipeline root
    counts its `text_encoder*/` folders only), or None when one cannot be found locally."""
    from flux_runtime.weights.errors import WeightsError
    from flux_runtime.weights.hub import resolve

    total = 0
    for source in sources:
        try:
            path = resolve(source)
        except WeightsError:
            return None
        if path.is_file():
            total += path.stat().st_size
            continue
        parts = sorted(path.glob("text_encoder*/")) or [path]
        total += sum(f.stat().st_size for part in parts for f in part.rglob("*.safetensors"))
    return total


def checkpoint_bytes(ckpt: Any, dtype: torch.dtype, fp8: bool) -> int:
    """The transformer's bytes once loaded, from the checkpoint's headers (`None`: a built-in model, 0)."""
    if ckpt is None:
        return 0
    from flux_runtime.weights.fp8 import may_run_fp8
    from flux_runtime.weights.safetensors_io import CAST_KINDS, ITEMSIZE

    src, size = ckpt.source, torch.empty((), dtype=dtype).element_size()
    total = 0
    quantized = getattr(src, "is_quantized", None)  # a GGUF file: its quantized blocks stay as stored
    for key in src.keys():
        kind, n = src.dtype(key), math.prod(src.shape(key))
        if quantized is not None and quantized(key):
            total += src.nbytes(key)
        elif kind == "F8_E4M3" or (fp8 and key.endswith(".weight") and may_run_fp8(key.rsplit(".", 1)[0])):
            total += n
        else:
            total += n * (size if kind in CAST_KINDS else ITEMSIZE[kind])
    return total


def transformer_device(
    budget: int | None, ckpt: Any, dtype: torch.dtype, fp8: bool, device: torch.device
) -> torch.device:
    """The device itself when there is no budget or the transformer fits it with room to spare; else host
    memory (the plan moves it in as it says, so a transformer larger than the GPU still loads)."""
    if budget is None or checkpoint_bytes(ckpt, dtype, fp8) <= 0.8 * budget:
        return device
    return torch.device("cpu")


def place(pipe: Any, budget: int | None, offload_text_encoders: bool, device: torch.device) -> None:
    """Apply the plan for `budget` (resolved before the load) to a freshly loaded pipeline (no plan without a
    budget)."""
    if budget is not None:
        apply_budget(pipe, budget, offload_text_encoders, device)
