"""Loading a DiT from an opened checkpoint: the steps the family loaders share (`flux1_transformer`,
`flux2_transformer`, `flux3_transformer`; none imports another).

A loader checks its arguments (`checked_load_args`), reads the checkpoint's layout and FP8 format from its keys,
infers the config, builds the model on the meta device and checks every key against it (`checked_rules`: a BFL
checkpoint's keys are the model's own names, a diffusers one's go through its layout's table), then streams each
tensor into it (`fill_model`). FLUX.2 and FLUX.3 differ only in what `DitFamily` holds, so `load_dit` is the
whole of both; FLUX.1 infers its config its own way and shares the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from flux_runtime.models.dit import DiTConfig
from flux_runtime.weights import flux1_layout, gguf_loading
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.checkpoint import (
    ConfigKeys,
    TransformerCheckpoint,
    bfl_shapes,
    finish_builtin,
    infer_dit_config,
    with_given_config,
)
from flux_runtime.weights.checks import FiniteCheck, check_device, check_load_dtype, check_weight_dtypes
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.keys import KeyView, raise_key_errors
from flux_runtime.weights.random_init import init_random
from flux_runtime.weights.safetensors_io import TensorSource

log = logging.getLogger(__name__)


def checked_load_args(
    device: torch.device | str, dtype: torch.dtype, fp8: bool
) -> tuple[torch.device, torch.dtype]:
    """`device` and `dtype` checked as every transformer load checks them (`fp8` needs bf16)."""
    device = check_device(device)
    dtype = check_load_dtype(dtype)
    fp8_layers.check_dtype(dtype, fp8)
    return device, dtype


def random_dit(
    model_cls: type[nn.Module], cfg: DiTConfig, seed: int, device: torch.device, dtype: torch.dtype, fp8: bool
) -> nn.Module:
    """A seeded random built-in model of `cfg` (drawn as `init_random` draws), quantized when `fp8`."""
    with torch.device("meta"):
        model = model_cls(cfg)
    return finish_builtin(init_random(model, seed, device, dtype), dtype, fp8)


def layout_reader(src: TensorSource, layout: str) -> KeyView | TensorSource:
    """The checkpoint's tensors under its layout's names: a BFL file's with its ComfyUI-style prefix stripped."""
    return KeyView(src, flux1_layout.BFL_PREFIXES) if layout == "bfl" else src


def detect_fp8(
    reader: KeyView | TensorSource, ckpt: TransformerCheckpoint
) -> tuple[fp8_layers.Fp8Source | None, set[str]]:
    """The checkpoint's FP8 format (None for a bf16/fp16/fp32 one) and its keys that are no model tensor
    (scales, markers)."""
    fp8_src = fp8_layers.Fp8Source.detect(reader, ckpt.folder_config, str(ckpt.files[0].parent))
    return fp8_src, fp8_src.extra_keys() if fp8_src is not None else set()


def check_table_keys(table: list[flux1_layout.Rule], keys: set[str]) -> None:
    """A diffusers checkpoint's `keys` (its model tensors') are exactly its layout table's: missing and unexpected
    ones named."""
    used = {d for r in table for d in r.diffusers}
    raise_key_errors(sorted(used - keys), sorted(keys - used))


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
    gguf: gguf_loading.GgufWeights | None,
) -> nn.Module:
    """Stream the checkpoint into `model` (on meta) through `table`, each tensor checked finite; eval, no grads.

    FP8 weights stay FP8 (or `fp8` quantizes bf16 ones as they stream in); a GGUF checkpoint's (`gguf`, found
    on the checkpoint's own reader: `reader` may be a family's wrapper of it) quantized projections stay
    quantized. `.precision` and `.quantized_at_load` record which.
    """
    finite = FiniteCheck()
    read = finite.reader(lambda k: reader.get(k, device, dtype), reader.path_of)
    if gguf is not None and fp8:
        raise WeightsError(f"{gguf.src.path}: a GGUF checkpoint is already quantized; load it without fp8")
    # read ahead in the order the rules take the tensors (an FP8 checkpoint's scales are read as asked)
    with reader.streaming([d for r in table for d in r.diffusers], device):
        if gguf is not None:
            model.precision = gguf_loading.load_state(
                model, table, read, assemble, device=device, dtype=dtype, weights=gguf, finite=finite
            )
        else:
            model.precision = fp8_layers.load_state(
                model, table, read, assemble,
                device=device, dtype=dtype, fp8=fp8_src, quantize=fp8,
            )  # fmt: skip
    finite.raise_if_any()
    model.quantized_at_load = fp8
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def check_keys(keys: set[str], expected: dict[str, tuple[int, ...]], shape_of) -> None:
    raise_key_errors(sorted(set(expected) - keys), sorted(keys - set(expected)))
    for k, want in expected.items():
        got = tuple(shape_of(k))
        if got != want:
            raise WeightsError(f"{k}: expected shape {want}, checkpoint has {got}")


