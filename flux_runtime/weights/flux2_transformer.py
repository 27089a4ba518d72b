"""`load_flux2_transformer`: a FLUX.2 DiT from a BFL file, a diffusers folder, or a cached model id.

The FLUX.1 loader's steps and the shared helpers (weights/checkpoint.py), with FLUX.2's key table: the
layout is read from the keys, the shape from the tensors (plus `config.json` for the RoPE axes when
there is one), the model is built on the meta device and each tensor is streamed straight to the
target device and dtype. Missing, unexpected and misshapen keys are named. `load_transformer`
dispatches here when the keys are FLUX.2's, so callers need only that one entry point.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flux_runtime.models.dit import PRESETS, DiTConfig, Flux2Transformer
from flux_runtime.weights import flux2_layout
from flux_runtime.weights.builtin import BUILTINS
from flux_runtime.weights.checkpoint import (
    BlockKeys,
    ConfigKeys,
    TransformerCheckpoint,
    as_checkpoint,
    builtin_spec,
    transformer_family,
)
from flux_runtime.weights.dit_loading import DitFamily, checked_load_args, load_dit, random_dit

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
FLUX2 = DitFamily(
    CONFIG_KEYS, flux2_layout, Flux2Transformer, lacks="no shared modulation weights", depths_count_fp8=True
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
    device, dtype = checked_load_args(device, dtype, fp8)
    spec = builtin_spec(path_or_id)
    if spec is not None and spec.family == "flux2" and spec.trained:  # a shipped BFL file, the preset's RoPE
        path_or_id, config = BUILTINS[spec.name].transformer_path, config or PRESETS[spec.preset or ""]
        spec = None
    if spec is not None and spec.family == "flux2":
        assert spec.preset is not None
        return random_dit(Flux2Transformer, config or PRESETS[spec.preset], spec.seed, device, dtype, fp8)
    return load_dit(as_checkpoint(path_or_id), FLUX2, device=device, dtype=dtype, config=config, fp8=fp8)
