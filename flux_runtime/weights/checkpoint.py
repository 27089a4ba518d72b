"""A transformer checkpoint opened once: its files, their headers, and the family its keys say.

`open_transformer` finds the safetensors files of a path or cached id, reads their headers (once) and
tells FLUX.1, FLUX.2 and FLUX.3 apart by the keys; the family loaders (`flux{1,2,3}_transformer`)
take the opened checkpoint, so a pipeline that asked for the family first reads no header twice.
The helpers the loaders share (config checks and inference from key tables, key checks, identity rules,
built-in models) live here, so no loader imports another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from flux_runtime.models.dit import PRESETS, DiTConfig
from flux_runtime.registry import builtin
from flux_runtime.weights import flux1_layout, flux2_layout, flux3_layout
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.checks import FiniteCheck, check_weight_dtypes
from flux_runtime.weights.config_files import INT_LIST, NUMBER, check_fields, read_json_if_present
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve, safetensors_files
from flux_runtime.weights.keys import need_shape, raise_key_errors, strip_prefix
from flux_runtime.weights.safetensors_io import TensorSource, read_header

log = logging.getLogger(__name__)

Family = Literal["flux1", "flux2", "flux3"]
BFL_MARK = "double_blocks.0.img_attn.norm.key_norm.scale"
BFL_ANY = ("img_in.weight", "final_layer.linear.weight", "emb_in.image.weight")
# The fields of a diffusers transformer config.json the loaders read (the rest comes from the tensor shapes).
CONFIG_FIELDS = {"axes_dims_rope": INT_LIST, "rope_theta": NUMBER}

ShapeOf = Callable[[str], tuple[int, ...]]


@dataclass
class TransformerCheckpoint:
    """The files of one transformer checkpoint with their headers read (`source`) and its `family`."""

    files: list[Path]
    source: TensorSource = field(repr=False)
    family: Family

    @cached_property
    def folder_config(self) -> dict | None:
        """The diffusers `config.json` beside the files, type-checked where read; None without one."""
        return read_folder_config(self.files)

    @property
    def where(self) -> Path:
        return self.files[0]


def open_transformer(path_or_id: str | Path) -> TransformerCheckpoint:
    """Find and open the transformer under a file, folder or cached id; the family from its keys."""
    files = find_transformer_files(resolve(path_or_id))
    source = TensorSource(files)
    keys = source.keys()
    family: Family = (
        "flux3" if flux3_layout.is_flux3(keys) else "flux2" if flux2_layout.is_flux2(keys) else "flux1"
    )
    return TransformerCheckpoint(files, source, family)


def transformer_family(path_or_id: str | Path | TransformerCheckpoint) -> Family:
    """FLUX.1, FLUX.2 or FLUX.3: a built-in model's registry entry, else the checkpoint's keys (headers only)."""
    if isinstance(path_or_id, TransformerCheckpoint):
        return path_or_id.family
    spec = builtin(path_or_id)
    if spec is not None:
        return spec.family
    return open_transformer(path_or_id).family


def find_transformer_files(path: Path) -> list[Path]:
    """The safetensors files holding the transformer under `path` (file, component or pipeline folder)."""
    if path.is_file():
        return [path]
    if (path / "transformer").is_dir():
        return find_transformer_files(path / "transformer")
    files = safetensors_files(path, "diffusion_pytorch_model")
    if files:
        return files
    # A BFL repo root: the transformer is the single file whose keys look like a FLUX DiT.
    for f in sorted(path.glob("*.safetensors")):
        keys = read_header(f)
        if any(_strip(k) in (*BFL_ANY, BFL_MARK) for k in keys):
            return [f]
    raise WeightsError(
        f"{path}: no FLUX transformer found (no transformer/ folder, no diffusion_pytorch_model*.safetensors, no BFL single file)"
    )


def _strip(key: str) -> str:
    return strip_prefix(key, flux1_layout.BFL_PREFIXES)


@contextmanager
def config_errors(where: Path | str) -> Iterator[None]:
    """Turn `DiTConfig`'s ValueError (shapes or config.json values no FLUX model has) into a WeightsError naming `where`."""
    try:
        yield
    except WeightsError:
        raise
    except ValueError as e:
        raise WeightsError(
            f"{where}: the checkpoint's shapes and config.json give no valid model ({e})"
        ) from None


def check_config(inferred: DiTConfig, given: DiTConfig) -> None:
    diffs = [
        f"{f.name}: checkpoint {getattr(inferred, f.name)}, config {getattr(given, f.name)}"
        for f in fields(DiTConfig)
        if f.name not in ("axes_dim", "theta") and getattr(inferred, f.name) != getattr(given, f.name)
    ]
    if diffs:
        raise WeightsError("checkpoint does not match the given config: " + "; ".join(diffs))


