"""The memory planner: which models sit on the GPU when, chosen once from a budget the user names.

`Pipeline.from_pretrained(..., memory="24GB")` (or `"auto"`: the GPU's free memory) turns the budget and
the sizes of the loaded models into a `Plan`, the fastest of four that fits:

- `resident`: text encoders, transformer and VAE all stay on the GPU;
- `offload-text`: the transformer stays; the text encoders live in pinned host memory and come to the
  GPU (copied on a side stream) only to encode, then leave;
- `swap`: text encoders and transformer take turns: the transformer is off the GPU while a prompt is
  encoded (and comes back, again from pinned host memory, when it is needed), so the two are never
  co-resident;
- `stream`: as `swap`, and the transformer's blocks stream through a ring of GPU slots, the next block
  copied on a side stream while the current one computes; as many blocks as fit stay resident. A text
  encoder too large for the budget streams its layers the same way.

The VAE stays resident; a decode that would not fit beside the transformer runs tiled (diffusers' tile
of 128 latent pixels, which at 1024² and below is the one-pass decode). Plans move weights, never change
them: every plan gives the same bits. Sizes are bytes; `GB` in a budget means 2**30 bytes (GPU memory
is sold in GiB under that name). Activation estimates are deliberately generous: the plan is a bound
the run stays under, not a prediction. Each is checked against the peak of the real full-size models
measured on the meta device (`memory_trace.LiveBytes`, tests/pipeline/test_memory_peaks.py).

Beside the weights and activations a budget keeps room for what the CUDA caching allocator holds and does
not hand out: a fraction (`HEADROOM`) for its rounding and for activations freed in pieces that a larger
tensor cannot reuse, and on a GPU a fixed `WORKSPACE` for cuBLAS's and cuDNN's workspaces, the RNG state
and the small tensors of a call (ids, RoPE tables, embeddings, latents). Models that take turns on the GPU
hand their segments back to the driver when they leave (`streaming.ModelPlacement`), so the next model's
weights never land in the holes of the last one's.

With CUDA graphs (any plan that does not stream the transformer), the captured denoiser keeps its memory
pool, the size of the denoising activations, for as long as the transformer stays: through the decode, and in
the `resident` plan through the next call's prompt encoding too. Those stages are planned with the pool beside
them (`Footprint.graphs`). Under a budget the pool never meets a text encoder coming in: with `offload-text`
the graphs are dropped before it comes (the next denoise captures them again), and when the transformer leaves
the GPU its graphs go with it.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from flux_runtime.pipeline.errors import FluxError

log = logging.getLogger(__name__)

PlanName = Literal["resident", "offload-text", "swap", "stream"]
Mode = Literal["resident", "offloaded", "streamed"]
PLANS: tuple[PlanName, ...] = ("resident", "offload-text", "swap", "stream")
GiB = 1 << 30
_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": GiB, "tb": 1 << 40}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": GiB, "tib": 1 << 40})
# GPU slots a streamed model's blocks cycle through: one computing, one being copied into
SLOTS = 2
# share of a budget kept free for the allocator's rounding and fragmentation
HEADROOM = 0.05
# bytes kept free on a GPU for cuBLAS / cuDNN workspaces, the RNG state and a call's small tensors
WORKSPACE = 512 << 20
# The budget of a plan asked for by name without one (offload_text_encoders with no memory budget).
UNLIMITED = 1 << 62
VAE_TILE = 128  # diffusers' tile_latent_min_size for FLUX.1 and FLUX.2


class MemoryBudgetError(FluxError):
    """The budget cannot hold a model even with every weight streamed, or a call's activations."""


def parse_memory(memory: str | int | float | None) -> str | int | None:
    """`None`, `"auto"` or a byte count from `"24GB"` / `"16 GiB"` / `"512MB"` / an int; a FluxError otherwise."""
    if memory is None or memory == "auto":
        return memory
    if isinstance(memory, bool):
        raise FluxError(f"memory {memory!r} is not a budget: give 'auto' or a size such as '24GB'")
    if isinstance(memory, (int, float)):
        if not math.isfinite(memory) or memory <= 0:
            raise FluxError(f"memory {memory!r} must be a positive number of bytes")
        return int(memory)
    if not isinstance(memory, str):
        raise FluxError(f"memory must be 'auto' or a size such as '24GB', got {type(memory).__name__}")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", memory)
    unit = (m.group(2) or "b").lower() if m else ""
    if m is None or unit not in _UNITS:
        raise FluxError(f"memory {memory!r} is not a budget: give 'auto' or a size such as '24GB' or '512MB'")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise FluxError(f"memory {memory!r} must be more than zero")
    return size


