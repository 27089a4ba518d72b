"""A transformer checkpoint opened once: its files, their headers, and the family its keys say.

`open_transformer` finds the safetensors files of a path or cached id, reads their headers (once) and
tells FLUX.1, FLUX.2 and FLUX.3 apart by the keys; the family loaders (`flux{1,2,3}_transformer`)
take the opened checkpoint, so a pipeline that asked for the family first reads no header twice.
The helpers the loaders share to read a config (inference from key tables, checks against a caller's config)
live here, their loading steps in `dit_loading`, so no loader imports another.
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
from flux_runtime.registry import ModelSpec, builtin
from flux_runtime.weights import flux1_layout, flux2_layout, flux3_layout
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.config_files import INT_LIST, NUMBER, check_fields, read_json_if_present
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.gguf_file import GgufSource, is_gguf_file
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.keys import need_shape
from flux_runtime.weights.safetensors_io import TensorSource, component_files

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
    source: TensorSource | GgufSource = field(repr=False)
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
    path = resolve(path_or_id)
    if is_gguf_file(path):  # llama.cpp's container (city96's quantizations): kept quantized at load
        files, source = [path], GgufSource(path)
    else:
        files = find_transformer_files(path)
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


def builtin_spec(path_or_id: str | Path | TransformerCheckpoint) -> ModelSpec | None:
    """The registry's built-in model `path_or_id` names; None for anything else (an opened checkpoint too)."""
    return None if isinstance(path_or_id, TransformerCheckpoint) else builtin(path_or_id)


def as_checkpoint(path_or_id: str | Path | TransformerCheckpoint) -> TransformerCheckpoint:
    """`path_or_id` opened (`open_transformer`), unless it already is."""
    return path_or_id if isinstance(path_or_id, TransformerCheckpoint) else open_transformer(path_or_id)


def find_transformer_files(path: Path) -> list[Path]:
    """The safetensors files holding the transformer under `path` (file, component or pipeline folder, or a BFL
    repo root: its single file whose keys look like a FLUX DiT)."""
    return component_files(path, "transformer", _is_dit_key, "FLUX transformer", "BFL single file")


def _is_dit_key(key: str) -> bool:
    return flux1_layout.strip_prefix(key) in (*BFL_ANY, BFL_MARK)


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


def dit_config(where: Path | str, hidden: int, head_dim: int, mlp_hidden: int, **rest) -> DiTConfig:
    """The `DiTConfig` of these widths (heads and MLP ratio from them) and the `rest` of its fields; a config no
    FLUX model has is a WeightsError naming `where`."""
    with config_errors(where):
        return DiTConfig(
            hidden_size=hidden, mlp_ratio=mlp_hidden / hidden, num_heads=hidden // head_dim, **rest
        )


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


def read_folder_config(files: list[Path]) -> dict | None:
    """The diffusers `config.json` beside a transformer's files, its fields that we read type-checked; or None."""
    path = files[0].parent / "config.json"
    cfg = read_json_if_present(path)
    if cfg is not None:
        check_fields(cfg, CONFIG_FIELDS, path)
    return cfg


def finish_builtin(model: nn.Module, dtype: torch.dtype, fp8: bool) -> nn.Module:
    """A built-in random model, quantized when `fp8`, with its precision recorded."""
    model.precision = fp8_layers.quantize_model(model, dtype) if fp8 else fp8_layers.precision_of({}, dtype)
    model.quantized_at_load = fp8
    return model.eval()


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
    out_ch = need_shape(shape_of, table.final, "output channels", 2)[0]
    cond_in = need_shape(shape_of, table.cond_in, "reference width", 2)[1] if table.cond_in else 0
    cfg = dit_config(
        where, hidden, head_dim, mlp_hidden, family=table.family, in_channels=in_ch, out_channels=out_ch,
        cond_in_channels=cond_in, vec_in_dim=0, context_in_dim=need_shape(shape_of, table.txt_in, "text width", 2)[1],
        depth=depth, depth_single_blocks=depth_single, axes_dim=axes_dim, theta=theta, qkv_bias=False,
        guidance_embed=table.flag == "guidance_embed" and flag, flow_map=table.flag == "flow_map" and flag,
    )  # fmt: skip
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
