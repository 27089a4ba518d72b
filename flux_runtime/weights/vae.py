"""`load_vae`: the FLUX.1 or FLUX.2 autoencoder from a BFL file, a diffusers folder, or a cached model id.

The family and the layout are read from the keys present, never from file names: FLUX.2's VAE is the
one with the latent BatchNorm (`bn.running_mean`, same name in both layouts). Channels, levels and
resnets per level come from the tensor shapes; a diffusers folder's `config.json` also decides the
GroupNorm groups and the latent normalisation (FLUX.1's scale/shift factors, FLUX.2's BatchNorm eps),
and must agree with the shapes. A BFL `ae.safetensors` stores neither, so it gets BFL's 32 groups and
its family's fixed values unless `config=` says otherwise. The model is built on the meta device, each
tensor is streamed to the target device and dtype, and the match is strict: missing, unexpected and
misshapen keys are named (FLUX.2's optional BatchNorm counter `bn.num_batches_tracked` aside).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from flux_runtime.models.vae.flux1 import FLUX1_VAE, VAE_PRESETS, Flux1VAE, VAEConfig
from flux_runtime.models.vae.flux2 import FLUX2_VAE, FLUX2_VAE_PRESETS, PATCH, Flux2VAE, Flux2VAEConfig
from flux_runtime.registry import MODELS
from flux_runtime.weights import vae2_layout, vae_layout
from flux_runtime.weights.builtin import BUILTINS
from flux_runtime.weights.checks import FiniteCheck, check_device, check_load_dtype, check_weight_dtypes
from flux_runtime.weights.config_files import (
    BOOL,
    INT,
    INT_LIST,
    NUMBER,
    STR,
    STR_LIST,
    Kind,
    check_fields,
    read_json_object,
)
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_layout import count_blocks
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.keys import KeyView, ShapeOf, need_shape, raise_key_errors, strip_prefix
from flux_runtime.weights.random_init import init_random
from flux_runtime.weights.safetensors_io import TensorSource, component_files

log = logging.getLogger(__name__)

Family = Literal["flux1", "flux2"]
AnyVAEConfig = VAEConfig | Flux2VAEConfig
AnyVAE = Flux1VAE | Flux2VAE

# Random-weight presets that need no checkpoint (the offline demo and tests), name → seed.
BUILTIN = {s.name: s.seed for s in MODELS.values() if s.builtin and not s.trained}
BUILTIN_NAMES = {s.name for s in MODELS.values() if s.builtin}
_PRESETS: dict[str, AnyVAEConfig] = {**VAE_PRESETS, **FLUX2_VAE_PRESETS}

FAMILY_NAMES: dict[Family, str] = {"flux1": "FLUX.1", "flux2": "FLUX.2"}
_BFL_STARTS = ("encoder.down.", "encoder.mid.", "decoder.up.", "decoder.mid.")
_DIFFUSERS_STARTS = ("encoder.down_blocks.", "encoder.mid_block.", "decoder.up_blocks.", "decoder.mid_block.")
# Quant convs without the latent BatchNorm: an SD-style autoencoder, neither FLUX.1 nor FLUX.2.
_QUANT_KEYS = (
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
# diffusers' AutoencoderKLFlux2 defaults (its signature: FLUX.2's own values).
_FLUX2_DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "decoder_block_out_channels": None,
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 32,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "mid_block_add_attention": True,
    "batch_norm_eps": 1e-4,
    "batch_norm_momentum": 0.1,
    "patch_size": [2, 2],
}

# The kinds of the config.json fields `config_from_diffusers` reads, for both families.
_CONFIG_FIELDS: dict[str, Kind] = {
    "_class_name": STR,
    "in_channels": INT,
    "out_channels": INT,
    "block_out_channels": INT_LIST,
    "decoder_block_out_channels": INT_LIST.or_null(),
    "layers_per_block": INT,
    "latent_channels": INT,
    "norm_num_groups": INT,
    "act_fn": STR,
    "down_block_types": STR_LIST,
    "up_block_types": STR_LIST,
    "use_quant_conv": BOOL,
    "use_post_quant_conv": BOOL,
    "mid_block_add_attention": BOOL,
    "scaling_factor": NUMBER,
    "shift_factor": NUMBER.or_null(),
    "batch_norm_eps": NUMBER,
    "patch_size": INT_LIST,
}


def find_vae_files(path: Path) -> list[Path]:
    """The safetensors files holding the VAE under `path` (file, `vae/` folder, pipeline or BFL repo root)."""
    return component_files(path, "vae", _is_vae_key, "VAE", single="ae.safetensors", named="ae.safetensors")


def _is_vae_key(key: str) -> bool:
    return _strip(key) == "encoder.conv_in.weight"


def _strip(key: str) -> str:
    return strip_prefix(key, vae_layout.PREFIXES)


def detect_vae_family(keys: list[str]) -> Family:
    """'flux2' when the keys (prefixes stripped) hold the latent BatchNorm, else 'flux1'.

    Quant convs without a BatchNorm belong to neither (an SD-style autoencoder) and are refused.
    """
    if vae2_layout.is_flux2(keys):
        return "flux2"
    quant = [k for k in _QUANT_KEYS if k in keys]
    if quant:
        raise WeightsError(
            f"not a FLUX VAE: it has {', '.join(quant)} but no latent BatchNorm (bn.running_mean), "
            "so it is an SD-style autoencoder; only the FLUX.1 and FLUX.2 autoencoders are supported"
        )
    return "flux1"


def detect_vae_layout(keys: list[str], family: Family = "flux1") -> str:
    """'bfl' or 'diffusers', from the keys present (prefixes already stripped); the same for both families."""
    if any(k.startswith(_BFL_STARTS) for k in keys):
        return "bfl"
    if any(k.startswith(_DIFFUSERS_STARTS) for k in keys):
        return "diffusers"
    sample = ", ".join(sorted(keys)[:5]) or "no keys at all"
    raise WeightsError(
        f"unknown checkpoint layout: not a {FAMILY_NAMES[family]} VAE in BFL or diffusers form "
        f"(keys: {sample}, ...)"
    )


def infer_vae_shapes(layout: str, keys: list[str], shape_of: ShapeOf) -> dict[str, Any]:
    """The `SHAPE_FIELDS` of the config, read from the tensor shapes: channels, levels, resnets, latent width."""
    down, block = ("encoder.down", "block") if layout == "bfl" else ("encoder.down_blocks", "resnets")
    levels = count_blocks(keys, down)
    if levels == 0:
        raise WeightsError(f"checkpoint has no {down}.0.* keys: cannot tell the encoder's levels")
    ch, in_channels = need_shape(shape_of, "encoder.conv_in.weight", "first level's width", 4)[:2]
    widths = [
        need_shape(shape_of, f"{down}.{i}.{block}.0.conv1.weight", f"width of level {i}", 4)[0]
        for i in range(levels)
    ]
    if any(w % ch for w in widths):
        raise WeightsError(
            f"level widths {tuple(widths)} are not multiples of the first conv's {ch} channels"
        )
    return {
        "in_channels": in_channels,
        "out_ch": need_shape(shape_of, "decoder.conv_out.weight", "output channels", 4)[0],
        "ch": ch,
        "ch_mult": tuple(w // ch for w in widths),
        "num_res_blocks": count_blocks(keys, f"{down}.0.{block}"),
        "z_channels": need_shape(shape_of, "decoder.conv_in.weight", "latent channels", 4)[1],
    }


def config_from_diffusers(cfg: dict[str, Any], where: Path | str, family: Family = "flux1") -> AnyVAEConfig:
    """Our config from a diffusers config.json: `AutoencoderKL` for FLUX.1, `AutoencoderKLFlux2` for FLUX.2.

    The class's own defaults fill absent fields. Raises `WeightsError` for what the family's VAE does
    not have (quant convs present or missing, other block types, another activation, no mid-block
    attention; for FLUX.2 also a decoder wider than the encoder or patches other than 2x2).
    """
    check_fields(cfg, _CONFIG_FIELDS, where)
    flux2 = family == "flux2"
    c = {**(_FLUX2_DIFFUSERS_DEFAULTS if flux2 else _DIFFUSERS_DEFAULTS), **cfg}
    cls = "AutoencoderKLFlux2" if flux2 else "AutoencoderKL"
    name = c.get("_class_name", cls)
    problems = []
    if name != cls:
        problems.append(f"_class_name is {name!r}, not {cls!r}")
    for key, want in (
        ("use_quant_conv", flux2),
        ("use_post_quant_conv", flux2),
        ("mid_block_add_attention", True),
    ):
        if bool(c[key]) != want:
            problems.append(f"{key} is {c[key]} (the {FAMILY_NAMES[family]} VAE has {want})")
    if flux2:
        decoder = c["decoder_block_out_channels"]
        if decoder is not None and list(decoder) != list(c["block_out_channels"]):
            problems.append(
                f"decoder_block_out_channels is {list(decoder)} (BFL's decoder mirrors block_out_channels)"
            )
        if list(c["patch_size"]) != [PATCH, PATCH]:
            problems.append(f"patch_size is {list(c['patch_size'])} (the FLUX.2 pipelines patchify 2x2)")
    if c["act_fn"] != "silu":
        problems.append(f"act_fn is {c['act_fn']!r}, not 'silu'")
    n = len(c["block_out_channels"])
    for key, want in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
        got = list(c.get(key, [want] * n))
        if got != [want] * n:
            problems.append(f"{key} is {got}, expected {n} x {want!r}")
    if problems:
        raise WeightsError(f"{where}: not a {FAMILY_NAMES[family]}-style {cls}: " + "; ".join(problems))
    widths = [int(w) for w in c["block_out_channels"]]
    if not widths or any(w % widths[0] for w in widths):
        raise WeightsError(f"{where}: block_out_channels {widths} are not multiples of the first")
    try:
        shape: dict[str, Any] = dict(
            in_channels=int(c["in_channels"]),
            out_ch=int(c["out_channels"]),
            ch=widths[0],
            ch_mult=tuple(w // widths[0] for w in widths),
            num_res_blocks=int(c["layers_per_block"]),
            z_channels=int(c["latent_channels"]),
            norm_num_groups=int(c["norm_num_groups"]),
        )
        if flux2:
            # batch_norm_momentum only steers training; sample_size only diffusers' tiling
            return Flux2VAEConfig(**shape, batch_norm_eps=float(c["batch_norm_eps"]))
        return VAEConfig(
            **shape,
            scale_factor=float(c["scaling_factor"]),
            shift_factor=float(c["shift_factor"] or 0.0),
        )
    except (ValueError, TypeError) as e:
        raise WeightsError(f"{where}: {e}") from None


def build_vae(cfg: AnyVAEConfig) -> AnyVAE:
    """The model of `cfg`'s family (`Flux2VAE` for a `Flux2VAEConfig`), on the current default device."""
    return Flux2VAE(cfg) if isinstance(cfg, Flux2VAEConfig) else Flux1VAE(cfg)