def resolve_budget(memory: str | int | float | None, device: torch.device) -> int | None:
    """The budget in bytes, or None when nothing is planned (`memory=None`, or "auto" off a GPU).

    "auto" is the GPU's free memory now (what `torch.cuda.mem_get_info` reports) plus what this process's
    allocator already holds in reserve, since that is available to it too. A named budget larger than
    all this process can have (the free memory plus everything its allocator holds, the loaded weights
    included: a "24GB" budget on a 24 GB card, whose CUDA context and other processes take part of it) is
    lowered to that, with a warning: a plan for memory that is not there would run out of it.
    """
    parsed = parse_memory(memory)
    if parsed is None:
        return None
    if parsed != "auto" and device.type != "cuda":
        assert isinstance(parsed, int)
        return parsed
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    if parsed == "auto":
        return int(free + reserved - torch.cuda.memory_allocated(device))
    assert isinstance(parsed, int)
    most = int(free + reserved)
    if parsed > most:
        log.warning(
            "memory budget %s is more than the %s this process can have on %s; planning for %s",
            gib(parsed), gib(most), device, gib(most),
        )  # fmt: skip
        return most
    return parsed


def gib(n: int) -> str:
    """Bytes as GiB with one decimal (three below 0.1 GiB, for the tiny models)."""
    return f"{n / GiB:.1f} GB" if n >= GiB // 10 else f"{n / GiB:.4f} GB"


# ---------------------------------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Part:
    """A model's weight bytes: what it holds outside its layers, and each layer (in call order)."""

    rest: int
    layers: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return self.rest + sum(self.layers)


@dataclass(frozen=True)
class Footprint:
    """What a pipeline needs on the GPU: weights by model and the peak activations of each stage."""

    text: Part
    dit: Part
    vae: int
    act_encode: int
    act_denoise: int
    act_decode: int
    act_decode_tiled: int
    workspace: int = 0  # `WORKSPACE` on a GPU, 0 on a CPU
    graphs: bool = False  # CUDA graphs will capture the denoiser (unless the plan streams the transformer)

    @property
    def retained(self) -> int:
        """What captured CUDA graphs hold beside the decode and the next encode: the denoising pool."""
        return self.act_denoise if self.graphs else 0


def usable(budget: int, workspace: int) -> int:
    """The bytes of `budget` that weights and estimated activations may fill (see the module docstring)."""
    return int(budget * (1 - HEADROOM)) - workspace


def budget_needed(need: int, workspace: int) -> int:
    """The smallest budget whose `usable` part holds `need` bytes."""
    return math.ceil((need + workspace) / (1 - HEADROOM))


@dataclass(frozen=True)
class Plan:
    """Where each model lives and how the blocks stream; `streamed_*` are layer positions in call order."""

    name: PlanName
    budget: int | None
    text: Mode = "resident"
    dit: Mode = "resident"
    streamed_text: tuple[int, ...] = ()
    streamed_dit: tuple[int, ...] = ()
    slots: int = SLOTS
    together: bool = True  # text encoder and transformer on the GPU at once
    vae_tiled: bool = False  # decode in tiles (only where the one-pass decode does not fit)
    peak: int = 0  # the estimated peak, bytes
    layers: dict[str, int] = field(default_factory=dict, compare=False)  # layer counts, for the description

    def describe(self) -> str:
        """One line: the plan, what moves, and the budget."""
        if self.budget is None:
            return "memory plan: resident (no budget: everything on the device)"
        parts = [f"memory plan: {self.name}"]
        if self.text != "resident":
            parts.append("text encoders " + self._mode("text", self.text, self.streamed_text))
        if self.dit != "resident":
            parts.append("transformer " + self._mode("dit", self.dit, self.streamed_dit))
        if self.vae_tiled:
            parts.append(f"VAE tiled ({VAE_TILE} latent px)")
        if self.budget >= UNLIMITED:  # a plan asked for by name (offload_text_encoders), not by a budget
            return f"{', '.join(parts)}; est. peak {gib(self.peak)} (no budget)"
        return f"{', '.join(parts)}; est. peak {gib(self.peak)} of a {gib(self.budget)} budget"

    def _mode(self, model: str, mode: Mode, streamed: tuple[int, ...]) -> str:
        if mode == "offloaded":
            return "off the GPU between uses (pinned host memory)"
        n = self.layers.get(model, len(streamed))
        return f"streamed ({len(streamed)} of {n} blocks through {self.slots} slots)"

    @property
    def streams_dit(self) -> bool:
        return self.dit == "streamed"


