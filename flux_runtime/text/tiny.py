"""Tiny random CLIP and T5 text encoders for tests and the offline demo (no download, same code paths).

Widths are 32 so their outputs fit the tiny DiT preset (`flux_runtime.models.dit.TINY`: `context_in_dim=32`
for the T5 sequence, `vec_in_dim=32` for the pooled CLIP vector). Weights come from a seeded CPU generator,
not from transformers' initializers, so a seed gives the same encoders on every machine and version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds
    from transformers import CLIPTextConfig, T5Config

TINY_WIDTH = 32


def tiny_clip_config(vocab_size: int) -> CLIPTextConfig:
    """CLIP-L's text tower shrunk to width 32, 2 layers; 77 positions and CLIP-L's legacy special-token ids.

    `eos_token_id=2` is what openai/clip-vit-large-patch14's config says; it makes transformers pool at
    `argmax(input_ids)`, which is the first `<|endoftext|>` because that token has the highest id, as in CLIP-L.
    """
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TINY_WIDTH,
        intermediate_size=2 * TINY_WIDTH,
        projection_dim=TINY_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        bos_token_id=0,
        pad_token_id=1,
        eos_token_id=2,
    )


def tiny_t5_config(vocab_size: int) -> T5Config:
    """T5 v1.1's encoder shrunk to d_model 32, 2 blocks; gated-GELU, 32 relative-position buckets as T5-XXL."""
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size,
        d_model=TINY_WIDTH,
        d_kv=8,
        num_heads=4,
        d_ff=2 * TINY_WIDTH,
        num_layers=2,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        layer_norm_epsilon=1e-6,
        dropout_rate=0.0,
        tie_word_embeddings=False,
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


@torch.no_grad()
def init_random(model: nn.Module, seed: int) -> nn.Module:
    """Overwrite every parameter of `model` in place with seeded values and return it.

    Matrices (linear and embedding weights) get `U(-1/sqrt(cols), 1/sqrt(cols))` like `nn.Linear`; vectors are
    norm scales (`...weight`, near 1) or biases (near 0), so activations stay in a sane range through the layers.
    Values are drawn in fp32 on the CPU in parameter order, then cast, so a seed fixes them on any device/dtype.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # shared (tied) parameters come once
        if param.ndim == 2:
            value = (torch.rand(param.shape, generator=gen) * 2 - 1) * param.shape[1] ** -0.5
        elif name.endswith("weight"):
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        else:
            value = 0.02 * torch.randn(param.shape, generator=gen)
        param.copy_(value)
    return model