def with_given_config(inferred: DiTConfig, given: DiTConfig | None) -> DiTConfig:
    """`inferred` checked against a caller's `given` config (every field but the RoPE ones), then with `given`'s
    RoPE axes and theta (the weights do not state them); `inferred` itself without one."""
    if given is None:
        return inferred
    check_config(inferred, given)
    return replace(inferred, axes_dim=given.axes_dim, theta=given.theta)


def checked_rules(
    model: nn.Module,
    layout: str,
    reader,
    *,
    keys: set[str],
    shape_of,
    table: list[flux1_layout.Rule] | None = None,
    split=None,
    assemble=None,
) -> tuple[list[flux1_layout.Rule], Callable]:
    """The rules and `assemble` that fill `model` (on meta) from `reader`, after the checks of its layout.

    BFL (`layout` "bfl"): `keys` (the checkpoint's, less FP8 scales and skipped ones) must be the model's own,
    each of the shape `shape_of` gives, every weight stored floating point; each key is then itself. Diffusers:
    each tensor of the layout's `table` must have the shape `split` gives it, and be floating point; `assemble`
    builds our tensors from them (the caller has already named missing and unexpected keys).
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if layout == "bfl":
        check_keys(keys, expected, shape_of)
        check_weight_dtypes(reader, expected)
        return identity_rules(expected), take_only
    assert table is not None and split is not None and assemble is not None
    check_part_shapes(table, expected, reader.shape, split)
    check_weight_dtypes(reader, sorted({d for r in table for d in r.diffusers}))
    return table, assemble


def read_folder_config(files: list[Path]) -> dict | None:
    """The diffusers `config.json` beside a transformer's files, its fields that we read type-checked; or None."""
    path = files[0].parent / "config.json"
    cfg = read_json_if_present(path)
    if cfg is not None:
        check_fields(cfg, CONFIG_FIELDS, path)
    return cfg


def identity_rules(expected: dict[str, tuple[int, ...]]) -> list[flux1_layout.Rule]:
    """Rules for a checkpoint stored under our own (BFL) names: each key is itself."""
    return [flux1_layout.Rule(k, (k,)) for k in expected]


def take_only(rule: flux1_layout.Rule, get) -> torch.Tensor:
    """`assemble` for identity rules."""
    return get(rule.diffusers[0])


def check_part_shapes(
    table: list[flux1_layout.Rule],
    expected: dict[str, tuple[int, ...]],
    shape_of,
    split,
) -> None:
    """Each diffusers tensor has the shape that splitting the model's (BFL-named) tensor the layout's way gives."""
    for rule in table:
        meta = torch.empty(expected[rule.bfl], device="meta")
        for d, part in split(rule, meta).items():
            if shape_of(d) != tuple(part.shape):
                raise WeightsError(
                    f"{d}: expected shape {tuple(part.shape)}, checkpoint has {shape_of(d)} (part of {rule.bfl})"
                )


def fill_model(
    model: nn.Module,
    table: list[flux1_layout.Rule],
    reader,
    assemble,
    *,
    device: torch.device,
    dtype: torch.dtype,
    fp8_src: fp8_layers.Fp8Source | None,
    fp8: bool,
) -> nn.Module:
    """Stream the checkpoint into `model` (on meta) through `table`, each tensor checked finite; eval, no grads.

    FP8 weights stay FP8 (or `fp8` quantizes bf16 ones as they stream in); `.precision` and
    `.quantized_at_load` record which.
    """
    finite = FiniteCheck()
    read = finite.reader(lambda k: reader.get(k, device, dtype), reader.path_of)
    # read ahead in the order the rules take the tensors (an FP8 checkpoint's scales are read as asked)
    with reader.streaming([d for r in table for d in r.diffusers], device):
        model.precision = fp8_layers.load_state(
            model, table, read, assemble,
            device=device, dtype=dtype, fp8=fp8_src, quantize=fp8,
        )  # fmt: skip
    finite.raise_if_any()
    model.quantized_at_load = fp8
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def finish_builtin(model: nn.Module, dtype: torch.dtype, fp8: bool) -> nn.Module:
    """A built-in random model, quantized when `fp8`, with its precision recorded."""
    model.precision = fp8_layers.quantize_model(model, dtype) if fp8 else fp8_layers.precision_of({}, dtype)
    model.quantized_at_load = fp8
    return model.eval()


def check_keys(keys: set[str], expected: dict[str, tuple[int, ...]], shape_of) -> None:
    raise_key_errors(sorted(set(expected) - keys), sorted(keys - set(expected)))
    for k, want in expected.items():
        got = tuple(shape_of(k))
        if got != want:
            raise WeightsError(f"{k}: expected shape {want}, checkpoint has {got}")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def rope_axes(
    head_dim: int, folder_config: dict | None, family: str, default_theta: int
) -> tuple[tuple[int, ...], int]:
    """(RoPE axes, theta) of a transformer whose keys cannot say them: a diffusers config.json's
    `axes_dims_rope` / `rope_theta` (theta defaulting to the family's), else the family's preset of this head width."""
    if folder_config and "axes_dims_rope" in folder_config:
        return tuple(folder_config["axes_dims_rope"]), int(folder_config.get("rope_theta", default_theta))
    for preset in PRESETS.values():
        if preset.family == family and preset.head_dim == head_dim:
            return preset.axes_dim, preset.theta
    raise WeightsError(f"cannot tell the RoPE axes for head dim {head_dim}; pass config= with axes_dim")


