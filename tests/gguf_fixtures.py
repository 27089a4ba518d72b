"""GGUF files for the tests, written by the `gguf` package (`GGUFWriter`) in city96's BFL key names.

Types the package can quantize (Q8_0, Q4_0/1, Q5_0/1, BF16) are quantized from the weights; the K-quants,
which it can only dequantize, are random blocks whose fp16 scales are set to small finite values (the codes
and sub-block scales stay random bytes: every bit pattern of them is valid).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

QUANT_NAMES = ["Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K"]
# byte offsets of each K-quant block's fp16 super-block scales (d, then dmin where there is one)
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, rows: int, cols: int, seed: int, scale: float = 2e-4) -> np.ndarray:
    """`rows` rows of `cols` values in the K-quant `name` as uint8 blocks: random codes, scales in
    [scale / 4, scale]."""
    qtype = T[name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in _K_SCALES[name]:
        d = rng.uniform(scale / 4, scale, size=data.shape[0]).astype(np.float16)
        data[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, cols // block * size)


def encode(name: str, values: np.ndarray, seed: int) -> np.ndarray:
    """`values` (rows, cols) fp32 stored as `name`: quantized by the package, or random K-quant blocks."""
    if name in _K_SCALES:
        return random_blocks(name, values.shape[0], values.shape[1], seed)
    return gguf.quants.quantize(values, T[name])


Encoded = dict[str, tuple[str, np.ndarray]]  # name -> (GGML type, what the writer stores)


def encode_all(tensors: dict[str, torch.Tensor], type_of: Callable[[str, tuple[int, ...]], str]) -> Encoded:
    """Each tensor in the GGML type `type_of(name, shape)` names (F32, F16 or a quantized type)."""
    out: Encoded = {}
    for i, (name, t) in enumerate(tensors.items()):
        kind = type_of(name, tuple(t.shape))
        values = t.detach().float().numpy()
        if kind == "F32":
            out[name] = (kind, values)
        elif kind == "F16":
            out[name] = (kind, values.astype(np.float16))
        else:
            out[name] = (kind, encode(kind, values, seed=i))
    return out


def write_encoded(entries: Encoded, path: Path) -> Path:
    """Write already encoded tensors as one GGUF file (quantized ones as raw blocks of their type)."""
    writer = gguf.GGUFWriter(str(path), arch="flux")
    for name, (kind, data) in entries.items():
        if kind in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf(
    tensors: dict[str, torch.Tensor], path: Path, type_of: Callable[[str, tuple[int, ...]], str]
) -> Path:
    """Write `tensors` as a GGUF file, each in the GGML type `type_of(name, shape)` names."""
    return write_encoded(encode_all(tensors, type_of), path)


def to_diffusers_names(
    entries: Encoded, layout: ModuleType, model: Any, split: Callable, flag: str = "guidance_embeds"
) -> Encoded:
    """The same stored rows under diffusers' names: fused BFL tensors split by rows (`split(rule, tensor)`, the
    layout's), halves swapped back, applied to the stored bytes as diffusers' own BFL conversion applies them
    to its GGUF parameters. `flag` names the config field that is the layout's third `rules` argument."""
    cfg = model.config
    out: Encoded = {}
    for rule in layout.rules(cfg.num_layers, cfg.num_single_layers, getattr(cfg, flag)):
        kind, data = entries[rule.bfl]
        for name, part in split(rule, torch.from_numpy(data)).items():
            out[name] = (kind, part.contiguous().numpy())
    return out


def write_pair(
    model: Any,
    folder: Path,
    main: str,
    family: str = "flux1",
    type_of: Callable[[str, tuple[int, ...]], str] | None = None,
) -> tuple[Path, Path, Path]:
    """A tiny diffusers FLUX.1 / FLUX.2 / FLUX.3 transformer as GGUF twice, same bytes: BFL names (city96's
    files) and diffusers names (which diffusers' `from_single_file` loads without its BFL conversion, whose FLUX.1
    widths are FLUX.1-dev's); plus a folder with its config.json for that loader. Types by `type_of`, default
    `city96_types(main)`."""
    from flux_runtime.weights import flux1_layout, flux2_layout, flux3_layout
    from tests.random_models import bfl_transformer_state_dict

    # family -> its layout table and the config field that is the table's third argument
    layout, flag = {
        "flux1": (flux1_layout, "guidance_embeds"),
        "flux2": (flux2_layout, "guidance_embeds"),
        "flux3": (flux3_layout, "flow_map"),
    }[family]
    if family == "flux1":
        hidden = model.config.num_attention_heads * model.config.attention_head_dim

        def split(rule, t):
            return flux1_layout.bfl_to_diffusers(rule, t, hidden)
    else:
        split = layout.bfl_to_diffusers
    folder.mkdir(parents=True, exist_ok=True)
    sd = bfl_transformer_state_dict(model, layout, flag)
    entries = encode_all(sd, type_of or city96_types(main))
    bfl = write_encoded(entries, folder / f"{family}-{main}.gguf")
    diffusers = write_encoded(
        to_diffusers_names(entries, layout, model, split, flag), folder / f"diffusers-{main}.gguf"
    )
    model.save_config(folder / "config")
    return bfl, diffusers, folder / "config"


def write_flux1_pair(model: Any, folder: Path, main: str) -> tuple[Path, Path, Path]:
    """`write_pair` of a FLUX.1 transformer."""
    return write_pair(model, folder, main, "flux1")


def diffusers_gguf_transformer(
    path: Path, config: Path, dtype: torch.dtype, cls: str = "FluxTransformer2DModel"
) -> Any:
    """diffusers' GGUF load of `path`: `from_single_file` with a `GGUFQuantizationConfig(compute_dtype=dtype)`."""
    import diffusers

    return getattr(diffusers, cls).from_single_file(
        str(path), config=str(config), local_files_only=True, torch_dtype=dtype,
        quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=dtype),
    )  # fmt: skip


def city96_types(main: str) -> Callable[[str, tuple[int, ...]], str]:
    """Types as city96's files have them: 1-D tensors F32, 2-D weights in `main` where their rows hold
    whole blocks of it, else Q8_0 where they hold whole blocks of 32, else F16."""
    block = gguf.GGML_QUANT_SIZES[T[main]][0]

    def type_of(name: str, shape: tuple[int, ...]) -> str:
        if len(shape) < 2:
            return "F32"
        if shape[-1] % block == 0:
            return main
        return "Q8_0" if shape[-1] % 32 == 0 else "F16"

    return type_of


def diffusers_dequantize(raw: torch.Tensor, name: str) -> torch.Tensor:
    """diffusers' torch dequantization of uint8 blocks (what its `GGUFLinear` multiplies by, before the cast)."""
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    return dequantize_gguf_tensor(GGUFParameter(raw, quant_type=T[name]))


def text_encoder_folders(folder: Path, root: Path) -> dict[str, Path]:
    """CLIP and T5 folders under `root` (each model with its tokenizer), copied from the diffusers pipeline
    `folder`: the text encoders of a BFL file set beside a GGUF transformer."""
    import shutil

    out = {}
    for name, (enc, tok) in {
        "clip": ("text_encoder", "tokenizer"),
        "t5": ("text_encoder_2", "tokenizer_2"),
    }.items():
        shutil.copytree(folder / enc, root / name)
        shutil.copytree(folder / tok, root / name, dirs_exist_ok=True)
        out[name] = root / name
    return out
