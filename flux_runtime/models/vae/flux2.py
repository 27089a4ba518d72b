"""The FLUX.2 autoencoder (a KL-regularised VAE, 32 latent channels, 8x spatial compression).

It is the FLUX.1 network (flux1.py: same blocks, levels, widths and mid-block attention, imported from
there) with three additions:
- a 1x1 `quant_conv` (2z → 2z) after the encoder's `conv_out`, before the posterior split;
- a 1x1 `post_quant_conv` (z → z) before the decoder's `conv_in`;
- BatchNorm running statistics `bn.running_mean` / `bn.running_var` over the 2x2-patchified latent
  (4z = 128 channels, channel `c*4 + dy*2 + dx`). They are never run as a layer: the pipelines
  normalise patchified latents with them (`normalize_latents` / `denormalize_latents`), in place of
  FLUX.1's scale and shift.
Module names equal Black Forest Labs' FLUX.2 `ae.safetensors` keys (`encoder.quant_conv`,
`decoder.post_quant_conv`, `bn.running_mean`); the diffusers `vae/` layout of `AutoencoderKLFlux2` is
mapped by `flux_runtime.weights.vae2_layout`. `encode`/`decode` reproduce diffusers 0.42.1
`AutoencoderKLFlux2` op for op (the 1x1 convs are `nn.Conv2d` there too), and the normalisation
reproduces `Flux2Pipeline`'s arithmetic and dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from flux_runtime.models.vae.flux1 import Decoder, Encoder, KLAutoencoder, VAEShape

# Latent pixels folded into one BatchNorm channel group (and one DiT token) along each side; the
# FLUX.2 pipelines hard-wire 2 (`_patchify_latents`), so it is a constant, not a config field.
PATCH = 2


@dataclass(frozen=True, kw_only=True)
class Flux2VAEConfig(VAEShape):
    """Shape of the FLUX.2 autoencoder: `VAEShape` with 32 latent channels, plus the BatchNorm's eps.

    `batch_norm_eps` is added to the running variance before its square root when latents are
    normalised (diffusers' `batch_norm_eps`, BFL's fixed 1e-4). The BatchNorm holds
    `4 * z_channels` statistics, one per patchified channel (`latent_channels`).
    """

    family: ClassVar[Literal["flux2"]] = "flux2"
    z_channels: int = 32
    batch_norm_eps: float = 1e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.batch_norm_eps > 0:
            raise ValueError(f"batch_norm_eps {self.batch_norm_eps} must be positive")

    @property
    def latent_channels(self) -> int:
        """Channels of a patchified latent (and of a DiT token): `4 * z_channels`, 128 for FLUX.2."""
        return PATCH * PATCH * self.z_channels


FLUX2_VAE = Flux2VAEConfig()
# Two levels of 32 channels, one resnet each: a 2x autoencoder that still gives FLUX.2's 32 latent
# channels (patchified 2x2 into the DiT's 128 input channels). 32 groups, as BFL's code hard-wires.
TINY_FLUX2_VAE = replace(FLUX2_VAE, ch=32, ch_mult=(1, 1), num_res_blocks=1)
# The built-in `tiny-flux2` model's autoencoder, trained by scripts/train_tiny.py: FLUX.2's four levels (8x)
# at widths 32-64, one resnet each; its BatchNorm statistics were computed on the training scenes.
TINY_FLUX2_TRAINED_VAE = replace(FLUX2_VAE, ch=32, ch_mult=(1, 2, 2, 2), num_res_blocks=1)

FLUX2_VAE_PRESETS: dict[str, Flux2VAEConfig] = {
    "flux2": FLUX2_VAE,
    "tiny-flux2": TINY_FLUX2_VAE,
    "tiny-flux2-trained": TINY_FLUX2_TRAINED_VAE,
}


class Flux2Encoder(Encoder):
    """FLUX.1's encoder followed by `quant_conv`: image → posterior moments (B, 2z, H/f, W/f)."""

    def __init__(self, cfg: Flux2VAEConfig) -> None:
        super().__init__(cfg)
        self.quant_conv = nn.Conv2d(2 * cfg.z_channels, 2 * cfg.z_channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.quant_conv(super().forward(x))


class Flux2Decoder(Decoder):
    """`post_quant_conv` followed by FLUX.1's decoder: raw latent (B, z, h, w) → image."""

    def __init__(self, cfg: Flux2VAEConfig) -> None:
        super().__init__(cfg)
        self.post_quant_conv = nn.Conv2d(cfg.z_channels, cfg.z_channels, 1)

    def forward(self, z: Tensor) -> Tensor:
        return super().forward(self.post_quant_conv(z))


class LatentStats(nn.Module):
    """The BatchNorm's running statistics (`running_mean`, `running_var`, each `(4z,)`), as buffers.

    BFL and diffusers store an `nn.BatchNorm2d(affine=False)`; inference only reads these two
    tensors, so nothing else is kept (its `num_batches_tracked` training counter is not).
    """

    running_mean: Tensor
    running_var: Tensor

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))


class Flux2VAE(KLAutoencoder[Flux2VAEConfig]):
    """The FLUX.2 autoencoder: `encode` images to raw latents, `decode` raw latents to images.

    Images are in [-1, 1]; raw latents (B, 32, H/8, W/8) are what diffusers' `AutoencoderKLFlux2`
    gives (`encode(x).latent_dist.mode()`) and takes. The DiT works on latents patchified 2x2 and
    normalised by the BatchNorm statistics: `normalize_latents` / `denormalize_latents`.
    """

    def __init__(self, cfg: Flux2VAEConfig) -> None:
        super().__init__(cfg, Flux2Encoder(cfg), Flux2Decoder(cfg))
        self.bn = LatentStats(cfg.latent_channels)

    def normalize_latents(self, z: Tensor) -> Tensor:
        """`(z - mean) / sqrt(var + eps)` on patchified latents, in `z`'s dtype and device.

        `z` is patchified `(B, 4z, h, w)` (what `Flux2Pipeline._encode_vae_image` normalises) or
        packed tokens `(B, L, 4z)`; the statistics broadcast over channels either way, so both give
        the same values. `Flux2Pipeline`'s arithmetic: `sqrt` in the VAE's dtype, then both
        statistics cast to `z`'s dtype, then subtract and divide there.
        """
        mean, std = self._stats(z)
        return (z - mean) / std

    def denormalize_latents(self, z: Tensor) -> Tensor:
        """`z * sqrt(var + eps) + mean`: sampled latents back to the BatchNorm's scale, before decoding.

        Same shapes, casts and `sqrt` as `normalize_latents`; multiply then add in `z`'s dtype, as
        `Flux2Pipeline.__call__` does before `_unpatchify_latents` and `vae.decode`.
        """
        mean, std = self._stats(z)
        return z * std + mean

    def _stats(self, z: Tensor) -> tuple[Tensor, Tensor]:
        c = self.config.latent_channels
        if z.ndim == 4 and z.shape[1] == c:
            view = (1, -1, 1, 1)  # channels first: (B, 4z, h, w)
        elif z.ndim == 3 and z.shape[2] == c:
            view = (1, 1, -1)  # tokens: (B, L, 4z)
        else:
            raise ValueError(
                f"latents must be patchified (B, {c}, h, w) or packed (B, L, {c}), got {tuple(z.shape)}"
            )
        mean = self.bn.running_mean.view(view).to(z.device, z.dtype)
        std = torch.sqrt(self.bn.running_var.view(view) + self.config.batch_norm_eps).to(z.device, z.dtype)
        return mean, std
