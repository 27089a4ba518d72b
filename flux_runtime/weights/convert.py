"""Converting FLUX.1, FLUX.2 and FLUX.3 checkpoints between the BFL single-file layout and the diffusers folder layout.

A conversion is planned before any tensor is read: the source is found, its family and layout read
from its keys, its config inferred and every key checked against the layout's rule table (the same
tables and checks the loaders use: `flux1_layout` / `flux2_layout` / `flux3_layout` for the transformer,
`vae_layout` / `vae2_layout` for the VAE). The plan
is a list of steps, one per rule, each knowing the names, shapes and dtypes it will produce
(computed by running the rule on meta tensors). Writing then streams: the safetensors header is
written from the plan, and each step reads its few source tensors, transforms them and appends the
bytes, so memory holds one step's tensors at a time, whatever the model size. diffusers output is
split into shards of at most `max_shard_size` bytes with the `*.safetensors.index.json` diffusers
reads; files are written under a `.partial` name and renamed only once complete.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from flux_runtime.models.dit import DiTConfig, Flux1Transformer, Flux2Transformer, Flux3Transformer
from flux_runtime.weights import (
    flux1_layout,
    flux2_layout,
    flux2_transformer,
    flux3_layout,
    flux3_transformer,
    vae_layout,
)
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.checkpoint import (
    ConfigKeys,
    bfl_shapes,
    find_transformer_files,
    infer_dit_config,
    read_folder_config,
)
from flux_runtime.weights.diffusers_config import (
    FLUX2_DIFFUSERS_FIXED,
    FLUX3_DIFFUSERS_FIXED,
    transformer_diffusers_config,
    vae_diffusers_config,
)
from flux_runtime.weights.dtype_names import TORCH_DTYPES
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_transformer import detect_layout, infer_config
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.keys import KeyView
from flux_runtime.weights.safetensors_io import TensorSource
from flux_runtime.weights.safetensors_writer import (
    Output,
    SafetensorsWriter,
    parse_size,
    shard,
)
from flux_runtime.weights.vae import AnyVAEConfig, open_vae_checkpoint

log = logging.getLogger(__name__)

Component = Literal["transformer", "vae"]
COMPONENTS: tuple[Component, ...] = ("transformer", "vae")
DIFFUSERS_STEM = "diffusion_pytorch_model"
# diffusers' `save_pretrained` default.
DEFAULT_MAX_SHARD_SIZE = "10GB"


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


@dataclass(frozen=True)
class ConversionResult:
    """What `convert` wrote."""

    component: Component
    source_layout: str
    target_layout: str
    files: list[Path]
    num_tensors: int
    total_bytes: int


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


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")


def _check_keys(present: list[str], used: list[str]) -> None:
    missing = [k for k in used if k not in set(present)]
    if missing:
        raise WeightsError(f"checkpoint is missing {len(missing)} key(s): {_few(missing)}")
    unexpected = sorted(set(present) - set(used))
    if unexpected:
        raise WeightsError(f"checkpoint has {len(unexpected)} unexpected key(s): {_few(unexpected)}")


Split = Callable[[flux1_layout.Rule, Tensor], dict[str, Tensor]]
Fuse = Callable[[flux1_layout.Rule, Callable[[str], Tensor]], Tensor]


def plan_transformer(path_or_id: str | Path) -> ConversionPlan:
    """Plan converting a FLUX.1, FLUX.2 or FLUX.3 transformer to the other layout (strict: every key used, every shape right)."""
    files = find_transformer_files(resolve(path_or_id))
    src = TensorSource(files)
    if flux3_layout.is_flux3(src.keys()):
        return _plan_flux3_transformer(files, src)
    if flux2_layout.is_flux2(src.keys()):
        return _plan_flux2_transformer(files, src)
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

    steps = _transformer_steps(layout, view, table, expected, split, flux1_layout.diffusers_to_bfl)
    target = "diffusers" if layout == "bfl" else "bfl"
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


def _plan_flux2_transformer(files: list[Path], src: TensorSource) -> ConversionPlan:
    """`plan_transformer` for FLUX.2 keys: `flux2_layout`'s table, the FLUX.2 loader's config inference."""
    layout = flux2_layout.detect_layout(src.keys())
    view = KeyView(src, flux1_layout.BFL_PREFIXES if layout == "bfl" else ())
    folder = read_folder_config(files) if layout == "diffusers" else None
    return _plan_dit(
        files, layout, view, folder, flux2_layout, Flux2Transformer, flux2_transformer.CONFIG_KEYS,
        FLUX2_DIFFUSERS_FIXED,
    )  # fmt: skip


def _plan_flux3_transformer(files: list[Path], src: TensorSource) -> ConversionPlan:
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
    return _plan_dit(
        files, layout, view, folder, flux3_layout, Flux3Transformer, flux3_transformer.CONFIG_KEYS,
        FLUX3_DIFFUSERS_FIXED,
    )  # fmt: skip


def _plan_dit(
    files: list[Path],
    layout: str,
    view: KeyView,
    folder: dict | None,
    layout_mod: Any,
    model_cls: type[torch.nn.Module],
    config_keys: ConfigKeys,
    fixed: dict[str, Any],
) -> ConversionPlan:
    """A FLUX.2 / FLUX.3 plan once its layout is known: the depths from `view`'s keys (diffusers keys checked
    against `layout_mod`'s table), the config inferred as the family's loader does (`config_keys`), a diffusers
    config refused where BFL's code fixes another value (`fixed`), then every key's conversion step."""
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
        expected = model_cls(cfg).state_dict()
    table = list(layout_mod.rules(*depths))
    steps = _transformer_steps(
        layout, view, table, expected, layout_mod.bfl_to_diffusers, layout_mod.diffusers_to_bfl
    )
    target = "diffusers" if layout == "bfl" else "bfl"
    return ConversionPlan("transformer", files, layout, target, steps, cfg, transformer_diffusers_config(cfg))


def _transformer_steps(
    layout: str,
    view: KeyView,
    table: list[flux1_layout.Rule],
    expected: dict[str, Tensor],
    split: Split,
    fuse: Fuse,
) -> list[Step]:
    """One step per rule: `split` a BFL tensor into its diffusers tensors, or `fuse` them into it.

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


