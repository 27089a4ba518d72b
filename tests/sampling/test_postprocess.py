"""Denormalization and uint8/PIL conversion against FluxPipeline's decode path and VaeImageProcessor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from flux_runtime.sampling import denormalize_latents, to_pil_images, to_uint8_images


def decoded_images(batch: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """VAE-like output: mostly in [-1, 1], some beyond so the clamp matters; odd, non-square size."""
    gen = torch.Generator().manual_seed(seed)
    return (0.6 * torch.randn(batch, 3, 48, 80, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
def test_uint8_matches_pipeline_pil_path(bare_pipe: FluxPipeline, dtype, batch: int) -> None:
    decoded = decoded_images(batch, dtype)
    as_np = bare_pipe.image_processor.postprocess(decoded, output_type="np")
    ref = (as_np * 255).round().astype("uint8")  # VaeImageProcessor.numpy_to_pil, FluxPipeline's "pil" output
    ours = to_uint8_images(decoded)
    assert ours.dtype == np.uint8 and ours.shape == (batch, 48, 80, 3)
    assert np.array_equal(ours, ref)
    assert ours.min() == 0 and ours.max() == 255

    pil_ref = bare_pipe.image_processor.postprocess(decoded, output_type="pil")
    pil_ours = to_pil_images(decoded)
    assert len(pil_ours) == len(pil_ref) == batch
    for a, b in zip(pil_ours, pil_ref, strict=True):
        assert a.mode == b.mode == "RGB" and a.size == b.size == (80, 48)
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_bf16_denormalize_happens_before_float() -> None:
    """(x*0.5 + 0.5) rounds in bf16 before the uint8 conversion; doing it in fp32 gives other pixels."""
    decoded = decoded_images(2, torch.bfloat16)
    via_fp32 = (decoded.float() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    assert not np.array_equal(to_uint8_images(decoded), (via_fp32 * 255).round().astype("uint8"))


def test_uint8_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"expected images \(B, 3, H, W\), got shape \(3, 8, 8\)"):
        to_uint8_images(torch.zeros(3, 8, 8))
    with pytest.raises(ValueError, match=r"expected images \(B, 3, H, W\), got shape \(1, 4, 8, 8\)"):
        to_pil_images(torch.zeros(1, 4, 8, 8))


def test_denormalize_latents_rounds_in_bf16() -> None:
    """Divide then add, each rounded to bf16 (exact parity with FluxPipeline is in test_euler's end-to-end test)."""
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = denormalize_latents(latents, 0.3611, 0.1159)
    assert out.dtype == torch.bfloat16
    fused_fp32 = (latents.float() / 0.3611 + 0.1159).to(torch.bfloat16)  # one rounding at the end
    assert not torch.equal(out, fused_fp32)
    torch.testing.assert_close(out, fused_fp32, rtol=2**-7, atol=2**-7)
