"""ControlNets on the FLUX.1 recipe, as diffusers' FluxControlNetPipeline (and FluxMultiControlNetModel) run them.

A pipeline holds its ControlNets in order (`Pipeline(..., controlnet=...)`, `from_pretrained(controlnet=...)`);
a call gives one control image per ControlNet, and per ControlNet a scale, a union mode and the fraction of
the steps it acts in (`control_guidance_start` / `_end`). Every input is checked before any model runs.

Text to image, img2img and inpainting take them alike (FluxControlNetPipeline, FluxControlNetImg2ImgPipeline,
FluxControlNetInpaintPipeline). Per call (`prepare`): each control image, at the output's size, goes through the
VAE as a posterior sample drawn from the call's generator before the variant draws its own (the input image's
sample, the noise) (InstantX, union), or stays pixels (XLabs' hint encoder). Per step
(`residuals`): each ControlNet acting at this step runs on the latents with the positive prompt, its residuals
times its scale are summed in order, and the transformer adds them after its blocks; the negative branch of
true CFG gets the same residuals (computed again from the same inputs: the same bits). A ControlNet outside its
fraction of the steps is not run at all: diffusers runs it at scale 0 and adds zeros, which changes no bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from PIL import Image
from torch import Tensor

from flux_runtime.models.dit.controlnet import Flux1ControlNet
from flux_runtime.models.dit.residuals import ControlResiduals
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.flux1_variants import call_generator, preprocess
from flux_runtime.pipeline.provenance import image_record
from flux_runtime.pipeline.state import Call, Conditioning, Start
from flux_runtime.sampling import pack
from flux_runtime.sampling.reference_images import require_image

if TYPE_CHECKING:
    from flux_runtime.pipeline.core import Recipe as Flux1Pipe  # the FLUX.1 recipe

# The union ControlNets' modes (InstantX FLUX.1-dev-Controlnet-Union, Shakker-Labs Union Pro): name → index.
UNION_MODES = {"canny": 0, "tile": 1, "depth": 2, "blur": 3, "pose": 4, "gray": 5, "lq": 6}
CALL_ARGUMENTS = (
    "controlnet_conditioning_scale",
    "control_mode",
    "control_guidance_start",
    "control_guidance_end",
)
DEFAULTS: dict[str, Any] = dict(
    controlnet_conditioning_scale=1.0, control_mode=None, control_guidance_start=0.0, control_guidance_end=1.0
)
MAX_SCALE = 100.0


def as_controlnets(controlnet: Any, *, device: torch.device, dtype: torch.dtype) -> list[Flux1ControlNet]:
    """The pipeline's ControlNets from `controlnet=`: None, a loaded model, a path or id, or a list of them
    (loaded with `load_controlnet` to `device` in `dtype`)."""
    if controlnet is None:
        return []
    items = list(controlnet) if isinstance(controlnet, (list, tuple)) else [controlnet]
    if not items:
        raise FluxError("controlnet=[] holds no ControlNet: give one or more, or leave controlnet out")
    nets = []
    for item in items:
        if isinstance(item, Flux1ControlNet):
            nets.append(item)
        elif isinstance(item, (str, Path)):
            from flux_runtime.weights.controlnet import load_controlnet

            nets.append(load_controlnet(item, device=device, dtype=dtype))
        else:
            raise FluxError(
                f"controlnet= takes ControlNets (load_controlnet), paths or ids, or a list of them; got "
                f"{type(item).__name__}"
            )
    return nets


def check_nets(nets: list[Flux1ControlNet], transformer: Any, vae: Any, name: str) -> None:
    """ControlNets this transformer can take: FLUX.1 widths equal to the transformer's, all fed the same way,
    XLabs' only beside an autoencoder that scales 8x down as its hint encoder does."""
    cfg = transformer.config
    factor = vae.config.spatial_factor
    if factor != 8 and any(net.control.hint for net in nets):
        raise FluxError(
            f"XLabs ControlNets read the control image 8x down, but {name}'s autoencoder scales {factor}x: "
            "use them with FLUX.1's own autoencoder"
        )
    for i, net in enumerate(nets):
        c = net.config
        if c.family != cfg.family:
            raise FluxError(f"ControlNet {i + 1} is a {c.family} model; {name} is {cfg.family}")
        for what, ours, theirs in (
            ("hidden size", cfg.hidden_size, c.hidden_size), ("latent input", cfg.in_channels, c.in_channels),
            ("text width", cfg.context_in_dim, c.context_in_dim), ("pooled width", cfg.vec_in_dim, c.vec_in_dim),
        ):  # fmt: skip
            if ours != theirs:
                raise FluxError(
                    f"ControlNet {i + 1} ({net.control.kind}) has {what} {theirs}, but {name}'s transformer has "
                    f"{ours}: it was trained for another model"
                )
    if len({net.control.hint for net in nets}) > 1:
        raise FluxError(
            "XLabs ControlNets (the control image as pixels) and latent ones (InstantX, union) cannot run "
            "together: give ControlNets of one kind"
        )


