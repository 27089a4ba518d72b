"""Planning a conversion of a FLUX transformer or VAE to the other layout, before any tensor is read.

The source is found, its family and layout read from its keys, its config inferred and every key checked
against the layout's rule table (the same tables and checks the loaders use: `flux1_layout` / `flux2_layout` /
`flux3_layout` for the transformer, `vae_layout` / `vae2_layout` for the VAE). The plan is a list of steps, one
per rule, each knowing the names, shapes and dtypes it will produce (computed by running the rule on meta
tensors) and reading its few source tensors only when run (`convert_write` runs them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from flux_runtime.models.dit import DiTConfig, Flux1Transformer
from flux_runtime.weights import flux1_layout, flux2_layout, flux3_layout, vae_layout
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.checkpoint import bfl_shapes, infer_dit_config, open_transformer, read_folder_config
from flux_runtime.weights.diffusers_config import (
    FLUX2_DIFFUSERS_FIXED,
    FLUX3_DIFFUSERS_FIXED,
    transformer_diffusers_config,
    vae_diffusers_config,
)
from flux_runtime.weights.dit_loading import DitFamily
from flux_runtime.weights.dtype_names import TORCH_DTYPES
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_transformer import detect_layout, infer_config
from flux_runtime.weights.flux2_transformer import FLUX2
from flux_runtime.weights.flux3_transformer import FLUX3
from flux_runtime.weights.gguf_file import GgufSource
from flux_runtime.weights.keys import KeyView, raise_key_errors
from flux_runtime.weights.safetensors_io import TensorSource
from flux_runtime.weights.safetensors_writer import Output
from flux_runtime.weights.vae import AnyVAEConfig, open_vae_checkpoint

log = logging.getLogger(__name__)

Component = Literal["transformer", "vae"]
COMPONENTS: tuple[Component, ...] = ("transformer", "vae")


@dataclass(frozen=True)
class Step:
    """One rule of a layout table: `run()` reads its source tensors and returns `outputs`, in order."""

    outputs: tuple[Output, ...]
    run: Callable[[], dict[str, Tensor]]


@dataclass
class ConversionPlan:
    """Everything a conversion writes, known before any tensor is read."""

    component: Component
    source: list[Path]
    source_layout: str
    target_layout: str
    steps: list[Step]
    config: DiTConfig | AnyVAEConfig
    diffusers_config: dict[str, Any]

    def outputs(self) -> Iterator[Output]:
        for step in self.steps:
            yield from step.outputs

    @property
    def total_bytes(self) -> int:
        return sum(o.nbytes for o in self.outputs())


def _source_dtypes(src: TensorSource) -> dict[str, torch.dtype]:
    out = {}
    for key in src.keys():
        if src.dtype(key) not in TORCH_DTYPES:
            raise WeightsError(
                f"{src.path_of(key)}: {key} has dtype {src.dtype(key)}, which this converter does not handle"
            )
        out[key] = TORCH_DTYPES[src.dtype(key)]
    return out


def _meta_getter(view: KeyView, dtypes: dict[str, torch.dtype]) -> Callable[[str], Tensor]:
    """`get` returning an empty meta tensor with a source key's shape and dtype (for planning)."""
    return lambda k: torch.empty(view.shape(k), dtype=dtypes[view.names[k]], device="meta")


def _outputs(tensors: dict[str, Tensor]) -> tuple[Output, ...]:
    return tuple(Output(k, tuple(t.shape), t.dtype) for k, t in tensors.items())


def _check_keys(present: list[str], used: list[str]) -> None:
    """Exactly `used` (in table order) must be `present`: missing keys named first, in that order."""
    have = set(present)
    raise_key_errors([k for k in used if k not in have], sorted(have - set(used)))


Split = Callable[[flux1_layout.Rule, Tensor], dict[str, Tensor]]
Fuse = Callable[[flux1_layout.Rule, Callable[[str], Tensor]], Tensor]


