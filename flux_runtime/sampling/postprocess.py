"""After the loop: undo the VAE's latent normalization, and turn decoded images into uint8 / PIL.

Both follow `FluxPipeline.__call__` and `VaeImageProcessor.postprocess` (diffusers 0.42.1), including where
they round: the arithmetic runs in the tensor's own dtype (bf16 in practice), not in fp32.
"""

from __future__ import annotations

import numpy as np
from PIL import Image
from torch import Tensor


def denormalize_latents(latents: Tensor, scaling_factor: float, shift_factor: float) -> Tensor:
    """`latents / scaling_factor + shift_factor`: the VAE decoder's input from the sampled latents.

    Two ops in the latents' dtype (divide, then add), as diffusers does; `(B, 16, h, w)` unpacked latents.
    The factors are the VAE config's (`scaling_factor` 0.3611, `shift_factor` 0.1159 for FLUX.1).
    """
    return (latents / scaling_factor) + shift_factor


def to_uint8_images(decoded: Tensor) -> np.ndarray:
    """Decoded images `(B, 3, H, W)` in about [-1, 1] to uint8 numpy `(B, H, W, 3)`.

    `(x * 0.5 + 0.5).clamp(0, 1)` in the tensor's dtype (bf16 rounds here), then `.float()`, NHWC on the CPU,
    and `(x * 255).round().astype(uint8)` in numpy float32: FluxPipeline's `output_type="pil"` path.
    """
    if decoded.ndim != 4 or decoded.shape[1] != 3:
        raise ValueError(f"to_uint8_images: expected images (B, 3, H, W), got shape {tuple(decoded.shape)}")
    images = (decoded * 0.5 + 0.5).clamp(0, 1)
    array = images.cpu().permute(0, 2, 3, 1).float().numpy()
    return (array * 255).round().astype("uint8")


def to_pil_images(decoded: Tensor) -> list[Image.Image]:
    """Decoded images `(B, 3, H, W)` to a list of B RGB PIL images; pixels as `to_uint8_images`."""
    return [Image.fromarray(image) for image in to_uint8_images(decoded)]
