"""Writing a planned conversion: the steps' tensors streamed into safetensors files, one step's tensors in memory
at a time, whatever the model size.

The safetensors header is written from the plan, and each step reads its source tensors, transforms them and
appends the bytes. diffusers output is split into shards of at most `max_shard_size` bytes with the
`*.safetensors.index.json` diffusers reads; files are written under a `.partial` name and renamed only once
complete.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from flux_runtime.weights.convert_plan import ConversionPlan
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.safetensors_writer import Output, SafetensorsWriter, parse_size, shard

log = logging.getLogger(__name__)

DIFFUSERS_STEM = "diffusion_pytorch_model"
# diffusers' `save_pretrained` default.
DEFAULT_MAX_SHARD_SIZE = "10GB"


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