def _mismatch(
    a: dict[str, Any], b: dict[str, Any], names: tuple[str, ...], a_name: str, b_name: str
) -> list[str]:
    return [f"{f}: {a_name} {a[f]}, {b_name} {b[f]}" for f in names if a[f] != b[f]]


@dataclass
class VAECheckpoint:
    """A checked VAE checkpoint: its layout, config and rule table, every key present and well shaped.

    `optional` lists the keys it has beyond the table that are allowed and not loaded (FLUX.2's
    `bn.num_batches_tracked`); a conversion copies them as they are.
    """

    files: list[Path]
    view: KeyView
    layout: str
    config: AnyVAEConfig
    table: list[vae_layout.Rule]
    optional: list[str]

    @property
    def family(self) -> Family:
        return self.config.family

    def source_key(self, rule: vae_layout.Rule) -> str:
        return rule.bfl if self.layout == "bfl" else rule.diffusers

    def read(
        self, rule: vae_layout.Rule, device: torch.device | str, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """The BFL-named tensor of `rule`, read from the file and moved to `device`/`dtype`."""
        t = self.view.get(self.source_key(rule), device, dtype)
        return t if self.layout == "bfl" else vae_layout.diffusers_to_bfl(rule, t)


def open_vae_checkpoint(path_or_id: str | Path, config: AnyVAEConfig | None = None) -> VAECheckpoint:
    """Find, identify and check a FLUX.1 or FLUX.2 VAE checkpoint without reading any tensor data."""
    files = find_vae_files(resolve(path_or_id))
    view = KeyView(TensorSource(files), vae_layout.PREFIXES)
    keys = view.keys()
    family = detect_vae_family(keys)
    layout = detect_vae_layout(keys, family)
    stated = infer_vae_shapes(layout, keys, view.shape)  # what the checkpoint itself says
    cfg: AnyVAEConfig | None = None
    folder_cfg = files[0].parent / "config.json"
    if layout == "diffusers" and folder_cfg.is_file():
        cfg = config_from_diffusers(read_json_object(folder_cfg), folder_cfg, family)
        diffs = _mismatch(asdict(cfg), stated, SHAPE_FIELDS, "config.json", "weights")
        if diffs:
            raise WeightsError(f"{folder_cfg} does not match the weights: " + "; ".join(diffs))
        stated = asdict(cfg)
    if config is not None:
        if config.family != family:
            raise WeightsError(
                f"checkpoint is a {FAMILY_NAMES[family]} VAE but config is a {type(config).__name__} "
                f"({FAMILY_NAMES[config.family]})"
            )
        diffs = _mismatch(stated, asdict(config), tuple(stated), "checkpoint", "config")
        if diffs:
            raise WeightsError("checkpoint does not match the given config: " + "; ".join(diffs))
        cfg = config
    if cfg is None:
        # a BFL file (or a bare diffusers file) states no groups, factors or eps: BFL's code fixes them
        try:
            cfg = replace(FLUX2_VAE if family == "flux2" else FLUX1_VAE, **stated)
        except ValueError as e:
            raise WeightsError(f"{e}; pass config= with the checkpoint's norm_num_groups") from None

    with torch.device("meta"):
        model = build_vae(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    layout_rules = vae2_layout.rules if family == "flux2" else vae_layout.rules
    table = list(layout_rules(cfg.ch_mult, cfg.num_res_blocks))
    assert {r.bfl for r in table} == set(expected), f"rule table disagrees with {type(model).__name__}"
    optional = [k for k in vae2_layout.OPTIONAL if k in view] if family == "flux2" else []
    ckpt = VAECheckpoint(files, view, layout, cfg, table, optional)
    used = [ckpt.source_key(r) for r in table]
    unexpected = sorted(set(keys) - set(used) - set(optional))
    raise_key_errors(sorted(k for k in used if k not in view), unexpected)
    for rule in table:
        want = expected[rule.bfl] if layout == "bfl" else vae_layout.diffusers_shape(rule, expected[rule.bfl])
        got = view.shape(ckpt.source_key(rule))
        if tuple(got) != want:
            raise WeightsError(f"{ckpt.source_key(rule)}: expected shape {want}, checkpoint has {tuple(got)}")
    for key in optional:
        if view.shape(key) != ():
            raise WeightsError(f"{key}: expected shape () (a counter), checkpoint has {view.shape(key)}")
    log.info(
        "found a %s-layout %s VAE in %s (%d files): %s",
        layout,
        FAMILY_NAMES[family],
        files[0].parent,
        len(files),
        cfg,
    )
    return ckpt


def load_vae(
    path_or_id: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: AnyVAEConfig | None = None,
) -> AnyVAE:
    """Load the FLUX.1 or FLUX.2 autoencoder, ready for inference (eval mode, no grads).

    `path_or_id`: a BFL `ae.safetensors` (optionally under a `vae.` / `first_stage_model.`
    prefix), a diffusers `vae/` folder or pipeline root (sharded or not), a Hugging Face model id in
    the local cache, or a built-in random preset (`tiny`, `tiny-flux2`). The keys decide the family:
    a `Flux2VAE` for a checkpoint with the latent BatchNorm, else a `Flux1VAE` (`.config.family` says
    which). `config` (a `VAEConfig` or `Flux2VAEConfig`) is optional; when given it must be of the
    checkpoint's family and agree with it (its shapes, and its config.json if it has one), and supplies
    what a BFL file cannot state (GroupNorm groups, latent factors, BatchNorm eps). Every tensor,
    the BatchNorm statistics included, is loaded in `dtype`, as diffusers' `torch_dtype` does. `dtype` and
    `device` are checked, and the weights' stored dtypes and values, as by `load_transformer`.
    """
    device = check_device(device)
    dtype = check_load_dtype(dtype)
    name = str(path_or_id)
    spec = BUILTINS[name] if name in BUILTIN_NAMES and not Path(path_or_id).exists() else None
    if spec is not None and config is not None and config.family != spec.vae.family:
        raise WeightsError(
            f"{name!r} is a {FAMILY_NAMES[spec.vae.family]} preset but config is a {type(config).__name__}"
        )
    if spec is not None and spec.trained:  # a shipped BFL ae.safetensors, the preset's latent factors
        path_or_id, config = spec.vae_path, config or spec.vae
    elif spec is not None:
        preset = spec.vae
        with torch.device("meta"):
            model = build_vae(config or preset)
        init_random(model, spec.spec.seed, device, dtype)
        if isinstance(model, Flux2VAE):
            _random_stats(model, spec.spec.seed, device, dtype)
        return model.eval()

    ckpt = open_vae_checkpoint(path_or_id, config)
    check_weight_dtypes(ckpt.view, [ckpt.source_key(rule) for rule in ckpt.table])
    with torch.device("meta"):
        model = build_vae(ckpt.config)
    finite = FiniteCheck()
    with ckpt.view.streaming([ckpt.source_key(rule) for rule in ckpt.table], device):
        sd = {
            rule.bfl: finite.watch(
                ckpt.source_key(rule),
                ckpt.view.path_of(ckpt.source_key(rule)),
                ckpt.read(rule, device, dtype),
            )
            for rule in ckpt.table
        }
    finite.raise_if_any()
    model.load_state_dict(sd, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def _random_stats(model: Flux2VAE, seed: int, device: torch.device, dtype: torch.dtype) -> None:
    """Seeded BatchNorm statistics for a random preset (`init_random` fills parameters, not buffers).

    Means near 0 and variances near 1, drawn on the CPU in fp32 and then moved, like `init_random`.
    """
    gen = torch.Generator().manual_seed(seed)
    n = model.config.latent_channels
    model.bn.running_mean = (0.1 * torch.randn(n, generator=gen)).to(device, dtype)
    model.bn.running_var = (1.0 + 0.2 * torch.rand(n, generator=gen)).to(device, dtype)
