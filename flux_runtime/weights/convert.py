"""Converting FLUX.1, FLUX.2 and FLUX.3 checkpoints between the BFL single-file layout and the diffusers folder layout.

A conversion is planned before any tensor is read (`convert_plan`: the source found, its family and layout read
from its keys, its config inferred, every key checked against the layout's rule table, one step per rule), then
written by streaming (`convert_write`: one step's tensors in memory at a time, diffusers output sharded, files
renamed into place only once complete). `convert` does both; the names callers import from here
(`COMPONENTS`, `DEFAULT_MAX_SHARD_SIZE`, the plans and writers) are these modules'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flux_runtime.weights import vae_layout
from flux_runtime.weights.convert_plan import (
    COMPONENTS,
    Component,
    ConversionPlan,
    Step,
    plan_conversion,
    plan_transformer,
    plan_vae,
)
from flux_runtime.weights.convert_write import DEFAULT_MAX_SHARD_SIZE, write_bfl, write_diffusers
from flux_runtime.weights.safetensors_writer import parse_size

__all__ = [
    "COMPONENTS",
    "DEFAULT_MAX_SHARD_SIZE",
    "Component",
    "ConversionPlan",
    "ConversionResult",
    "Step",
    "convert",
    "plan_conversion",
    "plan_transformer",
    "plan_vae",
    "vae_layout",  # the module whose rules `plan_vae` runs (tests/cli patch one to fail part-way)
    "write_bfl",
    "write_diffusers",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConversionResult:
    """What `convert` wrote."""

    component: Component
    source_layout: str
    target_layout: str
    files: list[Path]
    num_tensors: int
    total_bytes: int


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
