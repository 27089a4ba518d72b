"""FLUX.1 text encoders against diffusers' `FluxPipeline.encode_prompt`, bit for bit, on tiny random models.

The tiny CLIP and T5 (package tokenizers, seeded weights) are written as a diffusers FluxPipeline folder and as
BFL-style separate CLIP / T5 repos, then opened by our loaders and by diffusers; every output must be equal.
"""

from __future__ import annotations

import copy
import logging
import shutil
import string
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from torch import Tensor
from transformers import CLIPConfig, CLIPModel, T5Config, T5ForConditionalGeneration

from flux_runtime.models.dit import TINY
from flux_runtime.text import CLIP_L_ID, T5_XXL_ID, Flux1TextEmbeddings, Flux1TextEncoder
from flux_runtime.text.tokenizers import tiny_tokenizer_path, tokenize
from flux_runtime.weights import WeightsError
from tests.text.helpers import cache_repo

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPTS = ["a photo of a cat sitting on a wooden table", "An astronaut riding a horse on the Moon, 4k!"]
# About 240 CLIP and 230 T5 tokens: truncated by CLIP (77) and by T5 at max_sequence_length 128.
LONG = "a castle on a hill at sunset, fantasy style, highly detailed, " * 16


def _pipeline(encoder: Flux1TextEncoder) -> FluxPipeline:
    """diffusers' FluxPipeline around `encoder`'s models and tokenizers (no DiT or VAE: encode_prompt needs none)."""
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=encoder.clip,
        tokenizer=encoder.clip_tokenizer,
        text_encoder_2=encoder.t5,
        tokenizer_2=encoder.t5_tokenizer,
        transformer=None,
    )


@torch.no_grad()
def _reference(pipe: FluxPipeline, prompts: list[str], **kwargs: object) -> tuple[Tensor, Tensor, Tensor]:
    return pipe.encode_prompt(prompts, device=torch.device("cpu"), **kwargs)


def _assert_same(got: Flux1TextEmbeddings, want: tuple[Tensor, Tensor, Tensor], dtype: torch.dtype) -> None:
    assert isinstance(got, Flux1TextEmbeddings)
    for name, g, w in zip(Flux1TextEmbeddings._fields, got, want, strict=True):
        assert g.dtype == w.dtype == dtype, (name, g.dtype, w.dtype)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert torch.equal(g, w), f"{name}: max |diff| {(g.float() - w.float()).abs().max()}"


def _our_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("flux_runtime.text")]


# --- a diffusers FLUX.1 folder ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny encoders (seed 7, fp32) saved by diffusers as a FluxPipeline folder, model_index.json included."""
    folder = tmp_path_factory.mktemp("flux1") / "FLUX.1-tiny"
    _pipeline(Flux1TextEncoder.tiny(seed=7)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(DTYPES), ids=list(DTYPES))
def loaded(
    request: pytest.FixtureRequest, flux_folder: Path
) -> tuple[Flux1TextEncoder, FluxPipeline, torch.dtype]:
    """Our encoder and diffusers' pipeline, each opened from `flux_folder` in the same dtype."""
    dtype = DTYPES[request.param]
    ours = Flux1TextEncoder.from_pretrained(flux_folder, dtype=dtype)
    ref = FluxPipeline.from_pretrained(flux_folder, dtype=dtype, transformer=None, vae=None)
    return ours, ref, dtype


@pytest.mark.parametrize(
    ("ours_kwargs", "ref_kwargs"),
    [
        ({}, {}),  # max_sequence_length 512
        ({"num_images_per_prompt": 2}, {"num_images_per_prompt": 2}),
        ({"max_sequence_length": 256}, {"max_sequence_length": 256}),
        (
            {"max_sequence_length": 77, "num_images_per_prompt": 3},
            {"max_sequence_length": 77, "num_images_per_prompt": 3},
        ),
        (
            {"prompts_2": ["a dog", "two children playing with a ball"], "max_sequence_length": 33},
            {"prompt_2": ["a dog", "two children playing with a ball"], "max_sequence_length": 33},
        ),
    ],
    ids=["two-prompts-512", "2-images-per-prompt", "max-seq-256", "max-seq-77-3-images", "prompts_2"],
)
def test_encode_equals_diffusers(
    loaded: tuple[Flux1TextEncoder, FluxPipeline, torch.dtype], ours_kwargs: dict, ref_kwargs: dict
) -> None:
    ours, ref, dtype = loaded
    got = ours.encode(PROMPTS, **ours_kwargs)
    _assert_same(got, _reference(ref, PROMPTS, **ref_kwargs), dtype)
    n = ours_kwargs.get("num_images_per_prompt", 1)
    length = ours_kwargs.get("max_sequence_length", 512)
    assert got.prompt_embeds.shape == (2 * n, length, 32)
    assert got.pooled_prompt_embeds.shape == (2 * n, 32)
    assert got.text_ids.shape == (length, 3) and not got.text_ids.any()
    # rows b * n + j belong to prompt b, and the two prompts give different embeddings
    assert torch.equal(got.pooled_prompt_embeds[0], got.pooled_prompt_embeds[n - 1])
    assert not torch.equal(got.pooled_prompt_embeds[0], got.pooled_prompt_embeds[n])
    assert not torch.equal(got.prompt_embeds[0], got.prompt_embeds[n])