@dataclass(frozen=True)
class ControlArgs:
    """A call's checked ControlNet arguments, one entry per ControlNet."""

    images: tuple[Image.Image, ...]
    scales: tuple[float, ...]
    modes: tuple[int | None, ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]


def check_call(pipe: Flux1Pipe, call: Call) -> None:
    """Check the ControlNet arguments of `call` (before any model runs) into `call.prepared["controlnet"]`;
    `control_image` leaves `call.inputs` (the Depth / Canny variants read it there)."""
    inputs, nets = call.inputs, pipe.controlnets
    given = {k for k in CALL_ARGUMENTS if inputs.get(k) != DEFAULTS[k]}
    if not nets:
        if given:
            raise FluxError(
                f"{sorted(given)[0]} needs a ControlNet: load one with controlnet= (--controlnet)"
            )
        return
    if pipe.variant != "text2img":
        raise FluxError(
            f"{pipe.model_name} is a {pipe.variant} checkpoint: ControlNets run on FLUX.1 text to image, img2img "
            "and inpainting only"
        )
    n = len(nets)
    images = _per_net(inputs.pop("control_image"), n, "control_image", None)
    if any(i is None for i in images):
        raise FluxError(f"give a control_image for each of the {n} ControlNet(s)")
    for image in images:
        require_image("control_image", image, FluxError)
    scales, starts, ends = (
        tuple(_number(v, name, 0.0, high) for v in _per_net(inputs[name], n, name, DEFAULTS[name]))
        for name, high in (
            ("controlnet_conditioning_scale", MAX_SCALE), ("control_guidance_start", 1.0),
            ("control_guidance_end", 1.0),
        )
    )  # fmt: skip
    for s, e in zip(starts, ends, strict=True):
        if not s < e:
            raise FluxError(f"control_guidance_start {s} must be below control_guidance_end {e}")
    given_modes = _per_net(inputs["control_mode"], n, "control_mode", None)
    modes = tuple(_mode(m, net, i) for i, (m, net) in enumerate(zip(given_modes, nets, strict=True)))
    call.prepared["controlnet"] = ControlArgs(images, scales, modes, starts, ends)  # type: ignore[arg-type]
    inputs["control_image"] = None


def default_size(call: Call) -> tuple[int, int] | None:
    """(height, width) of the first control image, the output's size when the call gives none."""
    args = call.prepared.get("controlnet")
    if args is None:
        return None
    return args.images[0].height, args.images[0].width


def check_sizes(call: Call) -> None:
    """Each control image must be the output's size (diffusers would resize it silently: a stretched
    control image steers the picture wrong)."""
    args = call.prepared.get("controlnet")
    if args is None:
        return
    for i, image in enumerate(args.images):
        if (image.height, image.width) != (call.height, call.width):
            raise FluxError(
                f"control_image {i + 1} is {image.width}x{image.height} but the image asked for is "
                f"{call.width}x{call.height}: resize the control image, or give height/width to match it"
            )