def load_checked(
    model_cls: type[nn.Module],
    cfg: DiTConfig,
    layout: str,
    reader,
    *,
    keys: set[str],
    shape_of,
    table: list[flux1_layout.Rule] | None,
    split,
    assemble,
    device: torch.device,
    dtype: torch.dtype,
    fp8_src: fp8_layers.Fp8Source | None,
    fp8: bool,
    tensors=None,
) -> nn.Module:
    """The model of `cfg`, built on meta, its checkpoint checked (`checked_rules`) and streamed in (`fill_model`)
    through `tensors` (default `reader`; a GGUF file is told from `reader` itself)."""
    with torch.device("meta"):
        model = model_cls(cfg)
    table, assemble = checked_rules(
        model, layout, reader, keys=keys, shape_of=shape_of, table=table, split=split, assemble=assemble
    )
    gguf = gguf_loading.GgufWeights.of(reader)  # the checkpoint's reader: `tensors` may wrap it
    tensors = reader if tensors is None else tensors
    return fill_model(
        model, table, tensors, assemble, device=device, dtype=dtype, fp8_src=fp8_src, fp8=fp8, gguf=gguf
    )


@dataclass(frozen=True)
class DitFamily:
    """What one family's loads differ in, for `load_dit` (FLUX.2, FLUX.3) and the converter's plans.

    `layout` is the family's layout module (`detect_layout`, `bfl_depths`, `diffusers_depths`, `rules` and its two
    converters); `lacks` what another family's checkpoint lacks, for the refusal naming it; `skip` picks
    training-only tensors, skipped by name; `tensors` wraps the checkpoint's reader for the tensors to stream
    through. With `depths_count_fp8` the FP8 scales count when telling the depths (FLUX.2's rule: a scale of a
    block past the last one is then a missing block), else only the model's tensors do (FLUX.3's).
    """

    keys: ConfigKeys
    layout: ModuleType
    model: type[nn.Module]
    lacks: str
    skip: Callable[[str], bool] | None = None
    tensors: Callable[[Any], Any] | None = None
    depths_count_fp8: bool = False


def load_dit(
    ckpt: TransformerCheckpoint,
    family: DitFamily,
    *,
    device: torch.device,
    dtype: torch.dtype,
    config: DiTConfig | None,
    fp8: bool,
) -> nn.Module:
    """The `family` model of an opened checkpoint (device and dtype checked by the caller): layout and depths from
    the keys, the config from the shapes (a caller's `config` checked against it, its RoPE axes and theta used),
    every key checked, each tensor streamed to `device` in `dtype`."""
    files, src, name = ckpt.files, ckpt.source, family.keys.name
    if ckpt.family != family.keys.family:
        raise WeightsError(f"{files[0]}: not a {name} transformer ({family.lacks})")
    layout = family.layout.detect_layout(src.keys())
    reader = layout_reader(src, layout)
    fp8_src, extra = detect_fp8(reader, ckpt)
    skipped = sorted(k for k in reader.keys() if family.skip(k)) if family.skip is not None else []
    if skipped:
        log.info("%s: skipping %d training-only tensors (%s, ...)", files[0], len(skipped), skipped[0])
    keys = set(reader.keys()) - set(skipped) - extra
    depth_keys = reader.keys() if family.depths_count_fp8 else keys
    table = None  # BFL: each key is itself
    if layout == "bfl":
        depths, shape_of = family.layout.bfl_depths(depth_keys), reader.shape
    else:
        depths = family.layout.diffusers_depths(depth_keys)
        table = list(family.layout.rules(*depths))
        check_table_keys(table, keys)
        shape_of = bfl_shapes(table, src.shape)

    mine = config is not None and config.family == family.keys.family
    given_rope = (config.axes_dim, config.theta) if config is not None and mine else None
    inferred = infer_dit_config(family.keys, shape_of, depths, ckpt.folder_config, files[0], given_rope)
    inferred = with_given_config(inferred, config)
    kind = ("flow-map " if inferred.flow_map else "base ") if family.keys.flag == "flow_map" else ""
    where = files[0].parent
    log.info("loading %s-layout %s %stransformer from %s (%d files)", layout, name, kind, where, len(files))
    return load_checked(
        family.model, inferred, layout, reader, keys=keys, shape_of=shape_of, table=table,
        split=family.layout.bfl_to_diffusers, assemble=family.layout.diffusers_to_bfl,
        device=device, dtype=dtype, fp8_src=fp8_src, fp8=fp8,
        tensors=None if family.tensors is None else family.tensors(reader),
    )  # fmt: skip