# ---- writing


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _write_files(
    plan: ConversionPlan, files: list[tuple[Path, list[Output]]], progress: Callable[[int], None] | None
) -> None:
    """Run the plan's steps once, streaming their tensors into `files` (each under a `.partial` name)."""
    order = iter((path, outputs) for path, outputs in files)
    writer: SafetensorsWriter | None = None
    try:
        for step in plan.steps:
            tensors = step.run()
            for o in step.outputs:
                if writer is None or writer.written == len(writer.outputs):
                    if writer is not None:
                        writer.close()
                    path, outputs = next(order)
                    log.info("writing %s (%d tensors)", path.name, len(outputs))
                    writer = SafetensorsWriter(_partial(path), outputs)
                writer.write(o.key, tensors[o.key])
                if progress is not None:
                    progress(o.nbytes)
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        for path, _ in files:
            _partial(path).unlink(missing_ok=True)
        raise


def _check_destination(dst: Path, sources: list[Path], overwrite: bool, folder: bool) -> None:
    srcs = {p.resolve() for p in sources}
    target = dst.resolve()
    if target in srcs or (folder and any(target in p.parents for p in srcs)):
        raise WeightsError(f"{dst}: the output would overwrite the input checkpoint; choose another path")
    if folder:
        if dst.exists() and not dst.is_dir():
            raise WeightsError(f"{dst} exists and is not a folder (diffusers output is a folder)")
        if dst.is_dir() and any(dst.iterdir()) and not overwrite:
            raise WeightsError(
                f"{dst} already exists and is not empty; pass overwrite (--overwrite) to replace it"
            )
    else:
        if dst.suffix != ".safetensors":
            raise WeightsError(f"{dst}: BFL output is a single file; give a path ending in .safetensors")
        if dst.is_dir():
            raise WeightsError(f"{dst} is a folder; BFL output is a single .safetensors file")
        if dst.exists() and not overwrite:
            raise WeightsError(f"{dst} already exists; pass overwrite (--overwrite) to replace it")


