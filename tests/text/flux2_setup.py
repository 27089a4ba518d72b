"""What the FLUX.2 text-encoder tests share: the flavours, prompts, diffusers' pipeline around an encoder and the
comparison of embeddings (their fixtures `pixtral` and `flux2_folders` are in conftest.py)."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline
from torch import Tensor

from flux_runtime.text import Flux2TextEmbeddings, Flux2TextEncoder, KleinTextEncoder
from flux_runtime.text.tokenizers import TINY_TOKENIZERS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLAVOURS = {"dev": Flux2TextEncoder, "klein": KleinTextEncoder}
PROMPTS = ["a photo of a cat sitting on a wooden table", "An astronaut riding a horse on the Moon, 4k!"]
# Several hundred tokens with either tiny tokenizer: cut at max_sequence_length 128.
LONG = "a castle on a hill at sunset, fantasy style, highly detailed, " * 16
Encoder = Flux2TextEncoder | KleinTextEncoder
Pipeline = Flux2Pipeline | Flux2KleinPipeline


def pipeline_for(encoder: Encoder, pixtral: type) -> Pipeline:
    """diffusers' pipeline around `encoder`'s model (no DiT or VAE: encode_prompt needs none).

    [dev] gets its own PixtralProcessor, loaded by transformers from the shipped tokenizer folder; [klein] the
    encoder's Qwen2TokenizerFast.
    """
    common = {"scheduler": FlowMatchEulerDiscreteScheduler(), "vae": None, "transformer": None}
    if isinstance(encoder, Flux2TextEncoder):
        processor = pixtral.from_pretrained(TINY_TOKENIZERS / "mistral")
        return Flux2Pipeline(text_encoder=encoder.model, tokenizer=processor, **common)
    return Flux2KleinPipeline(
        text_encoder=encoder.model, tokenizer=encoder.tokenizer, is_distilled=False, **common
    )


def assert_same(got: Flux2TextEmbeddings, want: tuple[Tensor, Tensor], dtype: torch.dtype) -> None:
    assert isinstance(got, Flux2TextEmbeddings)
    (embeds, ids), (want_embeds, want_ids) = got, want
    assert embeds.dtype == want_embeds.dtype == dtype
    assert ids.dtype == want_ids.dtype == torch.int64
    assert embeds.shape == want_embeds.shape and ids.shape == want_ids.shape
    assert torch.equal(embeds, want_embeds), (
        f"max |diff| {(embeds.float() - want_embeds.float()).abs().max()}"
    )
    assert torch.equal(ids, want_ids)


def our_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("flux_runtime.text")]
