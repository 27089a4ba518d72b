"""The FLUX.1 ControlNet model and loader: each kind (InstantX, union, XLabs) loaded from the folder diffusers
wrote, and XLabs' single-file layout, gives `FluxControlNetModel`'s residuals bit for bit; bad files are named."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.weights.controlnet import load_controlnet
from flux_runtime.weights.errors import WeightsError
from tests.controlnet_fixtures import make_diffusers_controlnet, save_xlabs
from tests.flux1_fixtures import make_diffusers_transformer, make_inputs, save_bfl
from tests.random_models import save_diffusers, save_tensors


def residuals_both(kind: str, dtype: torch.dtype, ours_from):
    ref = make_diffusers_controlnet(kind).to(dtype)
    ours = ours_from(ref)
    img, img_ids, txt, txt_ids, t, y, g = make_inputs(2, 4, 4, 5, dtype)
    gen = torch.Generator().manual_seed(1)
    shape = (2, 3, 64, 64) if kind == "xlabs" else (2, 16, 64)
    cond = torch.randn(shape, generator=gen).to(dtype)
    mode = torch.tensor([[1], [2]]) if kind == "union" else None
    with torch.no_grad():
        want = ref(
            hidden_states=img, controlnet_cond=cond, controlnet_mode=mode, conditioning_scale=0.7,
            encoder_hidden_states=txt, pooled_projections=y, timestep=t, img_ids=img_ids, txt_ids=txt_ids,
            guidance=g, return_dict=False,
        )  # fmt: skip
        got = ours(img, cond, mode, txt, y, t, g, ours.rope(ours.text_ids(txt_ids), img_ids), 0.7)
    return want, got, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["instantx", "union", "xlabs"])
def test_diffusers_folder_gives_diffusers_residuals(tmp_path, kind, dtype):
    def from_folder(ref):
        return load_controlnet(save_diffusers(ref, tmp_path / kind), dtype=dtype)

    (double, single), got, ours = residuals_both(kind, dtype, from_folder)
    assert ours.control.kind == kind
    assert len(got.double) == len(double) and all(map(torch.equal, got.double, double))
    assert got.single == () if single is None else all(map(torch.equal, got.single, single))
    assert got.repeat == (kind == "xlabs")


@pytest.mark.parametrize("kind", ["xlabs", "instantx"])
def test_xlabs_layout_file_loads_the_same_model(tmp_path, kind):
    def from_file(ref):
        folder_model = load_controlnet(save_diffusers(ref, tmp_path / "d"), dtype=torch.float32)
        return load_controlnet(
            save_xlabs(ref, tmp_path / "x.safetensors", folder_model.control), dtype=torch.float32
        )

    (double, _), got, _ = residuals_both(kind, torch.float32, from_file)
    assert all(map(torch.equal, got.double, double))


def test_a_transformer_is_not_a_controlnet(tmp_path):
    path = save_bfl(make_diffusers_transformer(True), tmp_path / "flux1.safetensors")
    with pytest.raises(WeightsError, match="a transformer, not a ControlNet"):
        load_controlnet(path)


def test_other_files_are_named(tmp_path):
    path = save_tensors({"lora_unet_x.lora_down.weight": torch.zeros(2, 2)}, tmp_path / "lora.safetensors")
    with pytest.raises(WeightsError, match=r"not a FLUX\.1 ControlNet"):
        load_controlnet(path)
    with pytest.raises(WeightsError, match="neither an existing file"):
        load_controlnet(tmp_path / "missing.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no ControlNet here"):
        load_controlnet(tmp_path / "empty")