@dataclass(frozen=True)
class BlockKeys:
    """Where the first block of one kind states the head width and the MLP width (BFL names).

    The MLP width is dim 1 of `mlp_out` (the projection back to the hidden size), less the hidden size
    when `mlp_out` also takes the attention output (a single block's fused `linear2`).
    """

    qk_norm: str
    mlp_out: str
    mlp_out_has_attention: bool = False


@dataclass(frozen=True)
class ConfigKeys:
    """A family's table for `infer_dit_config`: which BFL-named tensors state which `DiTConfig` fields.

    `flag` is the field the third entry of the loaders' `depths` sets (FLUX.2: a guidance embedder,
    FLUX.3: the flow map's target-timestep embedder); `cond_in`, when named, gives `cond_in_channels`.
    """

    family: Family
    name: str
    default_theta: int
    img_in: str
    final: str
    txt_in: str
    double: BlockKeys
    single: BlockKeys
    flag: Literal["guidance_embed", "flow_map"]
    cond_in: str | None = None


def infer_dit_config(
    table: ConfigKeys,
    shape_of: ShapeOf,
    depths: tuple[int, int, bool],
    folder_config: dict | None,
    where: Path | str = "checkpoint",
    rope: tuple[tuple[int, ...], int] | None = None,
) -> DiTConfig:
    """Widths, heads and channels of a FLUX.2 / FLUX.3 DiT from the checkpoint itself, through `table`'s BFL
    key names (`where` names the checkpoint in errors).

    `depths` is (double blocks, single blocks, `table.flag`); RoPE axes and theta come from `rope` (a
    caller's, when it fits the head width), a diffusers `config.json`, else the family's preset of this
    head width (the weights do not state them).
    """
    depth, depth_single, flag = depths
    if not depth and not depth_single:
        raise WeightsError(f"{table.name} checkpoint has no transformer blocks")
    block = table.double if depth else table.single
    hidden, in_ch = need_shape(shape_of, table.img_in, "hidden size", 2)
    head_dim = need_shape(shape_of, block.qk_norm, "head dim", 1)[0]
    mlp_hidden = need_shape(shape_of, block.mlp_out, "MLP width", 2)[1]
    if block.mlp_out_has_attention:
        mlp_hidden -= hidden
    if hidden % head_dim:
        raise WeightsError(f"hidden size {hidden} is not a multiple of the QK-norm width {head_dim}")
    axes_dim, theta = (
        rope
        if rope and sum(rope[0]) == head_dim
        else rope_axes(head_dim, folder_config, table.family, table.default_theta)
    )
    with config_errors(where):
        out_ch = need_shape(shape_of, table.final, "output channels", 2)[0]
        cond_in = need_shape(shape_of, table.cond_in, "reference width", 2)[1] if table.cond_in else 0
        cfg = DiTConfig(
            family=table.family,
            in_channels=in_ch,
            out_channels=out_ch,
            cond_in_channels=cond_in,
            vec_in_dim=0,
            context_in_dim=need_shape(shape_of, table.txt_in, "text width", 2)[1],
            hidden_size=hidden,
            mlp_ratio=mlp_hidden / hidden,
            num_heads=hidden // head_dim,
            depth=depth,
            depth_single_blocks=depth_single,
            axes_dim=axes_dim,
            theta=theta,
            qkv_bias=False,
            guidance_embed=table.flag == "guidance_embed" and flag,
            flow_map=table.flag == "flow_map" and flag,
        )
    if cfg.mlp_hidden_dim != mlp_hidden:
        raise WeightsError(
            f"MLP width {mlp_hidden} is not a float-exact multiple of the hidden size {hidden}"
        )
    return cfg


def bfl_shapes(table: list[flux1_layout.Rule], diffusers_shape: ShapeOf) -> ShapeOf:
    """Shapes under BFL names for a diffusers checkpoint: a fused rule stacks its parts' rows, a one-part
    rule is its part's shape."""
    by_bfl = {r.bfl: r for r in table}

    def shape_of(key: str) -> tuple[int, ...]:
        parts = [diffusers_shape(d) for d in by_bfl[key].diffusers]
        if not all(parts):  # a 0-D part: no rows to stack (need_shape and the shape checks name it)
            return ()
        return (sum(p[0] for p in parts), *parts[0][1:])

    return shape_of
