"""`load_flux2_transformer`: a FLUX.2 DiT from a BFL file, a diffusers folder, or a cached model id.

The FLUX.1 loader's steps and the shared helpers (weights/checkpoint.py), with FLUX.2's key table: the
layout is read from the keys, the shape from the tensors (plus `config.json` for the RoPE axes when
there is one), the model is built on the meta device and each tensor is streamed straight to the
target device and dtype. Missing, unexpected and misshapen keys are named. `load_transformer`
dispatches here when the keys are FLUX.2's, so callers need only that one entry point.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from flux_runtime.models.dit import PRESETS, DiTConfig, Flux2Transformer
from flux_runtime.registry import builtin
from flux_runtime.weights import flux2_layout
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.builtin import MODELS_DIR
from flux_runtime.weights.checkpoint import (
    TransformerCheckpoint,
    check_config,
    check_keys,
    check_part_shapes,
    config_errors,
    fill_model,
    finish_builtin,
    identity_rules,
    open_transformer,
    rope_axes,
    take_only,
    transformer_family,
)
from flux_runtime.weights.checks import check_device, check_load_dtype, check_weight_dtypes
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_layout import BFL_PREFIXES
from flux_runtime.weights.keys import KeyView, need_shape, raise_key_errors
from flux_runtime.weights.random_init import init_random

log = logging.getLogger(__name__)

# Random-weight FLUX.2 presets that need no checkpoint, name → seed (kept for callers of the old name;
# the registry is the list).
BUILTIN_FLUX2 = {"tiny-flux2": 0}

ShapeOf = Callable[[str], tuple[int, ...]]


def is_flux2(path_or_id: str | Path | TransformerCheckpoint) -> bool:
    """True for `tiny-flux2` and for checkpoints whose keys are FLUX.2's; False for FLUX.1 ones.

    Reads only the safetensors headers. Raises the loader's `WeightsError` for a path or id that
    does not resolve to readable safetensors files.
    """
    return transformer_family(path_or_id) == "flux2"


def infer_config(
    shape_of: ShapeOf,
    depths: tuple[int, int, bool],
    folder_config: dict | None,
    where: Path | str = "checkpoint",
    rope: tuple[tuple[int, ...], int] | None = None,
) -> DiTConfig:
    """Read widths, heads and channels from the checkpoint itself, through BFL key names (`where` names it in errors).

    `rope`: a caller's (axes, theta), used when it fits the head width (the weights do not state them).

    `depths` is (double blocks, single blocks, guidance embedder present); RoPE axes and theta come
    from a diffusers `config.json` when there is one, else from the FLUX.2 preset of this head width.
    """
    depth, depth_single, guidance = depths
    hidden, in_ch = need_shape(shape_of, "img_in.weight", "hidden size", 2)
    if depth:
        head_dim = need_shape(shape_of, "double_blocks.0.img_attn.norm.query_norm.scale", "head dim", 1)[0]
        mlp_hidden = need_shape(shape_of, "double_blocks.0.img_mlp.2.weight", "MLP width", 2)[1]
    elif depth_single:
        head_dim = need_shape(shape_of, "single_blocks.0.norm.query_norm.scale", "head dim", 1)[0]
        mlp_hidden = need_shape(shape_of, "single_blocks.0.linear2.weight", "MLP width", 2)[1] - hidden
    else:
        raise WeightsError("FLUX.2 checkpoint has no transformer blocks")
    if hidden % head_dim:
        raise WeightsError(f"hidden size {hidden} is not a multiple of the QK-norm width {head_dim}")
    axes_dim, theta = (
        rope if rope and sum(rope[0]) == head_dim else rope_axes(head_dim, folder_config, "flux2", 2000)
    )
    with config_errors(where):
        cfg = DiTConfig(
            family="flux2",
            in_channels=in_ch,
            out_channels=need_shape(shape_of, "final_layer.linear.weight", "output channels", 2)[0],
            vec_in_dim=0,
            context_in_dim=need_shape(shape_of, "txt_in.weight", "text width", 2)[1],
            hidden_size=hidden,
            mlp_ratio=mlp_hidden / hidden,
            num_heads=hidden // head_dim,
            depth=depth,
            depth_single_blocks=depth_single,
            axes_dim=axes_dim,
            theta=theta,
            qkv_bias=False,
            guidance_embed=guidance,
        )
    if cfg.mlp_hidden_dim != mlp_hidden:
        raise WeightsError(
            f"MLP width {mlp_hidden} is not a float-exact multiple of the hidden size {hidden}"
        )
    return cfg


def load_flux2_transformer(
    path_or_id: str | Path | TransformerCheckpoint,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: DiTConfig | None = None,
    fp8: bool = False,
) -> Flux2Transformer:
    """Load a FLUX.2 [dev] / [klein] transformer, ready for inference (eval mode, no grads).

    `path_or_id`: a BFL single file (`flux2-dev.safetensors`, optionally `model.diffusion_model.`
    prefixed), a diffusers `transformer/` folder or pipeline root (sharded or not), a Hugging Face
    model id in the local cache, or the built-in random preset `tiny-flux2`. `config` is optional;
    when given it must agree with the checkpoint (its `axes_dim` and `theta` are then used). `dtype` and
    `device` are checked, and the weights' stored dtypes and values, as by `load_transformer`; FP8
    checkpoints and `fp8=True` as there too.
    """
    device = check_device(device)
    dtype = check_load_dtype(dtype)
    fp8_layers.check_dtype(dtype, fp8)
    spec = None if isinstance(path_or_id, TransformerCheckpoint) else builtin(path_or_id)
    if spec is not None and spec.family == "flux2" and spec.trained:  # a shipped BFL file, the preset's RoPE
        path_or_id, config = (
            MODELS_DIR / (spec.files or "") / (spec.dit_file or ""),
            config or PRESETS[spec.preset or ""],
        )
        spec = None
    if spec is not None and spec.family == "flux2":
        assert spec.preset is not None
        with torch.device("meta"):
            model = Flux2Transformer(config or PRESETS[spec.preset])
        return finish_builtin(init_random(model, spec.seed, device, dtype), dtype, fp8)

    ckpt = path_or_id if isinstance(path_or_id, TransformerCheckpoint) else open_transformer(path_or_id)
    files, src = ckpt.files, ckpt.source
    if ckpt.family != "flux2":
        raise WeightsError(f"{files[0]}: not a FLUX.2 transformer (no shared modulation weights)")
    layout = flux2_layout.detect_layout(src.keys())
    reader = KeyView(src, BFL_PREFIXES) if layout == "bfl" else src
    fp8_src = fp8_layers.Fp8Source.detect(reader, ckpt.folder_config, str(files[0].parent))
    extra = fp8_src.extra_keys() if fp8_src is not None else set()
    if layout == "bfl":
        view = reader
        depths = flux2_layout.bfl_depths(view.keys())
        shape_of: ShapeOf = view.shape
    else:
        depths = flux2_layout.diffusers_depths(src.keys())
        table = list(flux2_layout.rules(*depths))
        used = {d for r in table for d in r.diffusers}
        raise_key_errors(sorted(used - set(src.keys())), sorted(set(src.keys()) - used - extra))
        shape_of = _fused_shapes(table, src.shape)

    given_rope = (config.axes_dim, config.theta) if config is not None and config.family == "flux2" else None
    inferred = infer_config(shape_of, depths, ckpt.folder_config, files[0], given_rope)
    if config is not None:
        check_config(inferred, config)
        inferred = replace(inferred, axes_dim=config.axes_dim, theta=config.theta)
    log.info("loading %s-layout FLUX.2 transformer from %s (%d files)", layout, files[0].parent, len(files))

    with torch.device("meta"):
        model = Flux2Transformer(inferred)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    if layout == "bfl":
        check_keys(set(view.keys()) - extra, expected, shape_of)
        check_weight_dtypes(view, expected)
        table, assemble = identity_rules(expected), take_only
    else:
        assemble = flux2_layout.diffusers_to_bfl
        check_part_shapes(table, expected, src.shape, flux2_layout.bfl_to_diffusers)
        check_weight_dtypes(src, sorted(used))
    return fill_model(model, table, reader, assemble, device=device, dtype=dtype, fp8_src=fp8_src, fp8=fp8)


def _fused_shapes(table: list[flux2_layout.Rule], diffusers_shape: ShapeOf) -> ShapeOf:
    """Shapes under BFL names for a diffusers checkpoint: fused rules stack their parts' rows."""
    by_bfl = {r.bfl: r for r in table}

    def shape_of(key: str) -> tuple[int, ...]:
        parts = [diffusers_shape(d) for d in by_bfl[key].diffusers]
        if not all(parts):  # a 0-D part: no rows to stack (need_shape and the shape checks name it)
            return ()
        return (sum(p[0] for p in parts), *parts[0][1:])

    return shape_of