def plan_memory(fp: Footprint, budget: int | None, *, force: PlanName | None = None) -> Plan:
    """The fastest plan whose estimated peak fits `budget` (all of `PLANS` tried in order, or from `force`).

    Raises MemoryBudgetError, naming the budget and what the smallest plan needs, when nothing fits.
    """
    layers = {"text": len(fp.text.layers), "dit": len(fp.dit.layers)}
    if budget is None:
        return Plan("resident", None, layers=layers)
    room = usable(budget, fp.workspace)
    start = PLANS.index(force) if force is not None else 0
    for name in PLANS[start:]:
        plan = _try(name, fp, room)
        if plan is not None:
            return replace(plan, budget=budget, layers=layers, peak=plan.peak + fp.workspace)
    need = _stream_minimum(fp)
    raise MemoryBudgetError(
        f"a memory budget of {gib(budget)} cannot hold this model even streamed block by block: it needs "
        f"about {gib(budget_needed(need, fp.workspace))} (largest text-encoder layer and transformer blocks, VAE, "
        "activations); give a larger budget, --fp8 / --fp8-text, or a smaller image"
    )


def _try(name: PlanName, fp: Footprint, usable: int) -> Plan | None:
    text, dit, vae = fp.text.total, fp.dit.total, fp.vae
    # the transformer stage's activations: denoising, then the decode beside the graphs' retained pool
    act_dit = max(fp.act_denoise, fp.act_decode + fp.retained)
    if name == "resident":
        peak = text + dit + vae + max(fp.act_encode + fp.retained, act_dit)
        return Plan(name, None, peak=peak) if peak <= usable else None
    if name == "offload-text":  # the graphs are dropped before the text encoder comes in (`Placement.using`)
        peak = max(text + dit + vae + fp.act_encode, dit + vae + act_dit)
        return Plan(name, None, text="offloaded", peak=peak) if peak <= usable else None
    # swap and stream: the text encoder and the transformer are never on the GPU together
    text_stage = _fit_layers(fp.text, usable - vae - fp.act_encode)
    if text_stage is None:
        return None
    text_mode: Mode = "offloaded" if not text_stage[0] else "streamed"
    text_peak = text_stage[1] + vae + fp.act_encode
    if name == "swap":
        peak = dit + vae + act_dit
        if peak > usable:
            return None
        return Plan(
            name, None, text=text_mode, dit="offloaded", streamed_text=text_stage[0], together=False,
            peak=max(peak, text_peak),
        )  # fmt: skip
    # a streamed transformer runs eagerly: no graphs, nothing retained
    for act, tiled in (
        (max(fp.act_denoise, fp.act_decode), False),
        (max(fp.act_denoise, fp.act_decode_tiled), True),
    ):
        dit_stage = _fit_layers(fp.dit, usable - vae - act, force_stream=True)
        if dit_stage is not None:
            return Plan(
                name, None, text=text_mode, dit="streamed", streamed_text=text_stage[0],
                streamed_dit=dit_stage[0], together=False, vae_tiled=tiled,
                peak=max(text_peak, dit_stage[1] + vae + act),
            )  # fmt: skip
    return None


