"""FLUX.3's Qwen3-VL text encoder gives diffusers' modular-pipeline embeddings bit for bit (tiny random Qwen3-VL)."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.text.flux3 import LAYERS, TINY_CHAT_TEMPLATE, Flux3TextEncoder, text_ids
from flux_runtime.weights import WeightsError

PROMPTS = {
    "short": "a red fox in the snow",
    "empty": "",
    # long enough to need a second window of 80 tokens
    "long": " ".join(["a cup of coffee on a desk in the morning, shallow depth of field"] * 4),
}


def text_only_processor(encoder: Flux3TextEncoder):
    """A Qwen3VLProcessor holding only the tokenizer and chat template (all a text prompt uses: its image and video
    processors would need torchvision); diffusers calls its `apply_chat_template` and `.tokenizer`."""
    from tests.flux3_upsampler_fixtures import qwen3_vl_processor

    return qwen3_vl_processor(encoder.tokenizer, encoder.chat_template)


def diffusers_embeds(encoder: Flux3TextEncoder, prompt: str, max_sequence_length: int = 8192) -> torch.Tensor:
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    return Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
        encoder.model, text_only_processor(encoder), prompt, max_sequence_length=max_sequence_length
    )


@pytest.fixture(scope="module")
def encoders():
    return {dtype: Flux3TextEncoder.tiny(dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def encoder(encoders):
    return encoders[torch.float32]


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(torch.float32, "short"), (torch.float32, "empty"), (torch.float32, "long"), (torch.bfloat16, "short")],
    ids=str,
)
def test_embeddings_equal_diffusers(encoders, dtype, name):
    encoder = encoders[dtype]
    got = encoder.encode(PROMPTS[name])
    expected = diffusers_embeds(encoder, PROMPTS[name])
    assert (
        got.prompt_embeds.shape == expected.shape
        and got.prompt_embeds.shape[-1] == 8 * 32 == encoder.output_dim
    )
    assert got.prompt_embeds.shape[1] % 80 == 0 and got.prompt_embeds.dtype == encoder.dtype
    assert torch.equal(got.prompt_embeds, expected)
    assert torch.equal(got.text_ids, text_ids(expected.shape[1])) and got.text_ids.dtype == torch.float32


def test_window_padding_and_truncation(encoder, caplog):
    ids, mask, pos = encoder.tokenize(PROMPTS["long"])
    n = int(mask.sum())
    assert ids.shape == mask.shape == pos.shape == (1, 160) and 80 < n < 160
    assert pos[0, :n].tolist() == list(range(n)) and set(pos[0, n:].tolist()) == {1}
    # a cap that is no multiple of 80 is the window itself, the prompt cut to it, with a warning
    got = encoder.encode(PROMPTS["long"], max_sequence_length=100)
    assert got.prompt_embeds.shape[1] == 100 and "the limit is 100" in caplog.text
    assert torch.equal(got.prompt_embeds, diffusers_embeds(encoder, PROMPTS["long"], max_sequence_length=100))
    # the padding's position ids matter (FLUX.3 attends to the padding): 0 would give other states
    out = encoder.model(input_ids=ids, attention_mask=mask, position_ids=pos.masked_fill(mask == 0, 0),
                        output_hidden_states=True, use_cache=False)  # fmt: skip
    assert not torch.equal(out.hidden_states[LAYERS[-1]], encoder.model(
        input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True, use_cache=False
    ).hidden_states[LAYERS[-1]])  # fmt: skip
    n2 = encoder.encode("a", num_images_per_prompt=3).prompt_embeds
    assert n2.shape[0] == 3 and torch.equal(n2[0], n2[2])


@pytest.mark.slow
def test_saved_folder_loads_the_same_encoder(tmp_path):
    tiny = Flux3TextEncoder.tiny(dtype=torch.bfloat16)
    tiny.model.save_pretrained(tmp_path / "text_encoder")
    tiny.tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "tokenizer" / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
    loaded = Flux3TextEncoder.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.chat_template == TINY_CHAT_TEMPLATE
    assert torch.equal(
        loaded.encode(PROMPTS["short"]).prompt_embeds, tiny.encode(PROMPTS["short"]).prompt_embeds
    )


def test_bad_inputs_are_refused(encoder, tmp_path):
    with pytest.raises(TypeError, match="one prompt"):
        encoder.encode(["a", "b"])
    with pytest.raises(ValueError, match=r"max_sequence_length 9000 is not in 1\.\.8192"):
        encoder.encode("a", max_sequence_length=9000)
    with pytest.raises(WeightsError, match="has no text_encoder/, tokenizer/"):
        Flux3TextEncoder.from_pretrained(tmp_path)
