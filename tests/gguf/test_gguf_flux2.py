"""FLUX.2 GGUF transformers ([dev] with a guidance embedder, [klein] without): the same loader as FLUX.1's,
bit-identical to diffusers' `Flux2Transformer2DModel.from_single_file` with a `GGUFQuantizationConfig`."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.models.dit.layers import GgufLinear
from flux_runtime.weights.transformer import load_transformer
from tests.flux2_fixtures import make_diffusers_flux2, make_inputs
from tests.gguf_fixtures import diffusers_gguf_transformer, write_pair
from tests.models.helpers import diffusers_forward

pytest.importorskip("diffusers")

# K-quant rows hold 256 values: widened so that the blocks' projections take them (img_in falls back to Q8_0)
WIDE = dict(attention_head_dim=128, joint_attention_dim=256, axes_dims_rope=(32, 32, 32, 32))


@pytest.mark.parametrize("main", ["Q8_0", "Q6_K"])
@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "klein"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flux2_output_is_bit_identical_to_diffusers(tmp_path, main, guidance, dtype):
    model = make_diffusers_flux2(guidance, **(WIDE if main.endswith("_K") else {}))
    bfl, dif, cfg = write_pair(model, tmp_path, main, "flux2")
    ref = diffusers_gguf_transformer(dif, cfg, dtype, "Flux2Transformer2DModel")
    img, img_ids, txt, txt_ids, t, g = make_inputs(1, 3, 5, 7, dtype)
    width = model.config.joint_attention_dim
    txt = torch.randn(1, 7, width, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = diffusers_forward(ref, img, img_ids, txt, txt_ids, t, g)
    for path in (bfl, dif):
        ours = load_transformer(path, device="cpu", dtype=dtype)
        assert ours.config.family == "flux2" and ours.precision == f"gguf-{main}"
        assert isinstance(ours.single_blocks[0].linear1, GgufLinear)
        with torch.no_grad():
            got = ours(img, img_ids, txt, txt_ids, t, g if guidance else None)
        assert torch.isfinite(want).all() and torch.equal(got, want), path.name
