"""`load_vae`: the FLUX.1 autoencoder from a BFL file, a diffusers folder, or a cached model id.

The layout is read from the keys present, never from file names. Channels, levels and resnets per
level come from the tensor shapes; a diffusers folder's `config.json` also decides the GroupNorm
groups and the latent scale/shift factors (and must agree with the shapes). A BFL `ae.safetensors`
stores neither, so it gets BFL's 32 groups and the FLUX.1 factors unless `config=` says otherwise.
The model is built on the meta device, each tensor is streamed to the target device and dtype, and
the match is strict: missing, unexpected and misshapen keys are named.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from flux_runtime.models.vae.flux1 import FLUX1_VAE, VAE_PRESETS, Flux1VAE, VAEConfig
from flux_runtime.weights import vae_layout
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_layout import count_blocks
from flux_runtime.weights.hub import resolve, safetensors_files
from flux_runtime.weights.random_init import init_random
from flux_runtime.weights.safetensors_io import TensorSource, read_header

log = logging.getLogger(__name__)

ShapeOf = Callable[[str], tuple[int, ...]]

# Random-weight presets that need no checkpoint (the offline demo and tests).
BUILTIN = {"tiny": 0}
_BFL_STARTS = ("encoder.down.", "encoder.mid.", "decoder.up.", "decoder.mid.")
_DIFFUSERS_STARTS = ("encoder.down_blocks.", "encoder.mid_block.", "decoder.up_blocks.", "decoder.mid_block.")
# Keys only the FLUX.2 autoencoder (or an SD-style VAE) has: latent BatchNorm and quant convs.
_NOT_FLUX1 = (
    "bn.running_mean",
    "quant_conv.weight",
    "post_quant_conv.weight",
    "encoder.quant_conv.weight",
    "decoder.post_quant_conv.weight",
)
# The fields a shape-inferred config can be trusted for; the rest come from config.json or defaults.
SHAPE_FIELDS = ("in_channels", "out_ch", "ch", "ch_mult", "num_res_blocks", "z_channels")
# diffusers' AutoencoderKL defaults, which it applies to fields a config.json leaves out.
_DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": [64],
    "layers_per_block": 1,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 32,
    "scaling_factor": 0.18215,
    "shift_factor": None,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "mid_block_add_attention": True,
}


def find_vae_files(path: Path) -> list[Path]:
    """The safetensors files holding the VAE under `path` (file, `vae/` folder, pipeline or BFL repo root)."""
    if path.is_file():
        return [path]
    if (path / "vae").is_dir():
        return find_vae_files(path / "vae")
    files = safetensors_files(path, "diffusion_pytorch_model")
    if files:
        return files
    if (path / "ae.safetensors").is_file():
        return [path / "ae.safetensors"]
    for f in sorted(path.glob("*.safetensors")):
        if any(_strip(k) == "encoder.conv_in.weight" for k in read_header(f)):
            return [f]
    raise WeightsError(
        f"{path}: no VAE found (no vae/ folder, no diffusion_pytorch_model*.safetensors, no ae.safetensors)"
    )


def _strip(key: str) -> str:
    for p in vae_layout.PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return key


class KeyView:
    """A TensorSource seen through one component's own names.

    When some keys carry one of `prefixes` (`vae.`, `model.diffusion_model.`, ...), the file holds
    several components: only the keys under the first such prefix are kept, with it stripped.
    Otherwise every key is kept as is.
    """

    def __init__(self, src: TensorSource, prefixes: tuple[str, ...]) -> None:
        self.src = src
        keys = src.keys()
        self.names = {k: k for k in keys}
        for p in prefixes:
            if any(k.startswith(p) for k in keys):
                self.names = {k[len(p) :]: k for k in keys if k.startswith(p)}
                if len(self.names) < len(keys):
                    log.info(
                        "reading the %d keys under %r, ignoring %d others",
                        len(self.names),
                        p,
                        len(keys) - len(self.names),
                    )
                break

    def keys(self) -> list[str]:
        return list(self.names)

    def __contains__(self, key: str) -> bool:
        return key in self.names

    def shape(self, key: str) -> tuple[int, ...]:
        return self.src.shape(self.names[key])

    def get(
        self, key: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        return self.src.get(self.names[key], device, dtype)


def detect_vae_layout(keys: list[str]) -> str:
    """'bfl' or 'diffusers', from the keys present (prefixes already stripped)."""
    flux2 = [k for k in _NOT_FLUX1 if k in keys]
    if flux2:
        raise WeightsError(
            f"not a FLUX.1 VAE: it has {', '.join(flux2)} (the FLUX.2 or an SD-style autoencoder); "
            "only the FLUX.1 autoencoder is supported"
        )
    if any(k.startswith(_BFL_STARTS) for k in keys):
        return "bfl"
    if any(k.startswith(_DIFFUSERS_STARTS) for k in keys):
        return "diffusers"
    sample = ", ".join(sorted(keys)[:5]) or "no keys at all"
    raise WeightsError(
        f"unknown checkpoint layout: not a FLUX.1 VAE in BFL or diffusers form (keys: {sample}, ...)"
    )


def _need(shape_of: ShapeOf, key: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(shape_of(key))
    except KeyError:
        raise WeightsError(f"checkpoint has no {key!r} (needed to read the {what})") from None


def infer_vae_shapes(layout: str, keys: list[str], shape_of: ShapeOf) -> dict[str, Any]:
    """The `SHAPE_FIELDS` of the config, read from the tensor shapes: channels, levels, resnets, latent width."""
    down, block = ("encoder.down", "block") if layout == "bfl" else ("encoder.down_blocks", "resnets")
    levels = count_blocks(keys, down)
    if levels == 0:
        raise WeightsError(f"checkpoint has no {down}.0.* keys: cannot tell the encoder's levels")
    ch, in_channels = _need(shape_of, "encoder.conv_in.weight", "first level's width")[:2]
    widths = [
        _need(shape_of, f"{down}.{i}.{block}.0.conv1.weight", f"width of level {i}")[0] for i in range(levels)
    ]
    if any(w % ch for w in widths):
        raise WeightsError(
            f"level widths {tuple(widths)} are not multiples of the first conv's {ch} channels"
        )
    return {
        "in_channels": in_channels,
        "out_ch": _need(shape_of, "decoder.conv_out.weight", "output channels")[0],
        "ch": ch,
        "ch_mult": tuple(w // ch for w in widths),
        "num_res_blocks": count_blocks(keys, f"{down}.0.{block}"),
        "z_channels": _need(shape_of, "decoder.conv_in.weight", "latent channels")[1],
    }


def config_from_diffusers(cfg: dict[str, Any], where: Path | str) -> VAEConfig:
    """Our config from a diffusers `AutoencoderKL` config.json (its defaults fill absent fields).

    Raises `WeightsError` for what the FLUX.1 VAE does not have (quant convs, other block types,
    another activation, no mid-block attention).
    """
    c = {**_DIFFUSERS_DEFAULTS, **cfg}
    name = c.get("_class_name", "AutoencoderKL")
    problems = []
    if name != "AutoencoderKL":
        problems.append(f"_class_name is {name!r}, not 'AutoencoderKL'")
    for key, want in (
        ("use_quant_conv", False),
        ("use_post_quant_conv", False),
        ("mid_block_add_attention", True),
    ):
        if bool(c[key]) != want:
            problems.append(f"{key} is {c[key]} (the FLUX.1 VAE has {want})")
    if c["act_fn"] != "silu":
        problems.append(f"act_fn is {c['act_fn']!r}, not 'silu'")
    n = len(c["block_out_channels"])
    for key, want in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
        got = list(c.get(key, [want] * n))
        if got != [want] * n:
            problems.append(f"{key} is {got}, expected {n} x {want!r}")
    if problems:
        raise WeightsError(f"{where}: not a FLUX.1-style AutoencoderKL: " + "; ".join(problems))
    widths = [int(w) for w in c["block_out_channels"]]
    if not widths or any(w % widths[0] for w in widths):
        raise WeightsError(f"{where}: block_out_channels {widths} are not multiples of the first")
    try:
        return VAEConfig(
            in_channels=int(c["in_channels"]),
            out_ch=int(c["out_channels"]),
            ch=widths[0],
            ch_mult=tuple(w // widths[0] for w in widths),
            num_res_blocks=int(c["layers_per_block"]),
            z_channels=int(c["latent_channels"]),
            norm_num_groups=int(c["norm_num_groups"]),
            scale_factor=float(c["scaling_factor"]),
            shift_factor=float(c["shift_factor"] or 0.0),
        )
    except (ValueError, TypeError) as e:
        raise WeightsError(f"{where}: {e}") from None


def _mismatch(
    a: dict[str, Any], b: dict[str, Any], names: tuple[str, ...], a_name: str, b_name: str
) -> list[str]:
    return [f"{f}: {a_name} {a[f]}, {b_name} {b[f]}" for f in names if a[f] != b[f]]


@dataclass
class VAECheckpoint:
    """A checked VAE checkpoint: its layout, config and rule table, every key present and well shaped."""

    files: list[Path]
    view: KeyView
    layout: str
    config: VAEConfig
    table: list[vae_layout.Rule]

    def source_key(self, rule: vae_layout.Rule) -> str:
        return rule.bfl if self.layout == "bfl" else rule.diffusers

    def read(
        self, rule: vae_layout.Rule, device: torch.device | str, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """The BFL-named tensor of `rule`, read from the file and moved to `device`/`dtype`."""
        t = self.view.get(self.source_key(rule), device, dtype)
        return t if self.layout == "bfl" else vae_layout.diffusers_to_bfl(rule, t)


def open_vae_checkpoint(path_or_id: str | Path, config: VAEConfig | None = None) -> VAECheckpoint:
    """Find, identify and check a VAE checkpoint without reading any tensor data."""
    files = find_vae_files(resolve(path_or_id))
    view = KeyView(TensorSource(files), vae_layout.PREFIXES)
    keys = view.keys()
    layout = detect_vae_layout(keys)
    stated = infer_vae_shapes(layout, keys, view.shape)  # what the checkpoint itself says
    cfg: VAEConfig | None = None
    folder_cfg = files[0].parent / "config.json"
    if layout == "diffusers" and folder_cfg.is_file():
        try:
            raw = json.loads(folder_cfg.read_text())
        except json.JSONDecodeError as e:
            raise WeightsError(f"{folder_cfg}: not valid JSON ({e})") from None
        cfg = config_from_diffusers(raw, folder_cfg)
        diffs = _mismatch(asdict(cfg), stated, SHAPE_FIELDS, "config.json", "weights")
        if diffs:
            raise WeightsError(f"{folder_cfg} does not match the weights: " + "; ".join(diffs))
        stated = asdict(cfg)
    if config is not None:
        diffs = _mismatch(stated, asdict(config), tuple(stated), "checkpoint", "config")
        if diffs:
            raise WeightsError("checkpoint does not match the given config: " + "; ".join(diffs))
        cfg = config
    if cfg is None:
        # a BFL file (or a bare diffusers file) states no groups or factors: BFL's code fixes them
        try:
            cfg = replace(FLUX1_VAE, **stated)
        except ValueError as e:
            raise WeightsError(f"{e}; pass config= with the checkpoint's norm_num_groups") from None

    with torch.device("meta"):
        model = Flux1VAE(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    table = list(vae_layout.rules(cfg.ch_mult, cfg.num_res_blocks))
    assert {r.bfl for r in table} == set(expected), "vae_layout.rules disagrees with Flux1VAE"
    ckpt = VAECheckpoint(files, view, layout, cfg, table)
    used = [ckpt.source_key(r) for r in table]
    _raise_key_errors(sorted(k for k in used if k not in view), sorted(set(keys) - set(used)))
    for rule in table:
        want = expected[rule.bfl] if layout == "bfl" else vae_layout.diffusers_shape(rule, expected[rule.bfl])
        got = view.shape(ckpt.source_key(rule))
        if tuple(got) != want:
            raise WeightsError(f"{ckpt.source_key(rule)}: expected shape {want}, checkpoint has {tuple(got)}")
    log.info("found a %s-layout FLUX.1 VAE in %s (%d files): %s", layout, files[0].parent, len(files), cfg)
    return ckpt


def _raise_key_errors(missing: list[str], unexpected: list[str]) -> None:
    def few(ks: list[str]) -> str:
        return ", ".join(ks[:5]) + (f" (+{len(ks) - 5} more)" if len(ks) > 5 else "")

    if missing:
        raise WeightsError(f"checkpoint is missing {len(missing)} key(s): {few(missing)}")
    if unexpected:
        raise WeightsError(f"checkpoint has {len(unexpected)} unexpected key(s): {few(unexpected)}")


def load_vae(
    path_or_id: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: VAEConfig | None = None,
) -> Flux1VAE:
    """Load the FLUX.1 autoencoder, ready for inference (eval mode, no grads).

    `path_or_id`: a BFL `ae.safetensors` (optionally under a `vae.` / `first_stage_model.`
    prefix), a diffusers `vae/` folder or pipeline root (sharded or not), a Hugging Face model id in
    the local cache, or a built-in random preset (`tiny`). `config` is optional; when given it must
    agree with the checkpoint (its shapes, and its config.json if it has one) and supplies what a BFL
    file cannot state (GroupNorm groups, latent factors).
    """
    device = torch.device(device)
    name = str(path_or_id)
    if name in BUILTIN and not Path(path_or_id).exists():
        with torch.device("meta"):
            model = Flux1VAE(config or VAE_PRESETS[name])
        return init_random(model, BUILTIN[name], device, dtype).eval()

    ckpt = open_vae_checkpoint(path_or_id, config)
    with torch.device("meta"):
        model = Flux1VAE(ckpt.config)
    sd = {rule.bfl: ckpt.read(rule, device, dtype) for rule in ckpt.table}
    model.load_state_dict(sd, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
