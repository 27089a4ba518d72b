"""`flux-gen --replay PNG`: the options of the call that made a flux-gen PNG, from its provenance record.

The record gives every setting that shapes the pixels (`REPLAYED`; given beside --replay they are refused,
not ignored), the whole batch the image was made in, and the files it read: reference images, masks and LoRAs,
which must still be at their paths with the same pixels or bytes. A record the command cannot remake
(a list of prompts, embeddings, IP-Adapter image embeddings, a torch.Generator) is refused with what it was made from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from flux_runtime.cli.gen_checks import open_image
from flux_runtime.cli.gen_options import DTYPES

# What a --replay takes from the image's record; given beside --replay, these are refused, not ignored.
REPLAYED = (
    "prompt",
    "model",
    "quality",
    "attention",
    "cache",
    "steps",
    "guidance",
    "seed",
    "width",
    "height",
    "max_sequence_length",
    "dtype",
    "image",
    "num_images",
    "mask",
    "strength",
    "control_image",
    "negative_prompt",
    "true_cfg",
    "max_area",
    "no_auto_resize",
    "lora",
    "controlnet",
    "control_mode",
    "control_range",
    "ip_adapter",
    "ip_image",
    "negative_ip_image",
    "ip_image_encoder",
    "no_upsample",
    "prompt_upsampler",
    "upsampler_prompts",
    "boxes",
    "redux",
    "redux_image_encoder",
    "redux_scale",
    "redux_pooled_scale",
)
# the options the record holds as they were given: option -> the record's key
RECORDED = {
    "prompt": "prompt",
    "model": "model",
    "quality": "quality",
    "steps": "num_steps",
    "guidance": "guidance",
    "seed": "seed",
    "width": "width",
    "height": "height",
    "max_sequence_length": "max_sequence_length",
}
# the click parameters of the options whose parameter is not named as the option
PARAMETERS = {"lora": "loras", "controlnet": "controlnets", "control_mode": "control_modes"}
# the input images the record names: its role for each -> the option
INPUT_ROLES = (("image", "image"), ("mask_image", "mask"), ("control_image", "control_image"))
IP_ROLES = (("ip_adapter_image", "ip_image"), ("negative_ip_adapter_image", "negative_ip_image"))


def apply_replay(opts: dict[str, Any], ctx: click.Context) -> None:
    """Take the recorded settings from the --replay PNG; refuse options beside it that it would override."""
    from flux_runtime.pipeline.provenance import read_provenance

    given = [
        name
        for name in REPLAYED
        if ctx.get_parameter_source(PARAMETERS.get(name, name))
        in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise click.ClickException(
            f"--replay takes {flags} from the image it remakes; drop {'it' if len(given) == 1 else 'them'} "
            "(or generate without --replay)"
        )
    png = opts["replay"]
    rec = read_provenance(png)
    if not isinstance(rec["prompt"], str) and not (rec["prompt"] is None and "redux" in rec):
        raise click.ClickException(
            f"cannot replay {png}: it was made from a list of prompts or from embeddings"
        )
    if rec["seed"] is None:
        raise click.ClickException(f"cannot replay {png}: it was made with a torch.Generator, not a seed")
    opts.update(
        {option: rec[key] for option, key in RECORDED.items()},
        dtype={v: k for k, v in DTYPES.items()}[rec["dtype"]],
        fp8=bool(rec.get("fp8_at_load", False)),
        fp8_text=bool(rec.get("fp8_text", False)),
        image=_replay_images(png, rec.get("reference_images") or []),
        negative_prompt=rec.get("negative_prompt"),
        true_cfg=rec.get("true_cfg_scale", 1.0),
        strength=rec.get("strength"),
        # FP8 attention where the image had it (insisted on: a replay that cannot run it says so)
        attention="fa3-fp8" if "fa3-fp8" in str(rec.get("attention", "")) else "sdpa",
        # the step cache's policy in full (a record from before step caching ran none)
        cache=rec["cache"]["spec"] if isinstance(rec.get("cache"), dict) else None,
    )
    if rec.get("reference_crop"):  # FLUX.3 cropped back to its reference: the size comes from it again
        opts.update(width=None, height=None)
    if rec.get("variant") == "kontext":  # the recorded size is the rescaled one: keep it as the area
        opts.update(max_area=rec["width"] * rec["height"], no_auto_resize=rec.get("auto_resize") is False)
    inputs = rec.get("input_images") or {}
    for role, opt in INPUT_ROLES:
        if role in inputs:
            (path,) = _replay_images(png, [inputs[role]])
            opts[opt] = (path,) if opt in ("image", "control_image") else path
    if "upsample" in rec:  # FLUX.3: the caption that was encoded, never the upsampler again
        opts["_upsampled_prompt"] = rec.get("upsampled_prompt")
        opts["no_upsample"] = rec.get("upsampled_prompt") is None
    if "redux" in rec:
        opts.update(_replay_redux(png, rec["redux"]))
    opts["_loras"] = _replay_loras(png, rec.get("loras") or [])
    _replay_controlnets(png, rec.get("controlnets") or [], opts)
    if rec.get("ip_adapter_image_embeds"):  # fingerprinted, but the tensors are not in the PNG
        roles = " and ".join(rec["ip_adapter_image_embeds"])
        raise click.ClickException(
            f"cannot replay {png}: its IP-Adapter image prompt was given as embeddings ({roles}), which the "
            "record fingerprints but cannot re-create; generate again with --ip-image instead"
        )
    if rec.get("ip_adapter") is not None:
        opts["_ip_adapter"] = _replay_ip_adapter(png, rec["ip_adapter"])
    ip_images = rec.get("ip_adapter_images") or {}
    for role, opt in IP_ROLES:
        if role in ip_images:
            (opts[opt],) = _replay_images(png, [ip_images[role]])
    opts["_replay_weights"] = rec.get("weights")
    opts["_replay_index"] = rec.get("index", 0)
    # the whole recorded batch runs again: a batch's size changes its GEMMs' rounding, so image i of a
    # smaller batch is not image i of the recorded one (by one level in some pixels on the CPU)
    opts["_replay_batch"] = rec.get("num_images", opts["_replay_index"] + 1)
    served = rec.get("served_batch")  # flux-serve ran this image in one call with other requests' images
    opts["_served_batch"] = served if isinstance(served, int) and not isinstance(served, bool) else None


def _replay_redux(png: Path, redux: dict[str, Any]) -> dict[str, Any]:
    """The FLUX.1 Redux options a PNG was made with: its files, unchanged since (by their fingerprint), its
    images, and one scale of each kind for all of them (what --redux-scale gives)."""
    from flux_runtime.weights.redux import find_redux

    files = find_redux(redux["path"], redux["image_encoder"])
    if files.weights_id() != redux["weights"]:
        raise click.ClickException(f"cannot replay {png}: its Redux {redux['path']} has changed since")
    scales = {}
    for option, key in (
        ("redux_scale", "prompt_embeds_scale"),
        ("redux_pooled_scale", "pooled_prompt_embeds_scale"),
    ):
        if len(set(redux[key])) != 1:
            raise click.ClickException(f"cannot replay {png}: its Redux images had different {key}s")
        scales[option] = redux[key][0]
    return {
        "redux": redux["path"],
        "redux_image_encoder": redux["image_encoder"],
        "image": _replay_images(png, redux["images"]),
        **scales,
    }


def _replay_ip_adapter(png: Path, recorded: dict[str, Any]) -> tuple[str, Any, str]:
    """The IP-Adapter a PNG was made with, (path, scale, image encoder), its file still there with the same
    bytes."""
    import hashlib

    path = Path(recorded["path"])
    if not path.is_file():
        raise click.ClickException(f"cannot replay {png}: its IP-Adapter {path} is gone")
    if hashlib.sha256(path.read_bytes()).hexdigest() != recorded["sha256"]:
        raise click.ClickException(f"cannot replay {png}: its IP-Adapter {path} has changed since")
    return str(path), recorded["scale"], recorded["image_encoder"]


def _replay_loras(png: Path, recorded: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """The LoRAs a PNG was made with, each still at its path with the same bytes."""
    import hashlib

    out = []
    for lo in recorded:
        path = Path(lo["path"])
        if not path.is_file():
            raise click.ClickException(f"cannot replay {png}: its LoRA {path} is gone")
        if hashlib.sha256(path.read_bytes()).hexdigest() != lo["sha256"]:
            raise click.ClickException(f"cannot replay {png}: its LoRA {path} has changed since")
        out.append((str(path), float(lo["scale"])))
    return out


def _replay_controlnets(png: Path, recorded: list[dict[str, Any]], opts: dict[str, Any]) -> None:
    """The ControlNets a PNG was made with (each still at its path with the same files), their control images
    (the same pixels), scales, modes and step fraction, into `opts`."""
    if not recorded:
        return
    from flux_runtime.weights.controlnet import controlnet_files
    from flux_runtime.weights.errors import WeightsError
    from flux_runtime.weights.safetensors_io import files_fingerprint

    nets = []
    for net in recorded:
        if not net.get("path"):
            raise click.ClickException(
                f"cannot replay {png}: a ControlNet was passed in memory, not from a path"
            )
        try:
            files, _ = controlnet_files(net["path"])
        except WeightsError:
            raise click.ClickException(f"cannot replay {png}: its ControlNet {net['path']} is gone") from None
        if files_fingerprint(files) != net.get("weights"):
            raise click.ClickException(f"cannot replay {png}: its ControlNet {net['path']} has changed since")
        nets.append((net["path"], float(net["scale"])))
    fractions = {(net["guidance_start"], net["guidance_end"]) for net in recorded}
    if len(fractions) > 1:
        raise click.ClickException(
            f"cannot replay {png}: its ControlNets acted over different fractions of the steps, which "
            "--control-range cannot say"
        )
    ((start, end),) = fractions
    opts.update(
        _controlnets=nets,
        control_image=_replay_images(png, [net["image"] for net in recorded]),
        control_modes=tuple("none" if net.get("mode") is None else str(net["mode"]) for net in recorded),
        control_range=(start, end),
    )


def _replay_images(png: Path, recorded: list[dict[str, Any]]) -> tuple[Path, ...]:
    """The reference images a FLUX.2 PNG was made from, each still at its path with the same pixels."""
    from flux_runtime.pipeline.provenance import image_fingerprint

    paths = []
    for k, ref in enumerate(recorded):
        if not ref.get("path"):
            raise click.ClickException(
                f"cannot replay {png}: reference image {k} was passed in memory, not as a file"
            )
        path = Path(ref["path"])
        if not path.is_file():
            raise click.ClickException(f"cannot replay {png}: its reference image {path} is gone")
        if image_fingerprint(open_image(path)) != ref.get("sha256"):
            raise click.ClickException(f"cannot replay {png}: its reference image {path} has changed since")
        paths.append(path)
    return tuple(paths)
