"""Tiny IP-Adapter fixtures: a random CLIP vision encoder (transformers) and an adapter file in XLabs' layout
that fits the tiny FLUX.1 of `tests.flux1_fixtures` (text width 32, hidden 64, two double blocks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.flux1_fixtures import TINY_KW
from tests.random_models import jiggle, save_tensors

EMBED_DIM = 24  # the tiny CLIP's projection width


def save_clip_vision(folder: Path, seed: int = 5) -> Path:
    """A tiny random `CLIPVisionModelWithProjection` (32 px images, 8 px patches) saved to `folder`."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    config = CLIPVisionConfig(
        hidden_size=32, intermediate_size=37, projection_dim=EMBED_DIM, num_hidden_layers=2,
        num_attention_heads=2, image_size=32, patch_size=8,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = CLIPVisionModelWithProjection(config)
    jiggle(model, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(folder)
    return folder


def xlabs_tensors(
    seed: int = 7, tokens: int = 4, depth: int = TINY_KW["num_layers"]
) -> dict[str, torch.Tensor]:
    """Random IP-Adapter weights under XLabs' keys for the tiny FLUX.1 (bf16, as XLabs ships them)."""
    gen = torch.Generator().manual_seed(seed)
    width = TINY_KW["joint_attention_dim"]
    hidden = TINY_KW["num_attention_heads"] * TINY_KW["attention_head_dim"]

    def rand(*shape: int, std: float = 0.2, mean: float = 0.0) -> torch.Tensor:
        return (mean + std * torch.randn(*shape, generator=gen)).to(torch.bfloat16)

    out = {
        "ip_adapter_proj_model.proj.weight": rand(tokens * width, EMBED_DIM),
        "ip_adapter_proj_model.proj.bias": rand(tokens * width),
        "ip_adapter_proj_model.norm.weight": rand(width, mean=1.0),
        "ip_adapter_proj_model.norm.bias": rand(width),
    }
    for i in range(depth):
        for kv in "kv":
            key = f"double_blocks.{i}.processor.ip_adapter_double_stream_{kv}_proj"
            out[f"{key}.weight"] = rand(hidden, width)
            out[f"{key}.bias"] = rand(hidden)
    return out


def save_adapter(folder: Path, **kw) -> Path:
    """The adapter written as `folder/ip_adapter.safetensors` (XLabs' file name); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    save_tensors(xlabs_tensors(**kw), folder / "ip_adapter.safetensors")
    return folder


def picture(seed: int, size: tuple[int, int] = (40, 28)) -> Image.Image:
    """A random RGB picture (not square, so the processor's resize and centre crop both act)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
