"""`load_flux2_transformer`: a FLUX.2 DiT from a BFL file, a diffusers folder, or a cached model id.

The FLUX.1 loader's steps and the shared helpers (weights/checkpoint.py), with FLUX.2's key table: the
layout is read from the keys, the shape from the tensors (plus `config.json` for the RoPE axes when
there is one), the model is built on the meta device and each tensor is streamed straight to the
target device and dtype. Missing, unexpected and misshapen keys are named. `load_transformer`
dispatches here when the keys are FLUX.2's, so callers need only that one entry point.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from flux_runtime.models.dit import PRESETS, DiTConfig, Flux2Transformer
from flux_runtime.registry import builtin
from flux_runtime.weights import flux2_layout
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.builtin import MODELS_DIR
from flux_runtime.weights.checkpoint import (
    BlockKeys,
    ConfigKeys,
    ShapeOf,
    TransformerCheckpoint,
    bfl_shapes,
    checked_rules,
    fill_model,
    finish_builtin,
    infer_dit_config,
    open_transformer,
    transformer_family,
    with_given_config,
)
from flux_runtime.weights.checks import check_device, check_load_dtype
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_layout import BFL_PREFIXES
from flux_runtime.weights.keys import KeyView, raise_key_errors
from flux_runtime.weights.random_init import init_random

log = logging.getLogger(__name__)

# Random-weight FLUX.2 presets that need no checkpoint, name → seed (kept for callers of the old name;
# the registry is the list).
BUILTIN_FLUX2 = {"tiny-flux2": 0}


def is_flux2(path_or_id: str | Path | TransformerCheckpoint) -> bool:
    """True for `tiny-flux2` and for checkpoints whose keys are FLUX.2's; False for FLUX.1 ones.

    Reads only the safetensors headers. Raises the loader's `WeightsError` for a path or id that
    does not resolve to readable safetensors files.
    """
    return transformer_family(path_or_id) == "flux2"


# The BFL-named tensors that state a FLUX.2 DiT's widths (`infer_dit_config`).
CONFIG_KEYS = ConfigKeys(
    family="flux2",
    name="FLUX.2",
    default_theta=2000,
    img_in="img_in.weight",
    final="final_layer.linear.weight",
    txt_in="txt_in.weight",
    double=BlockKeys("double_blocks.0.img_attn.norm.query_norm.scale", "double_blocks.0.img_mlp.2.weight"),
    single=BlockKeys("single_blocks.0.norm.query_norm.scale", "single_blocks.0.linear2.weight", True),
    flag="guidance_embed",
)


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
        depths = flux2_layout.bfl_depths(reader.keys())
        shape_of: ShapeOf = reader.shape
        table = None  # each key is itself
    else:
        depths = flux2_layout.diffusers_depths(src.keys())
        table = list(flux2_layout.rules(*depths))
        used = {d for r in table for d in r.diffusers}
        raise_key_errors(sorted(used - set(src.keys())), sorted(set(src.keys()) - used - extra))
        shape_of = bfl_shapes(table, src.shape)

    given_rope = (config.axes_dim, config.theta) if config is not None and config.family == "flux2" else None
    inferred = infer_dit_config(CONFIG_KEYS, shape_of, depths, ckpt.folder_config, files[0], given_rope)
    inferred = with_given_config(inferred, config)
    log.info("loading %s-layout FLUX.2 transformer from %s (%d files)", layout, files[0].parent, len(files))

    with torch.device("meta"):
        model = Flux2Transformer(inferred)
    table, assemble = checked_rules(
        model, layout, reader, keys=set(reader.keys()) - extra, shape_of=shape_of, table=table,
        split=flux2_layout.bfl_to_diffusers, assemble=flux2_layout.diffusers_to_bfl,
    )  # fmt: skip
    return fill_model(model, table, reader, assemble, device=device, dtype=dtype, fp8_src=fp8_src, fp8=fp8)