def _fit_layers(part: Part, room: int, *, force_stream: bool = False) -> tuple[tuple[int, ...], int] | None:
    """(layers to stream, the stage's bytes) streaming as few layers as fit `room`, or None.

    Zero streamed layers (the whole model on the GPU for its stage) is tried first unless `force_stream`.
    Streamed layers are spread evenly over the call order, so their copies overlap resident blocks'
    compute all through a forward.
    """
    n = len(part.layers)
    for s in range(0 if not force_stream else 1, n + 1):
        streamed = spread(n, s)
        slot = max((part.layers[i] for i in streamed), default=0)
        stage = part.total - sum(part.layers[i] for i in streamed) + min(SLOTS, s) * slot
        if stage <= room:
            return streamed, stage
    return None


def spread(n: int, s: int) -> tuple[int, ...]:
    """`s` of `n` positions, evenly spaced (s = n: all of them)."""
    if s <= 0:
        return ()
    return tuple(sorted({min(n - 1, int((k + 0.5) * n / s)) for k in range(s)}))


def _stream_minimum(fp: Footprint) -> int:
    """The bytes the leanest plan needs: every layer streamed, two slots each, tiled decode."""

    def lean(part: Part) -> int:
        return part.rest + min(SLOTS, len(part.layers)) * max(part.layers, default=0)

    return max(
        lean(fp.text) + fp.vae + fp.act_encode,
        lean(fp.dit) + fp.vae + max(fp.act_denoise, fp.act_decode_tiled),
    )


# ---------------------------------------------------------------------------------------------- activations


def denoise_activations(
    tokens: int, txt_tokens: int, hidden: int, mlp_hidden: int, swiglu: bool, batch: int, itemsize: int
) -> int:
    """A generous bound on one transformer forward's live activations, bytes.

    The widest moment is a single block: its fused input projection (3D + M, or 3D + 2M for SwiGLU), the
    `[attention | MLP]` buffer (D + M), q/k/v after norm and RoPE, and the residual streams, for every
    token; doubled for what the allocator cannot reuse at once. Measured on meta at 1024² (B=1, 512 text
    tokens): FLUX.1-dev 0.61 GiB bf16 / 1.07 GiB FP8 (reference quantization, fp32 temporaries) against
    1.11 GiB here; FLUX.2-dev 1.48 / 1.98 GiB against 2.32 GiB.
    """
    length = tokens + txt_tokens
    proj = 3 * hidden + (2 if swiglu else 1) * mlp_hidden
    per_token = proj + (hidden + mlp_hidden) + 3 * hidden + 6 * hidden
    return 2 * batch * length * per_token * itemsize


def decode_activations(
    height: int, width: int, batch: int, itemsize: int, channels: int = 128, tile_px: int | None = None
) -> int:
    """A generous bound on the VAE decoder's live activations, bytes: a dozen maps of its full-resolution
    width (`channels`, 128 for FLUX) at the output size (or one tile's, plus the output, when tiled).

    Six such maps are live at the decoder's peak (measured on meta: 1.50 GiB at 1024², B=1, bf16, both
    FLUX autoencoders); the other six are for cuDNN's convolution workspaces, which took about as much
    again on the H200 (diffusers' decode peaked at 2.6 GiB with 0.16 GiB of weights)."""
    h, w = (height, width) if tile_px is None else (min(height, tile_px), min(width, tile_px))
    maps = 12 * batch * h * w * channels * max(itemsize, 2)
    out = batch * 3 * height * width * 4 * 2
    return maps + out


def encode_activations(
    tokens: int, hidden: int, layers: int, intermediate: int, vocab: int, itemsize: int
) -> int:
    """A generous bound on a text encoder's activations for one batch of `tokens` (all hidden states
    kept, one MLP intermediate, logits over the vocabulary where the model computes them), bytes.
    Measured on meta (512 tokens, bf16): T5-XXL 0.09 GiB against 0.79 here, Mistral Small 3.1 (all
    hidden states and the logits) 0.33 GiB against 2.30."""
    states = (layers + 1) * tokens * hidden * itemsize
    mlp = 4 * tokens * intermediate * itemsize
    logits = 2 * tokens * vocab * 4
    return 2 * (states + mlp + logits)


def layer_bytes(sizes: Sequence[int]) -> int:
    """The largest of `sizes` (0 for none)."""
    return max(sizes, default=0)
