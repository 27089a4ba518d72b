"""BFL single files of the FLUX.1 variants load: Fill (384 input channels) and Depth/Canny (128) widths come from
the file, and the forward pass stays bit-identical to diffusers' FluxTransformer2DModel of that width (CPU)."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.weights import load_transformer
from tests.flux1_fixtures import make_diffusers_transformer, make_inputs, save_bfl
from tests.models.test_flux1_dit import _reference


@pytest.mark.parametrize("in_channels", [384, 128], ids=["fill", "control"])
def test_variant_bfl_file_loads_with_its_width_and_matches_diffusers(tmp_path, in_channels):
    ref = make_diffusers_transformer(True, in_channels=in_channels, out_channels=64)
    path = save_bfl(ref, tmp_path / "flux1-variant.safetensors")
    ours = load_transformer(path, dtype=torch.float32)
    assert (ours.config.in_channels, ours.config.out_channels) == (in_channels, 64)

    img, img_ids, txt, txt_ids, t, y, g = make_inputs(1, 3, 4, 5, torch.float32)
    img = torch.randn(1, img.shape[1], in_channels, generator=torch.Generator().manual_seed(3))
    expected = _reference(ref, (img, img_ids, txt, txt_ids, t, y, g))
    with torch.no_grad():
        got = ours(img, img_ids, txt, txt_ids, t, y, g)
    assert got.shape == (1, 12, 64)
    assert torch.equal(got, expected)
