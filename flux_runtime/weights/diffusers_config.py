"""The `config.json` diffusers writes for a FLUX transformer or VAE, from our configs.

What `from_pretrained` needs to rebuild the model the converter wrote; checked against diffusers' own
configs in the tests.
"""

from __future__ import annotations

from typing import Any

from flux_runtime.models.dit import DiTConfig
from flux_runtime.models.vae.flux2 import PATCH, Flux2VAEConfig
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.vae import AnyVAEConfig

# The diffusers release whose config.json fields and file names we write (our parity target).
DIFFUSERS_VERSION = "0.42.1"
# What diffusers' FLUX.1 `vae/config.json` says beyond the architecture.
FLUX1_VAE_SAMPLE_SIZE = 1024
# What FLUX.2's BFL code fixes and diffusers' configs state (AutoencoderKLFlux2 and
# Flux2Transformer2DModel defaults, which diffusers' FLUX.2 converter keeps).
FLUX2_VAE_SAMPLE_SIZE = 1024
FLUX2_BN_MOMENTUM = 0.1
FLUX2_DIFFUSERS_FIXED: dict[str, Any] = {"patch_size": 1, "timestep_guidance_channels": 256, "eps": 1e-6}
# What FLUX.3's BFL code fixes and diffusers' `Flux3Transformer2DModel` config states (its defaults).
FLUX3_DIFFUSERS_FIXED: dict[str, Any] = {"timestep_channels": 256, "eps": 1e-6}


def transformer_diffusers_config(cfg: DiTConfig) -> dict[str, Any]:
    """The config.json diffusers writes for a `FluxTransformer2DModel` (FLUX.1), a `Flux2Transformer2DModel`
    (FLUX.2) or a `Flux3Transformer2DModel` (FLUX.3) of this shape (same fields)."""
    shared = {
        "_diffusers_version": DIFFUSERS_VERSION,
        "attention_head_dim": cfg.head_dim,
        "axes_dims_rope": list(cfg.axes_dim),
        # FLUX.3 has no out_channels: its output width is in_channels (our config checks they agree)
        "in_channels": cfg.in_channels,
        "joint_attention_dim": cfg.context_in_dim,
        "num_attention_heads": cfg.num_heads,
        "num_layers": cfg.depth,
        "num_single_layers": cfg.depth_single_blocks,
    }
    if cfg.family == "flux3":
        return {
            "_class_name": "Flux3Transformer2DModel",
            **shared,
            "cond_in_channels": cfg.cond_in_channels,
            "flow_map": cfg.flow_map,
            "mlp_ratio": cfg.mlp_ratio,
            "rope_theta": cfg.theta,
            **FLUX3_DIFFUSERS_FIXED,
        }
    # FLUX.1 and FLUX.2: a guidance embedder or not; diffusers' default out_channels None means "as in_channels"
    shared["guidance_embeds"] = cfg.guidance_embed
    shared["out_channels"] = None if cfg.out_channels == cfg.in_channels else cfg.out_channels
    if cfg.family == "flux2":
        return {
            "_class_name": "Flux2Transformer2DModel",
            **shared,
            "mlp_ratio": cfg.mlp_ratio,
            "rope_theta": cfg.theta,
            **FLUX2_DIFFUSERS_FIXED,
        }
    unsupported = []
    if cfg.mlp_ratio != 4.0:
        unsupported.append(f"mlp_ratio {cfg.mlp_ratio} (diffusers fixes 4.0)")
    if not cfg.qkv_bias:
        unsupported.append("qkv_bias False")
    if cfg.theta != 10_000:
        unsupported.append(f"theta {cfg.theta} (diffusers fixes 10000)")
    if len(cfg.axes_dim) != 3:
        unsupported.append(f"{len(cfg.axes_dim)} RoPE axes (diffusers has 3)")
    if unsupported:
        raise WeightsError("diffusers' FluxTransformer2DModel cannot express " + ", ".join(unsupported))
    return {
        "_class_name": "FluxTransformer2DModel",
        **shared,
        "patch_size": 1,
        "pooled_projection_dim": cfg.vec_in_dim,
    }


def vae_diffusers_config(cfg: AnyVAEConfig) -> dict[str, Any]:
    """The config.json diffusers writes for an `AutoencoderKL` (FLUX.1) or an `AutoencoderKLFlux2`
    (FLUX.2) of this shape (same fields; `sample_size`, diffusers' tile size, is FLUX's 1024)."""
    n = len(cfg.ch_mult)
    shared = {
        "_diffusers_version": DIFFUSERS_VERSION,
        "act_fn": "silu",
        "block_out_channels": list(cfg.block_channels),
        "down_block_types": ["DownEncoderBlock2D"] * n,
        "in_channels": cfg.in_channels,
        "latent_channels": cfg.z_channels,
        "layers_per_block": cfg.num_res_blocks,
        "mid_block_add_attention": True,
        "norm_num_groups": cfg.norm_num_groups,
        "out_channels": cfg.out_ch,
        "up_block_types": ["UpDecoderBlock2D"] * n,
    }
    if isinstance(cfg, Flux2VAEConfig):
        return {
            "_class_name": "AutoencoderKLFlux2",
            **shared,
            "batch_norm_eps": cfg.batch_norm_eps,
            "batch_norm_momentum": FLUX2_BN_MOMENTUM,
            "decoder_block_out_channels": None,
            "patch_size": [PATCH, PATCH],
            "sample_size": FLUX2_VAE_SAMPLE_SIZE,
            "use_post_quant_conv": True,
            "use_quant_conv": True,
        }
    return {
        "_class_name": "AutoencoderKL",
        **shared,
        "force_upcast": True,
        "latents_mean": None,
        "latents_std": None,
        "sample_size": FLUX1_VAE_SAMPLE_SIZE,
        "scaling_factor": cfg.scale_factor,
        "shift_factor": cfg.shift_factor,
        "use_post_quant_conv": False,
        "use_quant_conv": False,
    }