def test_long_prompt_is_truncated_like_diffusers_with_a_warning(
    loaded: tuple[Flux1TextEncoder, FluxPipeline, torch.dtype], caplog: pytest.LogCaptureFixture
) -> None:
    ours, ref, dtype = loaded
    prompts = [LONG, "a cat"]
    with caplog.at_level(logging.WARNING, logger="flux_runtime.text"):
        got = ours.encode(prompts, max_sequence_length=128)
    _assert_same(got, _reference(ref, prompts, max_sequence_length=128), dtype)

    n_clip = len(ours.clip_tokenizer(LONG).input_ids)
    n_t5 = len(ours.t5_tokenizer(LONG).input_ids)
    assert n_clip > 77 and n_t5 > 128
    messages = _our_messages(caplog)
    assert len(messages) == 2, messages  # "a cat" fits both
    assert messages[0].startswith(
        f"prompt 0 is {n_clip} CLIP tokens; the limit is 77, so its last {n_clip - 77} tokens"
    )
    assert messages[1].startswith(
        f"prompt 0 is {n_t5} T5 tokens; the limit is 128, so its last {n_t5 - 128} tokens"
    )


def test_truncation_boundary_counts_dropped_tokens(caplog: pytest.LogCaptureFixture) -> None:
    encoder = Flux1TextEncoder.tiny()
    t5 = encoder.t5_tokenizer
    at_limit, over = "a " * 9, "a " * 10  # "▁a" per word plus </s>: 10 and 11 tokens
    assert len(t5(at_limit).input_ids) == 10 and len(t5(over).input_ids) == 11
    with caplog.at_level(logging.WARNING, logger="flux_runtime.text"):
        ids = tokenize(t5, [at_limit, over], 10, "T5")
    assert ids.shape == (2, 10) and ids.dtype == torch.int64
    assert torch.equal(ids[0], ids[1])  # the 10th "a" gave way to </s>
    assert ids[0, -1].item() == t5.eos_token_id
    assert _our_messages(caplog) == [
        "prompt 1 is 11 T5 tokens; the limit is 10, so its last 1 tokens are dropped: 'a'"
    ]


def test_float16_loads_like_transformers_and_warns(
    flux_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="flux_runtime.text"):
        loaded = Flux1TextEncoder.from_pretrained(flux_folder, dtype=torch.float16)
    assert any("T5 overflows in float16" in m for m in _our_messages(caplog))
    assert loaded.t5.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    # tiny() in float16 keeps the same layers in float32, so it equals its own weights loaded in float16
    tiny = Flux1TextEncoder.tiny(seed=7, dtype=torch.float16)
    got, want = tiny.encode(PROMPTS, max_sequence_length=40), loaded.encode(PROMPTS, max_sequence_length=40)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# --- the built-in tiny encoders -----------------------------------------------------------------------------


def test_tiny_equals_diffusers_and_fits_the_tiny_dit() -> None:
    rng = torch.random.get_rng_state()
    encoder = Flux1TextEncoder.tiny()
    assert torch.equal(rng, torch.random.get_rng_state()), "tiny() changed the global RNG"
    got = encoder.encode(PROMPTS, max_sequence_length=64)
    _assert_same(got, _reference(_pipeline(encoder), PROMPTS, max_sequence_length=64), torch.float32)
    assert got.prompt_embeds.shape == (2, 64, TINY.context_in_dim)
    assert got.pooled_prompt_embeds.shape == (2, TINY.vec_in_dim)

    again = Flux1TextEncoder.tiny().encode(PROMPTS, max_sequence_length=64)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    other = Flux1TextEncoder.tiny(seed=1).encode(PROMPTS, max_sequence_length=64)
    assert not torch.equal(other.pooled_prompt_embeds, got.pooled_prompt_embeds)
    assert not torch.equal(other.prompt_embeds, got.prompt_embeds)