def plan_transformer(path_or_id: str | Path, *, to_bfl: bool = False) -> ConversionPlan:
    """Plan converting a FLUX.1, FLUX.2 or FLUX.3 transformer to the other layout (strict: every key used, every shape right).

    With `to_bfl`, the plan's outputs are BFL-named whatever the source's layout: a BFL source's tensors are
    copied as they are (prefix stripped), after the same checks (what `flux-convert gguf` writes from).
    """
    ckpt = open_transformer(path_or_id)
    files, src = ckpt.files, ckpt.source
    if isinstance(src, GgufSource):  # converting would dequantize it: values kept, the file's bytes not
        raise WeightsError(
            f"{files[0]}: flux-convert does not convert GGUF files (yet); load the .gguf file itself, "
            "it keeps its quantized weights"
        )
    if ckpt.family == "flux3":
        return _plan_flux3_transformer(files, src, to_bfl)
    if ckpt.family == "flux2":
        return _plan_flux2_transformer(files, src, to_bfl)
    layout = detect_layout(src.keys())
    view = KeyView(src, flux1_layout.BFL_PREFIXES if layout == "bfl" else ())
    cfg = infer_config(
        layout,
        view.keys(),
        view.shape,
        read_folder_config(files) if layout == "diffusers" else None,
        files[0],
    )
    diffusers_cfg = transformer_diffusers_config(cfg)
    with torch.device("meta"):
        expected = Flux1Transformer(cfg).state_dict()
    table = list(flux1_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.guidance_embed))
    d = cfg.hidden_size

    def split(r: flux1_layout.Rule, t: Tensor) -> dict[str, Tensor]:
        return flux1_layout.bfl_to_diffusers(r, t, d)  # q, k, v blocks are `d` rows

    steps = _transformer_steps(layout, view, table, expected, split, flux1_layout.diffusers_to_bfl, to_bfl)
    target = "diffusers" if layout == "bfl" and not to_bfl else "bfl"
    return ConversionPlan("transformer", files, layout, target, steps, cfg, diffusers_cfg)


def _refuse_lost_fields(folder: dict | None, fixed: dict[str, Any], where: Path, name: str) -> None:
    """Refuse a diffusers config whose values BFL's code would not reproduce (a BFL file cannot state them)."""
    lost = [
        f"{k} {folder[k]} (BFL fixes {v})"
        for k, v in fixed.items()
        if folder and k in folder and folder[k] != v
    ]
    if lost:
        raise WeightsError(f"{where.parent / 'config.json'}: BFL's {name} cannot express " + ", ".join(lost))


def _plan_flux2_transformer(files: list[Path], src: TensorSource, to_bfl: bool = False) -> ConversionPlan:
    """`plan_transformer` for FLUX.2 keys: `flux2_layout`'s table, the FLUX.2 loader's config inference."""
    layout = flux2_layout.detect_layout(src.keys())
    view = KeyView(src, flux1_layout.BFL_PREFIXES if layout == "bfl" else ())
    folder = read_folder_config(files) if layout == "diffusers" else None
    return _plan_dit(files, layout, view, folder, FLUX2, FLUX2_DIFFUSERS_FIXED, to_bfl)


def _plan_flux3_transformer(files: list[Path], src: TensorSource, to_bfl: bool = False) -> ConversionPlan:
    """`plan_transformer` for FLUX.3 keys: `flux3_layout`'s table (every rule one tensor, the final adaLN's halves
    swapped), the FLUX.3 loader's config inference. A BFL file's training-only `repa_projectors.*` are left out;
    FP8 checkpoints are refused (their scales have no place in the other layout's bf16 model)."""
    layout = flux3_layout.detect_layout(src.keys())
    view = KeyView(src, flux1_layout.BFL_PREFIXES if layout == "bfl" else ())
    folder = read_folder_config(files) if layout == "diffusers" else None
    if fp8_layers.Fp8Source.detect(view, folder, str(files[0])) is not None:
        raise WeightsError(
            f"{files[0]}: an FP8 FLUX.3 checkpoint; flux-convert converts bf16/fp16/fp32 checkpoints "
            "(load FP8 ones directly, or write one with `flux-convert quantize`)"
        )
    skipped = [k for k in view.keys() if flux3_layout.training_only(k)]
    if skipped:
        log.info("%s: leaving out %d training-only tensors (%s, ...)", files[0], len(skipped), skipped[0])
        for k in skipped:
            del view.names[k]
    return _plan_dit(files, layout, view, folder, FLUX3, FLUX3_DIFFUSERS_FIXED, to_bfl)


def _plan_dit(
    files: list[Path],
    layout: str,
    view: KeyView,
    folder: dict | None,
    family: DitFamily,
    fixed: dict[str, Any],
    to_bfl: bool = False,
) -> ConversionPlan:
    """A FLUX.2 / FLUX.3 plan once its layout is known: the depths from `view`'s keys (diffusers keys checked
    against the family's layout table), the config inferred as the family's loader does, a diffusers
    config refused where BFL's code fixes another value (`fixed`), then every key's conversion step."""
    layout_mod, config_keys = family.layout, family.keys
    if layout == "bfl":
        depths = layout_mod.bfl_depths(view.keys())
        shape_of = view.shape
    else:
        depths = layout_mod.diffusers_depths(view.keys())
        table = list(layout_mod.rules(*depths))
        _check_keys(view.keys(), [k for r in table for k in r.diffusers])
        shape_of = bfl_shapes(table, view.shape)
    cfg = infer_dit_config(config_keys, shape_of, depths, folder, files[0])
    _refuse_lost_fields(folder, fixed, files[0], config_keys.name)
    with torch.device("meta"):
        expected = family.model(cfg).state_dict()
    table = list(layout_mod.rules(*depths))
    steps = _transformer_steps(
        layout, view, table, expected, layout_mod.bfl_to_diffusers, layout_mod.diffusers_to_bfl, to_bfl
    )
    target = "diffusers" if layout == "bfl" and not to_bfl else "bfl"
    return ConversionPlan("transformer", files, layout, target, steps, cfg, transformer_diffusers_config(cfg))