def write_bfl(
    plan: ConversionPlan, dst: Path, *, overwrite: bool = False, progress: Callable[[int], None] | None = None
) -> list[Path]:
    """Write a plan whose target is BFL as one `.safetensors` file (no prefix, as BFL ships it)."""
    assert plan.target_layout == "bfl"
    _check_destination(dst, plan.source, overwrite, folder=False)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _write_files(plan, [(dst, list(plan.outputs()))], progress)
    os.replace(_partial(dst), dst)
    return [dst]


def write_diffusers(
    plan: ConversionPlan,
    dst: Path,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write a plan whose target is diffusers as a component folder `from_pretrained` reads.

    `config.json` plus `diffusion_pytorch_model.safetensors`, or, past `max_shard_size`,
    `diffusion_pytorch_model-0000i-of-0000n.safetensors` with `diffusion_pytorch_model.safetensors.index.json`.
    With `overwrite`, a previous output's weights, index and config in `dst` are replaced; other files stay.
    """
    assert plan.target_layout == "diffusers"
    limit = parse_size(max_shard_size)
    _check_destination(dst, plan.source, overwrite, folder=True)
    shards = shard(list(plan.outputs()), limit)
    n = len(shards)
    names = (
        [f"{DIFFUSERS_STEM}.safetensors"]
        if n == 1
        else [f"{DIFFUSERS_STEM}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    files = [(dst / name, outputs) for name, outputs in zip(names, shards, strict=True)]
    try:
        _write_files(plan, files, progress)
    except BaseException:
        if created:
            dst.rmdir()  # _write_files removed its partial files; leave no empty folder behind
        raise

    # every tensor is on disk: now replace a previous output, then move the new one in place
    for old in [
        *dst.glob(f"{DIFFUSERS_STEM}*.safetensors"),
        dst / f"{DIFFUSERS_STEM}.safetensors.index.json",
        dst / "config.json",
    ]:
        old.unlink(missing_ok=True)
    for path, _ in files:
        os.replace(_partial(path), path)
    written = [path for path, _ in files]
    if n > 1:
        index = dst / f"{DIFFUSERS_STEM}.safetensors.index.json"
        weight_map = {o.key: path.name for path, outputs in files for o in outputs}
        index.write_text(
            json.dumps({"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}, indent=2)
            + "\n"
        )
        written.append(index)
    config = dst / "config.json"
    config.write_text(json.dumps(plan.diffusers_config, indent=2, sort_keys=True) + "\n")
    return [*written, config]


def convert(
    component: Component,
    src: str | Path,
    dst: str | Path,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ConversionResult:
    """Convert the FLUX.1, FLUX.2 or FLUX.3 `component` at `src` to the layout it is not in, at `dst`.

    BFL → diffusers writes a folder (`dst`); diffusers → BFL writes one file (`dst`, `.safetensors`).
    Tensors keep their dtype and values bit for bit (fused q/k/v concatenated or split, the final
    norm's halves swapped, 1x1 convs reshaped). A BFL file carries no config: converting one to
    diffusers infers the architecture from shapes, with 32 groups and the family's fixed values
    (FLUX.1's VAE factors, FLUX.2's BatchNorm eps, the RoPE axes of the preset with that head width).
    FLUX.3 BFL files' training-only `repa_projectors.*` are left out of the diffusers folder.
    Raises `WeightsError` (bad source or destination) or `ValueError` (bad `max_shard_size`).
    """
    limit = parse_size(max_shard_size)
    plan = plan_conversion(component, src)
    dst = Path(dst).expanduser()
    log.info(
        "converting %s: %s -> %s, %d bytes",
        component,
        plan.source_layout,
        plan.target_layout,
        plan.total_bytes,
    )
    if plan.target_layout == "bfl":
        files = write_bfl(plan, dst, overwrite=overwrite, progress=progress)
    else:
        files = write_diffusers(plan, dst, max_shard_size=limit, overwrite=overwrite, progress=progress)
    return ConversionResult(
        component,
        plan.source_layout,
        plan.target_layout,
        files,
        sum(1 for _ in plan.outputs()),
        plan.total_bytes,
    )
