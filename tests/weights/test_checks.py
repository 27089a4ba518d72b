"""What the loaders refuse, by name: non-float load dtypes, unknown devices, integer or bool weights,
NaN or infinite weights, and config.json / index.json fields of the wrong kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flux_runtime.weights import WeightsError, load_transformer, load_vae
from flux_runtime.weights.checks import FiniteCheck, check_weight_dtypes
from flux_runtime.weights.safetensors_io import TensorSource


@pytest.fixture(scope="module")
def tiny_sd() -> dict[str, torch.Tensor]:
    """The built-in tiny transformer's weights: BFL names, so saved as they are they make a BFL file."""
    return {
        k: v.contiguous()
        for k, v in load_transformer("tiny-random", dtype=torch.float32).state_dict().items()
    }


def _save(sd: dict[str, torch.Tensor], path: Path, **changes: torch.Tensor) -> Path:
    save_file({**sd, **changes}, path)
    return path


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dtype=torch.int8), "dtype torch.int8 is not a floating-point dtype"),
        (dict(dtype="bf16"), "dtype 'bf16' must be a torch.dtype"),
        (dict(device="gpu"), "device 'gpu' is not one to run on: use 'cpu', 'cuda', 'cuda:N' or 'mps'"),
        (dict(device="meta"), "device 'meta' is not one to run on"),
    ],
)
@pytest.mark.parametrize("loader", [load_transformer, load_vae], ids=["transformer", "vae"])
def test_bad_load_arguments_are_refused(loader, kwargs, message) -> None:
    with pytest.raises(WeightsError, match=message):
        loader("tiny", **kwargs)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int64], ids=str)
def test_integer_or_bool_weights_are_named_with_their_dtype(tmp_path, tiny_sd, dtype) -> None:
    path = _save(tiny_sd, tmp_path / "t.safetensors", **{"txt_in.weight": tiny_sd["txt_in.weight"].to(dtype)})
    with pytest.raises(WeightsError, match=r"t.safetensors: txt_in.weight is stored as (I8|BOOL|I64)"):
        load_transformer(path, dtype=torch.float32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e6], ids=["nan", "inf", "beyond-fp16"])
def test_non_finite_weights_are_named(tmp_path, tiny_sd, bad) -> None:
    w = tiny_sd["double_blocks.0.img_mlp.0.weight"].clone()
    w[1, 2] = bad
    path = _save(tiny_sd, tmp_path / "t.safetensors", **{"double_blocks.0.img_mlp.0.weight": w})
    with pytest.raises(
        WeightsError, match=r"double_blocks.0.img_mlp.0.weight holds NaN or infinite values in float16"
    ):
        load_transformer(path, dtype=torch.float16)
    if bad == 1e6:  # finite in the checkpoint's float32: loads
        load_transformer(path, dtype=torch.float32)


def test_non_finite_vae_weights_are_named(tmp_path) -> None:
    sd = {k: v.contiguous() for k, v in load_vae("tiny-random", dtype=torch.float32).state_dict().items()}
    sd["decoder.conv_in.bias"] = sd["decoder.conv_in.bias"].clone()
    sd["decoder.conv_in.bias"][0] = float("nan")
    path = _save(sd, tmp_path / "ae.safetensors")
    with pytest.raises(WeightsError, match=r"ae.safetensors: decoder.conv_in.bias holds NaN"):
        load_vae(path, dtype=torch.float32)


def test_float8_weights_pass_the_dtype_check_and_are_checked_for_nan(tmp_path) -> None:
    # float8 checkpoints are for a loader that pairs them with scales: neither check may refuse or crash on them
    w = torch.tensor([[0.5, -2.0], [448.0, 1.0]]).to(torch.float8_e4m3fn)
    path = _save({"w": w, "s": torch.ones(2, dtype=torch.float8_e5m2)}, tmp_path / "f8.safetensors")
    src = TensorSource([path])
    check_weight_dtypes(src, ["w", "s"])
    finite = FiniteCheck()
    for key in ("w", "s"):
        finite.watch(key, path, src.get(key))
    finite.raise_if_any()
    nan = torch.tensor([float("nan")]).to(torch.float8_e4m3fn)
    finite.watch("nan", path, nan)
    with pytest.raises(WeightsError, match="nan holds NaN or infinite values in float8_e4m3fn"):
        finite.raise_if_any()


def _diffusers_style_folder(tmp_path: Path, sd: dict[str, torch.Tensor]) -> Path:
    folder = tmp_path / "transformer"
    folder.mkdir()
    save_file(sd, folder / "diffusion_pytorch_model.safetensors")
    return folder


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ([1, 2], r"config.json: expected a JSON object, found a list"),
        (
            {"axes_dims_rope": "8,12,12"},
            r"config.json: 'axes_dims_rope' must be a list of integers, got \"8,12,12\"",
        ),
        (
            {"axes_dims_rope": [4, 4]},
            r"shapes and config.json give no valid model \(axes_dim \(4, 4\) sums to 8",
        ),
        ({"rope_theta": "1e4"}, r"'rope_theta' must be a finite number"),
    ],
)
def test_config_json_fields_are_type_checked(tmp_path, tiny_sd, config, message) -> None:
    folder = _diffusers_style_folder(tmp_path, tiny_sd)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=message):
        load_transformer(folder, dtype=torch.float32)


@pytest.mark.parametrize("weight_map", [["a.safetensors"], {"x": 3}, {"x": "../up.safetensors"}], ids=str)
def test_index_weight_map_must_map_keys_to_shard_names(tmp_path, weight_map) -> None:
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    with pytest.raises(WeightsError, match="not a valid safetensors index"):
        load_transformer(folder, dtype=torch.float32)


def test_a_misshapen_input_layer_is_named(tmp_path, tiny_sd) -> None:
    path = _save(tiny_sd, tmp_path / "t.safetensors", **{"img_in.weight": torch.zeros(3, 4, 5)})
    with pytest.raises(
        WeightsError, match=r"img_in.weight has shape \(3, 4, 5\), not the non-empty 2-D tensor"
    ):
        load_transformer(path, dtype=torch.float32)