def _transformer_steps(
    layout: str,
    view: KeyView,
    table: list[flux1_layout.Rule],
    expected: dict[str, Tensor],
    split: Split,
    fuse: Fuse,
    to_bfl: bool = False,
) -> list[Step]:
    """One step per rule: `split` a BFL tensor into its diffusers tensors, or `fuse` them into it; with
    `to_bfl`, a BFL tensor is copied as it is.

    Checks first that the source has exactly the table's keys, each of the shape the model (BFL
    names) or the split of the model's tensor (diffusers names) gives.
    """
    meta_get = _meta_getter(view, _source_dtypes(view.src))
    steps = []
    if layout == "bfl":
        _check_keys(view.keys(), [r.bfl for r in table])
        for r in table:
            if view.shape(r.bfl) != tuple(expected[r.bfl].shape):
                raise WeightsError(
                    f"{r.bfl}: expected shape {tuple(expected[r.bfl].shape)}, checkpoint has {view.shape(r.bfl)}"
                )
            if to_bfl:
                planned = {r.bfl: meta_get(r.bfl)}

                def run(r: flux1_layout.Rule = r) -> dict[str, Tensor]:
                    return {r.bfl: view.get(r.bfl)}
            else:
                planned = split(r, meta_get(r.bfl))

                def run(r: flux1_layout.Rule = r) -> dict[str, Tensor]:
                    return split(r, view.get(r.bfl))

            steps.append(Step(_outputs(planned), run))
        return steps

    _check_keys(view.keys(), [k for r in table for k in r.diffusers])
    for r in table:
        for k, part in split(r, expected[r.bfl]).items():
            if view.shape(k) != tuple(part.shape):
                raise WeightsError(f"{k}: expected shape {tuple(part.shape)}, checkpoint has {view.shape(k)}")
    for r in table:
        planned = {r.bfl: fuse(r, meta_get)}

        def run_fuse(r: flux1_layout.Rule = r) -> dict[str, Tensor]:
            return {r.bfl: fuse(r, view.get)}

        steps.append(Step(_outputs(planned), run_fuse))
    return steps


def plan_vae(path_or_id: str | Path) -> ConversionPlan:
    """Plan converting a FLUX.1 or FLUX.2 VAE to the other layout (`open_vae_checkpoint` has checked every key).

    FLUX.2's optional `bn.num_batches_tracked` has one name in both layouts: copied when present.
    """
    ckpt = open_vae_checkpoint(path_or_id)
    meta_get = _meta_getter(ckpt.view, _source_dtypes(ckpt.view.src))
    steps = []
    for r in ckpt.table:
        if ckpt.layout == "bfl":
            planned = {r.diffusers: vae_layout.bfl_to_diffusers(r, meta_get(r.bfl))}

            def run(r: vae_layout.Rule = r) -> dict[str, Tensor]:
                return {r.diffusers: vae_layout.bfl_to_diffusers(r, ckpt.view.get(r.bfl))}
        else:
            planned = {r.bfl: vae_layout.diffusers_to_bfl(r, meta_get(r.diffusers))}

            def run(r: vae_layout.Rule = r) -> dict[str, Tensor]:
                return {r.bfl: vae_layout.diffusers_to_bfl(r, ckpt.view.get(r.diffusers))}

        steps.append(Step(_outputs(planned), run))
    for key in ckpt.optional:

        def copy(key: str = key) -> dict[str, Tensor]:
            return {key: ckpt.view.get(key)}

        steps.append(Step(_outputs({key: meta_get(key)}), copy))
    target = "diffusers" if ckpt.layout == "bfl" else "bfl"
    return ConversionPlan(
        "vae", ckpt.files, ckpt.layout, target, steps, ckpt.config, vae_diffusers_config(ckpt.config)
    )


def plan_conversion(component: Component, path_or_id: str | Path) -> ConversionPlan:
    """Plan converting `component` found at `path_or_id` to the layout it is not in."""
    if component == "transformer":
        return plan_transformer(path_or_id)
    if component == "vae":
        return plan_vae(path_or_id)
    raise ValueError(f"unknown component {component!r}; expected one of {', '.join(COMPONENTS)}")