def _per_net(value: Any, n: int, name: str, default: Any) -> list[Any]:
    """`value` as one entry per ControlNet: a list of `n`, or one value for all."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise FluxError(f"{name} has {len(value)} entries for {n} ControlNet(s); give one per ControlNet")
        return list(value)
    return [default if value is None else value] * n


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise FluxError(f"{name} {value!r} must be a number in [{low:g}, {high:g}]")
    return float(value)


def _mode(mode: Any, net: Flux1ControlNet, i: int) -> int | None:
    """A union ControlNet's mode index (from an index or a name); None for the others."""
    modes = net.control.num_modes
    if modes is None:
        if mode is not None:
            raise FluxError(
                f"ControlNet {i + 1} ({net.control.kind}) has no control modes; control_mode is for union "
                "ControlNets: drop it"
            )
        return None
    if mode is None:
        raise FluxError(
            f"ControlNet {i + 1} is a union ControlNet: give control_mode (0..{modes - 1} or "
            f"{', '.join(k for k, v in UNION_MODES.items() if v < modes)})"
        )
    if isinstance(mode, str):
        if mode.lower() not in UNION_MODES:
            raise FluxError(
                f"unknown control_mode {mode!r}: choose one of {', '.join(UNION_MODES)} or an index"
            )
        mode = UNION_MODES[mode.lower()]
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode < modes:
        raise FluxError(
            f"control_mode {mode!r} is not one of ControlNet {i + 1}'s {modes} modes (0..{modes - 1})"
        )
    return mode


class ControlTensors(NamedTuple):
    """What a ControlNet step reads that changes between calls (a CUDA graph's inputs): per ControlNet its
    condition, union mode and RoPE tables; the positive prompt's text states and pooled vector, which every
    branch's ControlNets read; the guidance the ControlNets embed."""

    conds: tuple[Tensor, ...]
    modes: tuple[Tensor | None, ...]
    ropes: tuple[tuple[Tensor, Tensor], ...]
    txt: Tensor
    vec: Tensor
    guidance: Tensor | None


@dataclass(frozen=True)
class ControlRun:
    """One call's ControlNet inputs on the device (`tensors`), and per step i the (ControlNet index, scale)
    pairs acting then (`steps[i]`)."""

    tensors: ControlTensors
    steps: tuple[tuple[tuple[int, float], ...], ...]

    def active(self, i: int) -> tuple[tuple[int, float], ...]:
        return self.steps[i]


def prepare(pipe: Flux1Pipe, call: Call, cond: Conditioning, start: Callable[[Any], Start]) -> Start:
    """Where a ControlNet call starts: the control images through the VAE (latent ControlNets: posterior samples
    from the call's generator, in order, before `start(generator)` draws the noise) or as pixels (XLabs),
    repeated over the batch; then `Start.control` with each ControlNet's RoPE tables and the ControlNets acting
    at each step."""
    args: ControlArgs = call.prepared["controlnet"]
    assert call.height is not None and call.width is not None  # filled by check
    device, vae, batch = pipe.device, pipe.vae, cond.batch
    generator = call_generator(call)
    if isinstance(generator, list) and len(generator) != batch:
        raise FluxError(f"got {len(generator)} generators for a batch of {batch}; pass one per image")
    conds = []
    for net, image in zip(pipe.controlnets, args.images, strict=True):
        pixels = preprocess(image, call.height, call.width).repeat_interleave(batch, dim=0)
        pixels = pixels.to(device=device, dtype=pipe.dtype)
        if net.control.hint:
            conds.append(pixels)
        else:
            conds.append(pack(vae.scale_latents(vae.encode(pixels, sample=True, generator=generator))))
    begin = start(generator)
    modes = tuple(
        None if m is None else torch.full((batch, 1), m, dtype=torch.long, device=device) for m in args.modes
    )
    ropes = tuple(net.rope(net.text_ids(begin.txt_ids), begin.img_ids) for net in pipe.controlnets)
    guidance = None
    if any(net.config.guidance_embed for net in pipe.controlnets):
        value = call.guidance_used if call.guidance_used is not None else call.guidance
        value = pipe.default_guidance if value is None else value
        guidance = torch.full([1], float(value), device=device, dtype=torch.float32).expand(batch)
    tensors = ControlTensors(tuple(conds), modes, ropes, cond.txt, _pooled(cond), guidance)
    begin.control = ControlRun(tensors, _activity(args, len(begin.timesteps)))
    return begin


