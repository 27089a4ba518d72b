"""The transformer with an IP-Adapter is bit-identical to diffusers' FluxTransformer2DModel with its
FluxIPAdapterAttnProcessor: a batch whose rows see different images, per-block scales, fp32 and bf16; the
image tokens projected once (`project_image`) give what diffusers' per-forward projection gives."""

from __future__ import annotations

import pytest
import torch

from flux_runtime import load_transformer
from flux_runtime.pipeline.ip_adapter import build_adapter
from flux_runtime.weights.ip_adapter import read_ip_adapter
from tests import flux1_fixtures
from tests.flux1_fixtures import make_diffusers_transformer, make_inputs
from tests.ip_adapter.ip_fixtures import EMBED_DIM, save_adapter, xlabs_tensors
from tests.models.helpers import diffusers_forward


def _diffusers_state(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """XLabs' keys as diffusers' `load_ip_adapter` hands them to the transformer."""
    out: dict[str, dict[str, torch.Tensor]] = {"image_proj": {}, "ip_adapter": {}}
    for key, t in tensors.items():
        if key.startswith("ip_adapter_proj_model."):
            out["image_proj"][key.removeprefix("ip_adapter_proj_model.")] = t
        else:
            _, i, _, name, part = key.split(".")
            out["ip_adapter"][f"{i}.to_{name[-6]}_ip.{part}"] = t
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_equals_diffusers(tmp_path, dtype: torch.dtype) -> None:
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    ref = make_diffusers_transformer(True)
    ours = load_transformer(flux1_fixtures.save_diffusers(ref, tmp_path / "transformer"), dtype=dtype)
    ref = ref.to(dtype)
    ref._load_ip_adapter_weights([_diffusers_state(xlabs_tensors())])
    scales = [0.4, 1.3]
    procs = [p for p in ref.attn_processors.values() if isinstance(p, FluxIPAdapterAttnProcessor)]
    for proc, scale in zip(procs, scales, strict=True):
        proc.scale = [scale]
    weights = read_ip_adapter(save_adapter(tmp_path / "adapter"))
    adapter = build_adapter(weights, ours.config, torch.device("cpu"), dtype)
    adapter.set_scale(scales)
    ours.set_ip_adapter(adapter)

    img, img_ids, txt, txt_ids, t, y, g = make_inputs(2, 4, 3, 9, dtype)
    embeds = torch.randn(2, 1, EMBED_DIM, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    with torch.no_grad():
        want = diffusers_forward(
            ref, img, img_ids, txt, txt_ids, t, g, pooled_projections=y,
            joint_attention_kwargs={"ip_adapter_image_embeds": [embeds]},
        )  # fmt: skip
        got = ours(img, img_ids, txt, txt_ids, t, y, g, ip=ours.project_image(embeds))
        plain = ours(img, img_ids, txt, txt_ids, t, y, g)
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)
    ours.set_ip_adapter(None)
    with torch.no_grad(), pytest.raises(ValueError, match="needs an IP-Adapter"):
        ours(img, img_ids, txt, txt_ids, t, y, g, ip=torch.zeros(2, 1, 4, 32, dtype=dtype))