def test_tiny_tokenizers_are_shaped_like_clip_and_t5() -> None:
    encoder = Flux1TextEncoder.tiny()
    clip, t5 = encoder.clip_tokenizer, encoder.t5_tokenizer
    # CLIP: <|startoftext|>, <|endoftext|> are the two highest ids; pad is <|endoftext|>; 77 positions
    assert clip.model_max_length == 77 == encoder.clip.config.max_position_embeddings
    assert (clip.bos_token, clip.eos_token, clip.pad_token) == (
        "<|startoftext|>",
        "<|endoftext|>",
        "<|endoftext|>",
    )
    assert (clip.bos_token_id, clip.eos_token_id) == (len(clip) - 2, len(clip) - 1)
    # T5: <pad>=0, </s>=1, <unk>=2, </s> appended, no BOS
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)
    assert len(clip) < 1000 and len(t5) < 1000

    text = string.printable.strip() + " The Quick Brown Fox"
    clip_ids = clip(text).input_ids
    assert clip_ids[0] == clip.bos_token_id and clip_ids[-1] == clip.eos_token_id
    assert clip.eos_token_id not in clip_ids[1:-1], "an ASCII character maps to CLIP's unknown token"
    assert clip.decode(clip_ids, skip_special_tokens=True).replace(" ", "") == text.lower().replace(" ", "")
    t5_ids = t5(text).input_ids
    assert t5_ids[-1] == 1 and t5.unk_token_id not in t5_ids, "an ASCII character maps to T5's <unk>"
    assert t5.decode(t5_ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("name", ["CLIPTokenizer", "CLIPTokenizerFast", "T5Tokenizer", "T5TokenizerFast"])
def test_tiny_tokenizers_load_with_transformers_classes(name: str) -> None:
    import transformers

    kind = "clip" if name.startswith("CLIP") else "t5"
    tokenizer = getattr(transformers, name).from_pretrained(tiny_tokenizer_path(kind), local_files_only=True)
    ids = tokenizer("a photo of a cat").input_ids
    assert len(ids) == (7 if kind == "clip" else 6)  # each word is one token, plus the special tokens


# --- BFL-style separate CLIP-L / T5 folders and cached ids --------------------------------------------------


@pytest.fixture(scope="module")
def bfl_style(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Flux1TextEncoder]:
    """Full CLIPModel and T5ForConditionalGeneration repos (as openai/… and google/… are) holding tiny's weights."""
    tiny = Flux1TextEncoder.tiny(seed=3)
    root = tmp_path_factory.mktemp("bfl")
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    clip = CLIPModel(
        CLIPConfig(
            text_config=tiny.clip.config.to_dict(),
            vision_config={**vision, "image_size": 32, "patch_size": 16},
            projection_dim=32,
        )
    )
    clip.text_model.load_state_dict(tiny.clip.state_dict())
    clip.save_pretrained(root / "clip")
    tiny.clip_tokenizer.save_pretrained(root / "clip")

    t5 = T5ForConditionalGeneration(T5Config(**{**tiny.t5.config.to_dict(), "is_encoder_decoder": True}))
    t5.encoder.load_state_dict(tiny.t5.encoder.state_dict())
    assert torch.equal(t5.shared.weight, tiny.t5.shared.weight)  # tied to encoder.embed_tokens
    t5.save_pretrained(root / "t5")
    tiny.t5_tokenizer.save_pretrained(root / "t5")
    return root / "clip", root / "t5", tiny


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_from_components_reads_only_the_text_weights(
    bfl_style: tuple[Path, Path, Flux1TextEncoder], dtype: torch.dtype
) -> None:
    clip_dir, t5_dir, tiny = bfl_style
    ours = Flux1TextEncoder.from_components(clip_dir, t5_dir, dtype=dtype)
    clip, t5 = copy.deepcopy(tiny.clip).to(dtype), copy.deepcopy(tiny.t5).to(dtype)
    reference = Flux1TextEncoder(clip, tiny.clip_tokenizer, t5, tiny.t5_tokenizer)
    got = ours.encode([*PROMPTS, LONG], max_sequence_length=256)
    _assert_same(got, _reference(_pipeline(reference), [*PROMPTS, LONG], max_sequence_length=256), dtype)


def test_from_components_defaults_open_the_cached_ids(
    bfl_style: tuple[Path, Path, Flux1TextEncoder], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clip_dir, t5_dir, tiny = bfl_style
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    cache_repo(tmp_path, CLIP_L_ID, clip_dir)
    cache_repo(tmp_path, T5_XXL_ID, t5_dir)
    got = Flux1TextEncoder.from_components(dtype=torch.float32).encode(PROMPTS, max_sequence_length=20)
    want = tiny.encode(PROMPTS, max_sequence_length=20)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# --- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [513, 1024, 0, 77.0])
def test_max_sequence_length_out_of_range(length: object) -> None:
    with pytest.raises(ValueError, match=rf"max_sequence_length {length!r} is not in 1\.\.512"):
        Flux1TextEncoder.tiny().encode(PROMPTS, max_sequence_length=length)  # type: ignore[arg-type]


def test_bad_prompts_and_counts() -> None:
    encoder = Flux1TextEncoder.tiny()
    with pytest.raises(ValueError, match="prompts is empty"):
        encoder.encode([])
    with pytest.raises(TypeError, match="prompts must be a string or a list of strings"):
        encoder.encode([1, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="prompts_2 has 1 prompts but prompts has 2"):
        encoder.encode(PROMPTS, prompts_2=["a dog"])
    with pytest.raises(ValueError, match="num_images_per_prompt 0 is not a positive integer"):
        encoder.encode(PROMPTS, num_images_per_prompt=0)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="neither an existing file or folder"):
        Flux1TextEncoder.from_pretrained(tmp_path / "no-such-folder")


def test_folder_without_text_encoders(flux_folder: Path, tmp_path: Path) -> None:
    partial = tmp_path / "FLUX.1-partial"
    shutil.copytree(flux_folder, partial)
    shutil.rmtree(partial / "text_encoder_2")
    shutil.rmtree(partial / "tokenizer_2")
    with pytest.raises(
        WeightsError, match=r"has no text_encoder_2/, tokenizer_2/: a diffusers FLUX\.1 folder"
    ):
        Flux1TextEncoder.from_pretrained(partial)
    shutil.copytree(flux_folder / "tokenizer_2", partial / "tokenizer_2")
    (partial / "text_encoder_2").mkdir()
    shutil.copy(flux_folder / "text_encoder_2" / "config.json", partial / "text_encoder_2")
    with pytest.raises(WeightsError, match="no weights for the T5 encoder"):
        Flux1TextEncoder.from_pretrained(partial)


def test_checkpoint_missing_weights_is_an_error(flux_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "FLUX.1-broken"
    shutil.copytree(flux_folder, broken)
    weights = broken / "text_encoder" / "model.safetensors"
    state = load_file(weights)
    del state["final_layer_norm.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(
        WeightsError,
        match=r"the CLIP text encoder checkpoint lacks 1 weights, e\.g\. final_layer_norm\.weight",
    ):
        Flux1TextEncoder.from_pretrained(broken)


def test_uncached_id_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WeightsError) as info:
        Flux1TextEncoder.from_components("flux-runtime-tests/no-such-clip", T5_XXL_ID)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert "'flux-runtime-tests/no-such-clip'" in message and "fetch it once online" in message
    with pytest.raises(
        WeightsError, match=r"'black-forest-labs/FLUX\.1-dev' is not in the local Hugging Face cache"
    ):
        Flux1TextEncoder.from_pretrained("black-forest-labs/FLUX.1-dev")


# --- placement ---------------------------------------------------------------------------------------------


def test_outputs_go_to_the_requested_device() -> None:
    encoder = Flux1TextEncoder.tiny()
    got = encoder.encode(PROMPTS, max_sequence_length=16, device="meta")
    assert all(t.device.type == "meta" for t in got)
    assert got.prompt_embeds.shape == (2, 16, 32) and got.text_ids.shape == (16, 3)
    assert encoder.offload() is encoder and encoder.device.type == "cpu"


@pytest.mark.gpu
def test_runs_on_the_gpu_and_offloads() -> None:
    encoder = Flux1TextEncoder.tiny(device="cuda", dtype=torch.bfloat16)
    assert encoder.device.type == "cuda" and encoder.clip.device.type == "cuda"
    got = encoder.encode(PROMPTS, max_sequence_length=64)
    with torch.no_grad():
        want = _pipeline(encoder).encode_prompt(PROMPTS, device=torch.device("cuda"), max_sequence_length=64)
    _assert_same(got, want, torch.bfloat16)
    encoder.offload()
    assert encoder.device.type == "cpu" and encoder.clip.device.type == "cpu"
    on_gpu = encoder.encode(PROMPTS, max_sequence_length=64, device="cuda")
    assert all(t.device.type == "cuda" for t in on_gpu)