def _activity(args: ControlArgs, steps: int) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Per step, the (index, scale) of the ControlNets acting: ControlNet j acts at step i unless
    `i / steps < start_j` or `(i + 1) / steps > end_j` (diffusers' `controlnet_keep`)."""
    return tuple(
        tuple(
            (j, scale) for j, (scale, s, e) in enumerate(zip(args.scales, args.starts, args.ends, strict=True))
            if not (i / steps < s or (i + 1) / steps > e)
        )
        for i in range(steps)
    )  # fmt: skip


def _pooled(cond: Conditioning) -> Tensor:
    assert cond.vec is not None  # FLUX.1 always has the pooled vector
    return cond.vec


def residuals(
    nets: Sequence[Flux1ControlNet], tensors: ControlTensors, active: tuple[tuple[int, float], ...], x: Tensor,
    t: Tensor,
) -> ControlResiduals:  # fmt: skip
    """The summed residuals of the `active` (index, scale) ControlNets at latents `x` and time `t`, shaped as
    diffusers' FluxMultiControlNetModel leaves them (the first ControlNet decides which block kinds get
    residuals and XLabs' repetition; a shorter list cuts the sum, as diffusers' `zip` does)."""
    total: ControlResiduals | None = None
    for j, scale in active:
        net = nets[j]
        guidance = tensors.guidance if net.config.guidance_embed else None
        out = net(
            x,
            tensors.conds[j],
            tensors.modes[j],
            tensors.txt,
            tensors.vec,
            t,
            guidance,
            tensors.ropes[j],
            scale,
        )
        total = out if total is None else total.plus(out)
    assert total is not None
    # the lengths had every ControlNet run (diffusers runs the idle ones at scale 0)
    double = _summed_length([n.config.depth for n in nets])
    single = _summed_length([n.config.depth_single_blocks for n in nets])
    return ControlResiduals(total.double[:double], total.single[:single], repeat=nets[0].control.hint)


def _summed_length(counts: list[int]) -> int:
    """How many residuals of one block kind the sum over ControlNets with `counts` of them has: none when the
    first has none, else the fewest among those that have some."""
    return min(c for c in counts if c) if counts[0] else 0


def record(pipe: Flux1Pipe, call: Call) -> dict[str, Any]:
    """Provenance: each ControlNet's kind, path and fingerprint (None for one built in memory), its image's
    path and fingerprint, scale, mode and step fraction."""
    args: ControlArgs | None = call.prepared.get("controlnet")
    if args is None:
        return {}
    out = []
    for net, image, scale, mode, s, e in zip(
        pipe.controlnets, args.images, args.scales, args.modes, args.starts, args.ends, strict=True
    ):
        entry: dict[str, Any] = {
            "kind": net.control.kind, "path": getattr(net, "path", None),
            "weights": getattr(net, "fingerprint", None), "image": image_record(image), "scale": scale,
            "guidance_start": s, "guidance_end": e,
        }  # fmt: skip
        if mode is not None:
            entry["mode"] = mode
        out.append(entry)
    return {"controlnets": out}
