"""The FLUX.1 transformer loader: BFL and diffusers layouts, shapes read from the checkpoint.

The layout is read from the keys present, never from file names. The model is built on the meta
device and each tensor is streamed straight to the target device and dtype; the match against the
model is strict (missing, unexpected and misshapen keys are named). `load_transformer` calls this for
checkpoints whose keys are FLUX.1's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from flux_runtime.models.dit import DiTConfig, Flux1Transformer
from flux_runtime.weights import flux1_layout
from flux_runtime.weights.checkpoint import (
    BFL_ANY,
    BFL_MARK,
    TransformerCheckpoint,
    dit_config,
    rope_axes,
    with_given_config,
)
from flux_runtime.weights.dit_loading import check_table_keys, detect_fp8, layout_reader, load_checked
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.keys import need_shape

log = logging.getLogger(__name__)

_DIFFUSERS_ANY = ("x_embedder.weight", "proj_out.weight")


@dataclass(frozen=True)
class _ConfigKeys:
    """Where a FLUX.1 checkpoint of one layout states its config: the embedders, the final layer, the prefixes of
    its blocks and guidance embedder, and per kind of block the first one's QK norm and MLP input (whose rows are
    the MLP width, less three times the hidden size where it makes q, k and v too)."""

    img_in: str
    txt_in: str
    vec_in: str
    final: str
    double: str
    single: str
    guidance: str
    double_block: tuple[str, str, bool]
    single_block: tuple[str, str, bool]


_CONFIG_KEYS = {
    "diffusers": _ConfigKeys(
        "x_embedder.weight", "context_embedder.weight", "time_text_embed.text_embedder.linear_1.weight",
        "proj_out.weight", "transformer_blocks", "single_transformer_blocks", "time_text_embed.guidance_embedder.",
        ("transformer_blocks.0.attn.norm_q.weight", "transformer_blocks.0.ff.net.0.proj.weight", False),
        ("single_transformer_blocks.0.attn.norm_q.weight", "single_transformer_blocks.0.proj_mlp.weight", False),
    ),
    "bfl": _ConfigKeys(
        "img_in.weight", "txt_in.weight", "vector_in.in_layer.weight", "final_layer.linear.weight",
        "double_blocks", "single_blocks", "guidance_in.",
        ("double_blocks.0.img_attn.norm.query_norm.scale", "double_blocks.0.img_mlp.0.weight", False),
        ("single_blocks.0.norm.query_norm.scale", "single_blocks.0.linear1.weight", True),
    ),
}  # fmt: skip


def detect_layout(keys: list[str]) -> str:
    """'bfl' or 'diffusers', from the keys present."""
    stripped = {flux1_layout.strip_prefix(k) for k in keys}
    if any(k in stripped for k in (*BFL_ANY, BFL_MARK)):
        return "bfl"
    if any(k in keys for k in _DIFFUSERS_ANY):
        return "diffusers"
    sample = ", ".join(sorted(keys)[:5]) or "no keys at all"
    raise WeightsError(
        f"unknown checkpoint layout: not a FLUX.1 transformer in BFL or diffusers form (keys: {sample}, ...)"
    )


def infer_config(
    layout: str,
    keys: list[str],
    shape_of,
    folder_config: dict | None,
    where: Path | str = "checkpoint",
    axes_dim: tuple[int, ...] | None = None,
) -> DiTConfig:
    """Read depth, width, heads, channels and guidance from the checkpoint itself (`where` names it in errors).

    The RoPE axes are not in the weights: `axes_dim` (a caller's config, when it fits the head width), else
    the folder's config.json, else the FLUX.1 preset with this head width.
    """
    table = _CONFIG_KEYS["diffusers" if layout == "diffusers" else "bfl"]
    depth, depth_single, guidance = flux1_layout.block_depths(
        keys, table.double, table.single, table.guidance
    )
    qnorm, mlp_in, with_qkv = table.double_block if depth else table.single_block
    hidden, in_ch = need_shape(shape_of, table.img_in, "hidden size", 2)
    head_dim = need_shape(shape_of, qnorm, "head dim", 1)[0]
    mlp_hidden = need_shape(shape_of, mlp_in, "MLP width", 2)[0] - (3 * hidden if with_qkv else 0)
    if hidden % head_dim:
        raise WeightsError(f"hidden size {hidden} is not a multiple of the QK-norm width {head_dim}")
    if not (axes_dim and sum(axes_dim) == head_dim):
        axes_dim = rope_axes(head_dim, folder_config, "flux1", 10_000)[0]  # FLUX.1's theta is always 10000
    return dit_config(
        where, hidden, head_dim, mlp_hidden, in_channels=in_ch,
        out_channels=need_shape(shape_of, table.final, "output channels", 2)[0],
        vec_in_dim=need_shape(shape_of, table.vec_in, "pooled text width", 2)[1],
        context_in_dim=need_shape(shape_of, table.txt_in, "text width", 2)[1],
        depth=depth, depth_single_blocks=depth_single, axes_dim=axes_dim, guidance_embed=guidance,
    )  # fmt: skip


def load_flux1_transformer(
    ckpt: TransformerCheckpoint,
    *,
    device: torch.device,
    dtype: torch.dtype,
    config: DiTConfig | None = None,
    fp8: bool = False,
) -> Flux1Transformer:
    """Load the FLUX.1 transformer of an opened checkpoint (device and dtype checked by the caller)."""
    files = ckpt.files
    layout = detect_layout(ckpt.source.keys())
    reader = layout_reader(ckpt.source, layout)
    keys = reader.keys()
    given_axes = config.axes_dim if config is not None and config.family == "flux1" else None
    inferred = infer_config(layout, keys, reader.shape, ckpt.folder_config, files[0], given_axes)
    inferred = with_given_config(inferred, config)
    log.info("loading %s-layout FLUX.1 transformer from %s (%d files)", layout, files[0].parent, len(files))

    fp8_src, extra = detect_fp8(reader, ckpt)
    table = None  # BFL: each key is itself
    if layout != "bfl":
        table = list(
            flux1_layout.rules(inferred.depth, inferred.depth_single_blocks, inferred.guidance_embed)
        )
        check_table_keys(table, set(keys) - extra)
    return load_checked(
        Flux1Transformer, inferred, layout, reader, keys=set(keys) - extra, shape_of=reader.shape, table=table,
        split=lambda r, t: flux1_layout.bfl_to_diffusers(r, t, inferred.hidden_size),
        assemble=flux1_layout.diffusers_to_bfl, device=device, dtype=dtype, fp8_src=fp8_src, fp8=fp8,
    )  # fmt: skip
