"""The FLUX.1 transformer loader: BFL and diffusers layouts, shapes read from the checkpoint.

The layout is read from the keys present, never from file names. The model is built on the meta
device and each tensor is streamed straight to the target device and dtype; the match against the
model is strict (missing, unexpected and misshapen keys are named). `load_transformer` calls this for
checkpoints whose keys are FLUX.1's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from flux_runtime.models.dit import PRESETS, DiTConfig, Flux1Transformer
from flux_runtime.weights import flux1_layout
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.checkpoint import (
    BFL_ANY,
    BFL_MARK,
    TransformerCheckpoint,
    _strip,
    checked_rules,
    config_errors,
    fill_model,
    with_given_config,
)
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.keys import KeyView, need_shape, raise_key_errors

log = logging.getLogger(__name__)

_DIFFUSERS_ANY = ("x_embedder.weight", "proj_out.weight")


def detect_layout(keys: list[str]) -> str:
    """'bfl' or 'diffusers', from the keys present."""
    stripped = {_strip(k) for k in keys}
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
    the folder's config.json, else the preset with this head width.
    """
    if layout == "diffusers":
        img_in, txt_in, vec_in = (
            "x_embedder.weight",
            "context_embedder.weight",
            "time_text_embed.text_embedder.linear_1.weight",
        )
        qnorm, mlp_in, final = (
            "transformer_blocks.0.attn.norm_q.weight",
            "transformer_blocks.0.ff.net.0.proj.weight",
            "proj_out.weight",
        )
        depth = flux1_layout.count_blocks(keys, "transformer_blocks")
        depth_single = flux1_layout.count_blocks(keys, "single_transformer_blocks")
        guidance = any(k.startswith("time_text_embed.guidance_embedder.") for k in keys)
        if depth == 0:
            qnorm = "single_transformer_blocks.0.attn.norm_q.weight"
            mlp_in = "single_transformer_blocks.0.proj_mlp.weight"
    else:
        img_in, txt_in, vec_in = "img_in.weight", "txt_in.weight", "vector_in.in_layer.weight"
        qnorm, mlp_in, final = (
            "double_blocks.0.img_attn.norm.query_norm.scale",
            "double_blocks.0.img_mlp.0.weight",
            "final_layer.linear.weight",
        )
        depth = flux1_layout.count_blocks(keys, "double_blocks")
        depth_single = flux1_layout.count_blocks(keys, "single_blocks")
        guidance = any(k.startswith("guidance_in.") for k in keys)
        if depth == 0:
            qnorm = "single_blocks.0.norm.query_norm.scale"
    hidden, in_ch = need_shape(shape_of, img_in, "hidden size", 2)
    head_dim = need_shape(shape_of, qnorm, "head dim", 1)[0]
    if layout == "bfl" and depth == 0:
        mlp_hidden = need_shape(shape_of, "single_blocks.0.linear1.weight", "MLP width", 2)[0] - 3 * hidden
    else:
        mlp_hidden = need_shape(shape_of, mlp_in, "MLP width", 2)[0]
    if hidden % head_dim:
        raise WeightsError(f"hidden size {hidden} is not a multiple of the QK-norm width {head_dim}")
    axes = axes_dim if axes_dim and sum(axes_dim) == head_dim else _axes_dim(head_dim, folder_config)
    with config_errors(where):
        cfg = DiTConfig(
            in_channels=in_ch,
            out_channels=need_shape(shape_of, final, "output channels", 2)[0],
            vec_in_dim=need_shape(shape_of, vec_in, "pooled text width", 2)[1],
            context_in_dim=need_shape(shape_of, txt_in, "text width", 2)[1],
            hidden_size=hidden,
            mlp_ratio=mlp_hidden / hidden,
            num_heads=hidden // head_dim,
            depth=depth,
            depth_single_blocks=depth_single,
            axes_dim=axes,
            guidance_embed=guidance,
        )
    return cfg


def _axes_dim(head_dim: int, folder_config: dict | None) -> tuple[int, ...]:
    if folder_config and "axes_dims_rope" in folder_config:
        return tuple(folder_config["axes_dims_rope"])
    for preset in PRESETS.values():
        if preset.head_dim == head_dim:
            return preset.axes_dim
    raise WeightsError(f"cannot tell the RoPE axes for head dim {head_dim}; pass config= with axes_dim")


def load_flux1_transformer(
    ckpt: TransformerCheckpoint,
    *,
    device: torch.device,
    dtype: torch.dtype,
    config: DiTConfig | None = None,
    fp8: bool = False,
) -> Flux1Transformer:
    """Load the FLUX.1 transformer of an opened checkpoint (device and dtype checked by the caller)."""
    files, src = ckpt.files, ckpt.source
    layout = detect_layout(src.keys())
    if layout == "bfl":
        view = KeyView(src, flux1_layout.BFL_PREFIXES)
        keys, shape_of = view.keys(), view.shape
    else:
        keys, shape_of = src.keys(), src.shape
    given_axes = config.axes_dim if config is not None and config.family == "flux1" else None
    inferred = infer_config(layout, keys, shape_of, ckpt.folder_config, files[0], given_axes)
    inferred = with_given_config(inferred, config)
    log.info("loading %s-layout FLUX.1 transformer from %s (%d files)", layout, files[0].parent, len(files))

    with torch.device("meta"):
        model = Flux1Transformer(inferred)
    reader = view if layout == "bfl" else src
    fp8_src = fp8_layers.Fp8Source.detect(reader, ckpt.folder_config, str(files[0].parent))
    extra = fp8_src.extra_keys() if fp8_src is not None else set()

    cfg = inferred
    table = None
    if layout != "bfl":
        table = list(flux1_layout.rules(cfg.depth, cfg.depth_single_blocks, cfg.guidance_embed))
        used = {d for r in table for d in r.diffusers}
        missing = sorted(d for d in used if d not in src)
        unexpected = sorted(set(keys) - used - extra)
        raise_key_errors(missing, unexpected)
    table, assemble = checked_rules(
        model, layout, reader, keys=set(keys) - extra, shape_of=shape_of, table=table,
        split=lambda r, t: flux1_layout.bfl_to_diffusers(r, t, cfg.hidden_size),
        assemble=flux1_layout.diffusers_to_bfl,
    )  # fmt: skip
    return fill_model(model, table, reader, assemble, device=device, dtype=dtype, fp8_src=fp8_src, fp8=fp8)
