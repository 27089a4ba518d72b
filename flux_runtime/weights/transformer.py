"""`load_transformer`: a FLUX.1, FLUX.2 or FLUX.3 DiT from a BFL file, a diffusers folder, a cached id or a built-in name.

The one family dispatch of the loaders: the checkpoint is opened once (`open_transformer`: files found,
headers read, family told by the keys) and handed to its family's loader (`flux1_transformer`,
`flux2_transformer`, `flux3_transformer`), which build on the helpers in `checkpoint` and never import each other.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flux_runtime.models.dit import PRESETS, DiTConfig, Flux1Transformer, Flux2Transformer, Flux3Transformer
from flux_runtime.weights.builtin import BUILTINS as _BUILTIN_FILES
from flux_runtime.weights.checkpoint import (
    CONFIG_FIELDS,
    TransformerCheckpoint,
    as_checkpoint,
    builtin_spec,
    count_parameters,
    find_transformer_files,
    open_transformer,
    read_folder_config,
    transformer_family,
)
from flux_runtime.weights.dit_loading import checked_load_args, random_dit
from flux_runtime.weights.flux1_transformer import detect_layout, infer_config, load_flux1_transformer
from flux_runtime.weights.flux2_transformer import load_flux2_transformer
from flux_runtime.weights.flux3_transformer import load_flux3_transformer

__all__ = [
    "BUILTIN",
    "CONFIG_FIELDS",
    "TransformerCheckpoint",
    "count_parameters",
    "detect_layout",
    "find_transformer_files",
    "infer_config",
    "load_transformer",
    "open_transformer",
    "read_folder_config",
    "transformer_family",
]

# Random-weight FLUX.1 presets that need no checkpoint, name → seed (kept for callers of the old name;
# the registry is the list).
BUILTIN = {"tiny": 0}


def load_transformer(
    path_or_id: str | Path | TransformerCheckpoint,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: DiTConfig | None = None,
    fp8: bool = False,
) -> Flux1Transformer | Flux2Transformer | Flux3Transformer:
    """Load a FLUX.1, FLUX.2 or FLUX.3 transformer, ready for inference (eval mode, no grads).

    `path_or_id`: a BFL single file (`flux1-dev.safetensors`, optionally with the
    `model.diffusion_model.` prefix), a diffusers `transformer/` folder or pipeline root (sharded or
    not), a Hugging Face model id in the local cache, a built-in random model (`tiny`, `tiny-flux2`), or
    a checkpoint already opened with `open_transformer` (its headers are not read again).
    `config` is optional; when given it must agree with the checkpoint. `.config.family` says which
    family loaded.

    FP8 checkpoints (ModelOpt, ComfyUI scaled FP8, plain e4m3 casts) load as they are, their block
    projections kept in e4m3; `fp8=True` quantizes a bf16 checkpoint's block projections at load
    (per-channel weight scales, per-row activation scales). `.precision` says which (`bf16`,
    `fp8-static`, `fp8-dynamic`). FP8 models compute in bf16 between their FP8 GEMMs.
    A `.gguf` file (the `gguf` extra) loads with its block-quantized projections kept quantized and
    dequantized before each GEMM in `dtype`, as diffusers' GGUF loader does; `.precision` is
    `gguf-<type>` (the type of most of its quantized weights).
    `dtype` must be a floating-point dtype and `device` cpu, cuda, cuda:N or mps. Weights stored as integers
    or bools, and weights holding NaN or infinity, are refused by name.
    """
    device, dtype = checked_load_args(device, dtype, fp8)
    spec = builtin_spec(path_or_id)
    if spec is not None and spec.trained:  # a shipped BFL file, with the preset's RoPE axes
        path_or_id, config = _BUILTIN_FILES[spec.name].transformer_path, config or PRESETS[spec.preset or ""]
        spec = None
    if spec is not None and spec.family == "flux3":
        return load_flux3_transformer(path_or_id, device=device, dtype=dtype, config=config, fp8=fp8)
    if spec is not None:
        assert spec.preset is not None  # every built-in model has an architecture
        cfg = config or PRESETS[spec.preset]
        model_cls = Flux2Transformer if spec.family == "flux2" else Flux1Transformer
        return random_dit(model_cls, cfg, spec.seed, device, dtype, fp8)
    ckpt = as_checkpoint(path_or_id)
    load = {
        "flux1": load_flux1_transformer,
        "flux2": load_flux2_transformer,
        "flux3": load_flux3_transformer,
    }[ckpt.family]
    return load(ckpt, device=device, dtype=dtype, config=config, fp8=fp8)
