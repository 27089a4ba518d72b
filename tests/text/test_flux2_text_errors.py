"""FLUX.2 text encoders' errors in our words (arguments, folders, checkpoints) and where their outputs go."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from flux_runtime.text import QWEN3_4B_ID, Flux2TextEncoder, KleinTextEncoder
from flux_runtime.weights import WeightsError
from tests.text.flux2_setup import (
    FLAVOURS,
    PROMPTS,
    Encoder,
    assert_same,
    our_messages,
    pipeline_for,
)

# --- errors ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_encoders() -> dict[str, Encoder]:
    return {flavour: cls.tiny() for flavour, cls in FLAVOURS.items()}


@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("length", [513, 1024, 0, 77.0])
def test_max_sequence_length_out_of_range(
    tiny_encoders: dict[str, Encoder], flavour: str, length: object
) -> None:
    with pytest.raises(ValueError, match=rf"max_sequence_length {length!r} is not in 1\.\.512"):
        tiny_encoders[flavour].encode(PROMPTS, max_sequence_length=length)  # type: ignore[arg-type]


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_truncation_boundary(
    tiny_encoders: dict[str, Encoder], flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    encoder = tiny_encoders[flavour]
    full = encoder.tokenizer(encoder.render(["a cat"]), add_special_tokens=False).input_ids[0]
    n = len(full)
    with caplog.at_level(logging.WARNING, logger="flux_runtime.text"):
        fits, _ = encoder.tokenize("a cat", n)
        assert our_messages(caplog) == []
        cut, mask = encoder.tokenize("a cat", n - 1)
    assert fits[0].tolist() == full and cut[0].tolist() == full[:-1] and mask.all()
    last = encoder.tokenizer.decode(full[-1:])
    assert last == ("[/INST]" if flavour == "dev" else "\n")  # the tiny Qwen3 has no "\n\n" token
    assert our_messages(caplog) == [
        f"prompt 0 is {n} {encoder.family} tokens in its chat template; the limit is {n - 1}, so its last 1 "
        f"tokens are dropped: {last!r}"
    ]


def test_bad_prompts_and_counts(tiny_encoders: dict[str, Encoder]) -> None:
    for encoder in tiny_encoders.values():
        with pytest.raises(ValueError, match="prompts is empty"):
            encoder.encode([])
        with pytest.raises(TypeError, match="prompts must be a string or a list of strings"):
            encoder.encode([1, 2])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="num_images_per_prompt 0 is not a positive integer"):
            encoder.encode(PROMPTS, num_images_per_prompt=0)
    with pytest.raises(ValueError, match="num_prompts 0 is not a positive integer"):
        tiny_encoders["klein"].encode_negative(0)  # type: ignore[union-attr]


def test_too_shallow_model_is_refused(tiny_encoders: dict[str, Encoder]) -> None:
    tokenizer = tiny_encoders["klein"].tokenizer
    shallow = Qwen3ForCausalLM(
        Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=20)
    )
    with pytest.raises(
        ValueError, match=r"the Qwen3 model has 20 layers; FLUX\.2 reads hidden states 9, 18, 27"
    ):
        KleinTextEncoder(shallow, tokenizer)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="neither an existing file or folder"):
        Flux2TextEncoder.from_pretrained(tmp_path / "no-such-folder")


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_folder_without_text_encoder(flux2_folders: dict[str, Path], tmp_path: Path, flavour: str) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(flux2_folders[flavour], partial)
    shutil.rmtree(partial / "text_encoder")
    name = "dev" if flavour == "dev" else "klein"
    with pytest.raises(WeightsError, match=rf"has no text_encoder/: a diffusers FLUX\.2 \[{name}\] folder"):
        FLAVOURS[flavour].from_pretrained(partial)
    (partial / "text_encoder").mkdir()
    shutil.copy(flux2_folders[flavour] / "text_encoder" / "config.json", partial / "text_encoder")
    with pytest.raises(WeightsError, match=r"no weights for the (Mistral|Qwen3) text encoder"):
        FLAVOURS[flavour].from_pretrained(partial)


def test_the_other_flavours_folder_is_refused(flux2_folders: dict[str, Path]) -> None:
    with pytest.raises(WeightsError, match=r"holds a 'qwen3' model; Flux2TextEncoder reads Mistral"):
        Flux2TextEncoder.from_pretrained(flux2_folders["klein"])
    with pytest.raises(WeightsError, match=r"holds a 'mistral3' model; KleinTextEncoder reads Qwen3"):
        KleinTextEncoder.from_pretrained(flux2_folders["dev"])


def test_missing_chat_templates(flux2_folders: dict[str, Path], tmp_path: Path) -> None:
    for flavour, match in (
        ("dev", "no chat template"),
        ("klein", "the Qwen3 tokenizer has no chat template"),
    ):
        broken = tmp_path / flavour
        shutil.copytree(flux2_folders[flavour], broken)
        (broken / "tokenizer" / "chat_template.jinja").unlink()
        with pytest.raises(WeightsError, match=match):
            FLAVOURS[flavour].from_pretrained(broken)


def test_checkpoint_missing_weights_is_an_error(flux2_folders: dict[str, Path], tmp_path: Path) -> None:
    """A weight the encoder reads is required; the final norm (and the layers past 27) are not read, so a
    checkpoint without them still loads (natively: transformers would want them, see the `.bin` case)."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(flux2_folders["klein"], broken)
    weights = broken / "text_encoder" / "model.safetensors"
    state = load_file(weights)
    del state["model.norm.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    assert KleinTextEncoder.from_pretrained(broken, dtype=torch.float32).model.depth == 27
    del state["model.layers.26.mlp.down_proj.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(
        WeightsError,
        match=r"the Qwen3 text encoder checkpoint lacks 1 weights, e\.g\. model\.layers\.26\.mlp\.down_proj\.weight",
    ):
        KleinTextEncoder.from_pretrained(broken)
    # from .bin weights transformers loads the whole model, the final norm included
    torch.save(state, broken / "text_encoder" / "pytorch_model.bin")
    weights.unlink()
    with pytest.raises(WeightsError, match=r"the Qwen3 checkpoint lacks \d+ weights"):
        KleinTextEncoder.from_pretrained(broken)


def test_uncached_id_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WeightsError) as info:
        Flux2TextEncoder.from_components("flux-runtime-tests/no-such-mistral")
    message = str(info.value)
    assert "\n" not in message
    assert "'flux-runtime-tests/no-such-mistral'" in message and "fetch it once online" in message
    with pytest.raises(
        WeightsError, match=r"'black-forest-labs/FLUX\.2-dev' is not in the local Hugging Face cache"
    ):
        Flux2TextEncoder.from_pretrained("black-forest-labs/FLUX.2-dev")
    with pytest.raises(WeightsError, match=r"'Qwen/Qwen3-4B' is not in the local Hugging Face cache"):
        KleinTextEncoder.from_components(QWEN3_4B_ID)


# --- placement ---------------------------------------------------------------------------------------------


def test_outputs_go_to_the_requested_device(tiny_encoders: dict[str, Encoder]) -> None:
    for encoder in tiny_encoders.values():
        got = encoder.encode(PROMPTS, max_sequence_length=16, device="meta")
        assert all(t.device.type == "meta" for t in got)
        assert got.prompt_embeds.shape == (2, 16, 96) and got.text_ids.shape == (2, 16, 4)
        assert encoder.offload() is encoder and encoder.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_runs_on_the_gpu_and_offloads(flavour: str, pixtral: type) -> None:
    encoder = FLAVOURS[flavour].tiny(device="cuda", dtype=torch.bfloat16)
    assert encoder.device.type == "cuda"
    got = encoder.encode(PROMPTS, max_sequence_length=64)
    with torch.no_grad():
        want = pipeline_for(encoder, pixtral).encode_prompt(
            PROMPTS, device=torch.device("cuda"), max_sequence_length=64
        )
    assert_same(got, want, torch.bfloat16)
    encoder.offload()
    assert encoder.device.type == "cpu"
    on_gpu = encoder.encode(PROMPTS, max_sequence_length=64, device="cuda")
    assert all(t.device.type == "cuda" for t in on_gpu)
