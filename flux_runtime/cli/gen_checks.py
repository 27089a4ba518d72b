"""`flux-gen`'s option checks: what can be refused before any weights are read, and what waits for the model.

Before the load: the call's numbers (prompt, size, steps, guidance, strength), the input images (decoded, so a
bad file fails here), the --boxes, the LoRA specs, --prompts beside options it excludes, and the options of
another model family than the checkpoint's (`refuse_other_family`, from the `ONE_FAMILY` table). Once the
model is loaded: the FLUX.1 options only some of its variants take (`check_flux1_variant`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

# Options only one family's models take, by family: each option's parameter name, and the test of its value
# that says it was given (FLUX.1's: set at all, --true-cfg off its 1.0; FLUX.3's: truthy).
ONE_FAMILY: tuple[tuple[str, dict[str, Callable[[Any], bool]]], ...] = (
    (
        "FLUX.1",
        {
            "mask": lambda v: v is not None,
            "strength": lambda v: v is not None,
            "control_image": bool,
            "controlnets": bool,
            "control_modes": bool,
            "control_range": lambda v: v is not None,
            "max_area": lambda v: v is not None,
            "no_auto_resize": bool,
            "negative_prompt": lambda v: v is not None,
            "true_cfg": lambda v: v != 1.0,
            "redux": lambda v: v is not None,
            "redux_image_encoder": lambda v: v is not None,
            "redux_scale": lambda v: v != 1.0,
            "redux_pooled_scale": lambda v: v != 1.0,
            "ip_adapter": lambda v: v is not None,
            "ip_image": lambda v: v is not None,
            "negative_ip_image": lambda v: v is not None,
            "ip_image_encoder": lambda v: v is not None,
        },
    ),
    ("FLUX.3", {"no_upsample": bool, "prompt_upsampler": bool, "upsampler_prompts": bool, "boxes": bool}),
)
FAMILY_NAMES = {"flux1": "FLUX.1", "flux2": "FLUX.2", "flux3": "FLUX.3"}


def prompts_file_options(opts: dict[str, Any], ctx: click.Context) -> None:
    """--prompts: refuse --prompt and --replay beside it; --out is a folder, the current one unless given."""
    for other, why in (("prompt", "its lines are the prompts"), ("replay", "replay each PNG on its own")):
        if opts[other] is not None:
            raise click.ClickException(f"--{other} and --prompts exclude each other: {why}")
    if ctx.get_parameter_source("out") == ParameterSource.DEFAULT:
        opts["out"] = Path(".")


def check_early(opts: dict[str, Any]) -> None:
    """The call arguments that need no model, checked before any weights are read (the pipeline checks
    them again, with the model's defaults and its size multiple)."""
    from flux_runtime.pipeline.checks import (
        check_guidance,
        check_prompts,
        check_size,
        check_steps,
        check_vae_tile,
    )
    from flux_runtime.weights.builtin import size_multiple

    if opts.get("redux") is None or opts["prompt"] is not None:  # a Redux run needs no prompt
        check_prompts(opts["prompt"])
    check_redux_options(opts)
    if opts.get("cuda_graphs") and opts.get("no_cuda_graphs"):
        raise click.ClickException("--cuda-graphs and --no-cuda-graphs contradict each other: give one")
    if opts["height"] is not None or opts["width"] is not None:
        # the multiple where the registry knows the model's autoencoder; else the pipeline checks it once loaded
        multiple = (None if opts["vae"] is not None else size_multiple(opts["model"])) or 0
        other = max(multiple, 16)  # stands in for the side not given
        check_size(opts["height"] or other, opts["width"] or other, multiple)
    check_vae_tile(opts["vae_tile"])
    if opts["steps"] is not None:
        check_steps(opts["steps"], opts["steps"])
    if opts["guidance"] is not None:
        check_guidance(opts["guidance"], opts["guidance"])
    strength = opts.get("strength")
    if strength is not None and not 0 < strength <= 1:
        raise click.ClickException(f"--strength {strength} must be in (0, 1]")
    if opts.get("mask") is not None and not opts["image"]:
        raise click.ClickException("--mask needs --image (the image to inpaint)")
    if opts.get("strength") is not None and not opts["image"]:
        raise click.ClickException("--strength needs --image (img2img or inpainting)")
    check_ip_options(opts)
    if opts.get("attention", "sdpa") != "sdpa" and opts["quality"] != "high":
        raise click.ClickException(
            f"--attention {opts['attention']} needs --quality high (lossless always attends with SDPA)"
        )


def check_attention(opts: dict[str, Any], device: Any, dtype: Any) -> None:
    """--attention fa3-fp8 where FP8 attention cannot run on this device (the GPU, the package, the dtype): a
    one-line error naming the obstacle, before any weights load."""
    from flux_runtime.kernels import attention_backends as backends

    if opts.get("attention") == "fa3-fp8":
        obstacle = backends.fp8_obstacle(device, dtype, backends.FP8_HEAD_DIM)
        if obstacle is not None:
            raise click.ClickException(f"--attention fa3-fp8 cannot run here: {obstacle}")


def check_attention_heads(opts: dict[str, Any], head_dim: int) -> None:
    """--attention fa3-fp8 on a model whose heads the e4m3 producers do not take, before the first image."""
    from flux_runtime.kernels import attention_backends as backends

    if opts.get("attention") == "fa3-fp8" and head_dim != backends.FP8_HEAD_DIM:
        raise click.ClickException(
            f"--attention fa3-fp8 cannot run on this model: its heads are {head_dim} wide, FP8 attention takes "
            f"{backends.FP8_HEAD_DIM}; use --attention auto or sdpa"
        )


def check_ip_options(opts: dict[str, Any]) -> None:
    """--ip-adapter and its images go together: the adapter needs an image prompt, the images an adapter."""
    adapter = opts.get("ip_adapter") or opts.get("_ip_adapter")
    images = [f for f in ("ip_image", "negative_ip_image") if opts.get(f) is not None]
    if adapter is None:
        for flag in (*images, "ip_image_encoder"):
            if opts.get(flag) is not None:
                raise click.ClickException(f"--{flag.replace('_', '-')} needs --ip-adapter")
    elif not images:
        raise click.ClickException("--ip-adapter needs --ip-image (the image prompt)")


def ip_adapter_of(opts: dict[str, Any]) -> tuple[str, float | list[float], str | None] | None:
    """The IP-Adapter to load, (path, scale, image encoder): a replayed record's, else --ip-adapter's."""
    if opts.get("_ip_adapter") is not None:
        return opts["_ip_adapter"]
    if opts.get("ip_adapter") is None:
        return None
    path, scale = parse_lora(opts["ip_adapter"], "--ip-adapter")
    return path, scale, opts.get("ip_image_encoder")


def check_ip_adapter(adapter: tuple[str, float | list[float], str | None] | None) -> None:
    """A missing file, a file that is no IP-Adapter and a missing CLIP vision encoder fail before the model
    loads."""
    if adapter is None:
        return
    from flux_runtime.pipeline.errors import FluxError
    from flux_runtime.pipeline.ip_adapter import encoder_source
    from flux_runtime.weights.ip_adapter import IPAdapterError, check_ip_adapter_file

    path, _, encoder = adapter
    try:
        encoder_source(check_ip_adapter_file(path), encoder)
    except (IPAdapterError, FluxError) as e:
        raise click.ClickException(f"--ip-adapter: {str(e).removeprefix('IP-Adapter ')}") from None


def check_redux_options(opts: dict[str, Any]) -> None:
    """--redux and its companions: given together, beside --image and none of img2img's options, and the
    Redux files themselves (paths and headers only)."""
    redux = opts.get("redux")
    if redux is None:
        given = [f"--{k.replace('_', '-')}" for k in ("redux_image_encoder",) if opts.get(k) is not None]
        given += [
            f"--{k.replace('_', '-')}"
            for k in ("redux_scale", "redux_pooled_scale")
            if opts.get(k, 1.0) != 1.0
        ]
        if given:
            raise click.ClickException(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --redux")
        return
    if not opts["image"]:
        raise click.ClickException("--redux needs --image (the image to make variations of)")
    if (opts.get("gpus") or 1) > 1:
        raise click.ClickException("--redux runs on one GPU for now: drop --gpus")
    for name in ("strength", "mask"):
        if opts.get(name) is not None:
            raise click.ClickException(f"with --redux, --image is the Redux image: drop --{name}")
    if opts.get("negative_prompt") is not None:
        raise click.ClickException("--negative-prompt (true CFG) does not run with --redux: drop it")
    from flux_runtime.weights.redux import find_redux

    find_redux(redux, opts.get("redux_image_encoder"))  # a wrong file fails now, in one line


def check_inputs(opts: dict[str, Any], opened: set[Path]) -> None:
    """The input images (each path once in `opened`) decode and the boxes hold, before any weights are read."""
    for path in (
        *opts["image"],
        opts["mask"],
        *opts["control_image"],
        opts["ip_image"],
        opts["negative_ip_image"],
    ):
        if path is not None and path.resolve() not in opened:
            open_image(path.resolve())
            opened.add(path.resolve())
    boxes = read_boxes(opts["boxes"])
    if boxes is not None:
        from flux_runtime.pipeline.flux3_upsample import check_boxes

        check_boxes(boxes, len(opts["image"]))


def open_image(path: Path) -> Any:
    """A reference image, decoded now (so a bad file fails here); PIL keeps `path` as its `filename`."""
    from PIL import Image

    try:
        image = Image.open(path)
        image.load()
    except Image.DecompressionBombError as e:
        raise click.ClickException(f"cannot read image {path}: {e} Shrink it first.") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # UnidentifiedImageError is an OSError
        raise click.ClickException(f"cannot read image {path}: {e}") from None
    from flux_runtime.sampling.reference_images import wide_pixels

    wide = wide_pixels(str(path), image)  # refused now, before any weights are read
    if wide is not None:
        raise click.ClickException(wide)
    return image


def read_boxes(value: str | list[Any] | None) -> Any:
    """--boxes: inline JSON (starting with '['), else a JSON file; one error if it is neither (a --prompts line
    may give the list itself). The boxes themselves are checked by the pipeline."""
    if value is None or isinstance(value, list):
        return value
    text, where = value, "--boxes"
    if not value.lstrip().startswith("["):
        path = Path(value)
        if not path.is_file():
            raise click.ClickException(
                f"--boxes {value}: neither a JSON list (starting with '[') nor a file; give the boxes inline "
                "or as a .json file"
            )
        try:
            text, where = path.read_text(encoding="utf-8"), f"--boxes {path}"
        except (OSError, UnicodeDecodeError) as e:
            raise click.ClickException(f"--boxes {path}: cannot read it ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise click.ClickException(f"{where}: not valid JSON ({e})") from None


def parse_lora(spec: str, flag: str = "--lora") -> tuple[str, float]:
    """`PATH[:SCALE]` → (path, scale); a suffix that is not a number belongs to the path (`flag`: the option,
    for the message)."""
    from flux_runtime.pipeline.loras import split_spec

    try:
        return split_spec(spec)
    except ValueError as e:
        raise click.ClickException(f"{flag} {spec}: {e}") from None


def controlnets_of(opts: dict[str, Any]) -> list[tuple[str, float]]:
    """The ControlNets to run, (path, scale) each: a replayed record's, else --controlnet's."""
    return opts.get("_controlnets") or [parse_lora(spec, "--controlnet") for spec in opts["controlnets"]]


def check_controlnet_files(controlnets: list[tuple[str, float]]) -> None:
    """A missing or damaged ControlNet, or a file that is none, fails before any model loads."""
    from flux_runtime.weights.controlnet import controlnet_files, detect_layout
    from flux_runtime.weights.errors import WeightsError
    from flux_runtime.weights.safetensors_io import read_header

    for path, _ in controlnets:
        try:
            files, _ = controlnet_files(path)
            detect_layout(list(read_header(files[0])), files[0])
        except WeightsError as e:
            raise click.ClickException(f"--controlnet: {e}") from None


def control_modes(opts: dict[str, Any]) -> Any:
    """--control-mode as the pipeline takes it: None, one mode for all, or a list (`none` → None; digits →
    an index; else a mode name the pipeline checks)."""
    modes = [None if m.lower() == "none" else int(m) if m.isdigit() else m for m in opts["control_modes"]]
    return None if not modes else modes[0] if len(modes) == 1 else modes


def loras_of(opts: dict[str, Any]) -> list[tuple[str, float]]:
    """The LoRAs to fuse, (path, scale) each: a replayed record's, else --lora's."""
    return opts.get("_loras") or [parse_lora(spec) for spec in opts["loras"]]


def check_lora_files(loras: list[tuple[str, float]]) -> None:
    """A missing or damaged LoRA fails before the model loads."""
    from flux_runtime.weights.lora_formats import LoraError, check_lora_file

    for path, _ in loras:
        try:
            check_lora_file(path)
        except LoraError as e:
            raise click.ClickException(f"--lora: {str(e).removeprefix('LoRA ')}") from None


def refuse_other_family(opts: dict[str, Any], family: str) -> None:
    """One error naming the options given that only another family's models take (FLUX.1's first), for a
    model of `family` (flux1, flux2, flux3)."""
    name = FAMILY_NAMES[family]
    for owner, options in ONE_FAMILY:
        if owner == name:
            continue
        given = ["--" + key.replace("_", "-") for key, is_given in options.items() if is_given(opts[key])]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise click.ClickException(
                f"{', '.join(given)} {verb} a {owner} model; {opts['model']} is {name}"
            )


def check_flux1_variant(pipe: Any, opts: dict[str, Any]) -> None:
    """The options a FLUX.1 model takes only in some variants, checked once the variant is known."""
    images = opts["image"]
    if opts.get("redux") is not None:  # --image is the Redux image; the pipeline refuses Kontext and Fill
        return
    if images and pipe.variant == "text2img" and opts["strength"] is None and opts["mask"] is None:
        # a reference image to edit from is FLUX.2's (or Kontext's); FLUX.1 redraws an image on request
        raise click.ClickException(
            f"--image needs a FLUX.2 model; {opts['model']} is FLUX.1: for img2img give --strength, "
            "for inpainting --mask"
        )
    if len(images) > 1:
        raise click.ClickException("FLUX.1 takes one --image (img2img, inpainting, Kontext, Fill)")
    nets, controls = len(pipe.controlnets), len(opts["control_image"])
    if nets and controls != nets:
        raise click.ClickException(
            f"give one --control-image per --controlnet: {nets} ControlNet(s), {controls} control image(s)"
        )
    if not nets and controls > 1:
        raise click.ClickException(
            "a Depth / Canny model takes one --control-image; several need --controlnet"
        )
    if len(opts["control_modes"]) not in (0, 1, nets):
        raise click.ClickException(
            f"give one --control-mode for every ControlNet, or one each: {nets} ControlNet(s), "
            f"{len(opts['control_modes'])} modes"
        )
    if (opts.get("ip_adapter") or opts.get("_ip_adapter")) is not None and pipe.variant in (
        "fill",
        "control",
    ):
        raise click.ClickException(
            f"--ip-adapter runs with FLUX.1 text to image, img2img, inpainting and Kontext; {opts['model']} is a "
            f"{pipe.variant} checkpoint"
        )
    if pipe.variant != "kontext" and (opts["max_area"] is not None or opts["no_auto_resize"]):
        raise click.ClickException(
            f"--max-area and --no-auto-resize need a FLUX.1 Kontext model; {opts['model']} is not one"
        )
