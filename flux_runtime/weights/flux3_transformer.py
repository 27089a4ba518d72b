"""`load_flux3_transformer`: a FLUX.3 Image Klein DiT from a BFL file, a diffusers folder, or a cached model id.

The steps of the other families' loaders with FLUX.3's key table (`flux3_layout`): the layout is read from the
keys, the shape from the tensors (plus `config.json` for the RoPE axes when there is one), base or flow map
from the presence of the target-timestep embedder; the model is built on the meta device and each tensor is
streamed to the target device, in the model dtype except the QK-norm weights, which stay fp32 as diffusers'
`from_pretrained` keeps them. Missing, unexpected and misshapen keys are named; BFL's training-only
`repa_projectors.*` are skipped by name. `load_transformer` dispatches here when the keys are FLUX.3's.

FP8 as for FLUX.2 (`weights.fp8`, which lists the FLUX.3 layers that run in e4m3 and why the rest stay
bf16): FP8 checkpoints (a ModelOpt-style diffusers folder, such as `flux-convert quantize` writes, or a
ComfyUI scaled-FP8 / plain e4m3 BFL file) load with their e4m3 weights and scales as they are, and
`fp8=True` quantizes a bf16 checkpoint's block projections as they stream in. The QK-norm weights stay
fp32 either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from flux_runtime.models.dit import PRESETS, DiTConfig
from flux_runtime.models.dit.flux3 import Flux3Transformer
from flux_runtime.weights import flux3_layout
from flux_runtime.weights import fp8 as fp8_layers
from flux_runtime.weights.checkpoint import (
    BlockKeys,
    ConfigKeys,
    TransformerCheckpoint,
    as_checkpoint,
    builtin_spec,
    finish_builtin,
)
from flux_runtime.weights.dit_loading import DitFamily, checked_load_args, load_dit
from flux_runtime.weights.keys import KeyView
from flux_runtime.weights.random_init import init_random

# The stored names of the weights kept in fp32 (BFL, diffusers).
_FP32_KEYS = (".norm.query_norm.scale", ".norm.key_norm.scale", ".attn.norm_q.weight", ".attn.norm_k.weight")


class _Fp32Norms:
    """A tensor reader that reads the QK-norm weights in fp32 and every other tensor in the asked dtype."""

    def __init__(self, reader: KeyView | object) -> None:
        self.reader = reader

    def get(self, key: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self.reader.get(key, device, torch.float32 if key.endswith(_FP32_KEYS) else dtype)  # type: ignore[attr-defined]

    def path_of(self, key: str) -> Path:
        return self.reader.path_of(key)  # type: ignore[attr-defined]

    def streaming(self, keys: Iterable[str], device: torch.device) -> AbstractContextManager[None]:
        return self.reader.streaming(keys, device)  # type: ignore[attr-defined]


# The BFL-named tensors that state a FLUX.3 DiT's widths (`infer_dit_config`); the per-mode blocks'
# text-mode half stands for them all.
CONFIG_KEYS = ConfigKeys(
    family="flux3",
    name="FLUX.3",
    default_theta=10_000,
    img_in="emb_in.image.weight",
    final="final_layer.image.linear.weight",
    txt_in="txt_in.weight",
    double=BlockKeys("txt_mode_blocks.0.norm.query_norm.scale", "txt_mode_blocks.0.mlp_out.weight"),
    single=BlockKeys("single_blocks.0.norm.query_norm.scale", "single_blocks.0.mlp_out.weight"),
    flag="flow_map",
    cond_in="emb_in.image_cond.weight",
)
FLUX3 = DitFamily(
    CONFIG_KEYS, flux3_layout, Flux3Transformer, lacks="no per-mode modulation weights",
    skip=flux3_layout.training_only, tensors=_Fp32Norms,
)  # fmt: skip


def random_flux3(
    cfg: DiTConfig, seed: int, device: torch.device, dtype: torch.dtype, fp8: bool = False
) -> Flux3Transformer:
    """A seeded random FLUX.3 model (built-in names, benchmarks): drawn in fp32, cast with fp32 QK norms,
    its block projections quantized to FP8 when `fp8` (bf16 only)."""
    fp8_layers.check_dtype(dtype, fp8)
    with torch.device("meta"):
        model = Flux3Transformer(cfg)
    model = init_random(model, seed, device, torch.float32).cast_to(dtype)
    return finish_builtin(model, dtype, fp8=fp8)


def load_flux3_transformer(
    path_or_id: str | Path | TransformerCheckpoint,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: DiTConfig | None = None,
    fp8: bool = False,
) -> Flux3Transformer:
    """Load a FLUX.3 Image Klein transformer (base or flow map), ready for inference (eval mode, no grads).

    `path_or_id`: a BFL single file (optionally `model.diffusion_model.` prefixed), a diffusers `transformer/`
    folder or pipeline root (sharded or not), a Hugging Face model id in the local cache, or the built-in random
    `tiny-flux3-random`. `config` is optional; when given it must agree with the checkpoint (its `axes_dim` and
    `theta` are then used). The QK-norm weights load in fp32 whatever `dtype`.

    FP8 checkpoints load with their block projections in e4m3 (bf16 only); `fp8=True` quantizes a bf16
    checkpoint's block projections at load (per-channel weight scales, per-row activation scales).
    `.precision` says which (`bf16`, `fp8-static`, `fp8-dynamic`), `.quantized_at_load` whether `fp8` did it.
    """
    device, dtype = checked_load_args(device, dtype, fp8)
    spec = builtin_spec(path_or_id)
    if spec is not None and spec.family == "flux3":
        assert spec.preset is not None  # every built-in model has an architecture
        return random_flux3(config or PRESETS[spec.preset], spec.seed, device, dtype, fp8)
    return load_dit(as_checkpoint(path_or_id), FLUX3, device=device, dtype=dtype, config=config, fp8=fp8)
