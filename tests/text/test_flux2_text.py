"""FLUX.2 text encoders against diffusers' `Flux2Pipeline` / `Flux2KleinPipeline.encode_prompt`, bit for bit.

Tiny random Mistral3 and Qwen3 models with the package tokenizers are written as diffusers FLUX.2 [dev] and
[klein] folders (and as separate model / tokenizer repos), then opened by our loaders and by diffusers; every
output must be equal.

Errors and placement: test_flux2_text_errors.py; the shared set-up: flux2_setup.py and, for the fixtures
`pixtral` and `flux2_folders`, conftest.py.
"""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import string
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2 import system_messages
from diffusers.pipelines.flux2.pipeline_flux2 import format_input
from torch import Tensor
from transformers import AutoTokenizer

from flux_runtime.models.dit.config import TINY_FLUX2
from flux_runtime.text import (
    MISTRAL_PROCESSOR_ID,
    MISTRAL_SMALL_ID,
    QWEN3_4B_ID,
    Flux2TextEncoder,
    KleinTextEncoder,
)
from flux_runtime.text.chat import processor_chat_template
from flux_runtime.text.flux2 import MAX_SEQUENCE_LENGTH, NEGATIVE_PROMPT, SYSTEM_MESSAGE
from flux_runtime.text.tokenizers import TINY_TOKENIZERS
from tests.text import conftest
from tests.text.flux2_setup import (
    DTYPES,
    FLAVOURS,
    LONG,
    PROMPTS,
    Encoder,
    Pipeline,
    assert_same,
    our_messages,
    pipeline_for,
)
from tests.text.helpers import cache_repo

# conftest.py's `pixtral` fixture, also under this module's name: tests/pipeline/test_flux2_pipeline.py imports it
pixtral = conftest.pixtral


@torch.no_grad()
def _reference(pipe: Pipeline, prompts: list[str], **kwargs: object) -> tuple[Tensor, Tensor]:
    return pipe.encode_prompt(prompts, device=torch.device("cpu"), **kwargs)


def _reference_ids(pipe: Pipeline, prompts: list[str], max_length: int | None) -> list[list[int]]:
    """Token ids as diffusers' pipeline builds them, padded/truncated to `max_length` (None: neither)."""
    limits = (
        {} if max_length is None else {"padding": "max_length", "truncation": True, "max_length": max_length}
    )
    if isinstance(pipe, Flux2Pipeline):  # one batched processor call, with the arguments diffusers passes
        # (unpadded rows of different lengths make no tensor: then one call per prompt)
        batches = [prompts] if max_length is not None else [[prompt] for prompt in prompts]
        return [
            ids
            for batch in batches
            for ids in pipe.tokenizer.apply_chat_template(
                format_input(batch, system_messages.SYSTEM_MESSAGE),
                add_generation_prompt=False,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                **limits,
            )["input_ids"].tolist()
        ]
    rows = []
    for prompt in prompts:  # one tokenizer call per prompt
        text = pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        rows.append(pipe.tokenizer(text, **limits).input_ids)
    return rows


# --- diffusers FLUX.2 folders ------------------------------------------------------------------------------


@pytest.fixture(
    scope="module",
    params=[(f, d) for f in FLAVOURS for d in DTYPES],
    ids=[f"{f}-{d}" for f in FLAVOURS for d in DTYPES],
)
def loaded(
    request: pytest.FixtureRequest, flux2_folders: dict[str, Path]
) -> tuple[Encoder, Pipeline, torch.dtype]:
    """Our encoder and diffusers' pipeline, each opened from the same folder in the same dtype."""
    flavour, dtype_name = request.param
    dtype = DTYPES[dtype_name]
    ours = FLAVOURS[flavour].from_pretrained(flux2_folders[flavour], dtype=dtype)
    pipeline_cls = Flux2Pipeline if flavour == "dev" else Flux2KleinPipeline
    ref = pipeline_cls.from_pretrained(flux2_folders[flavour], dtype=dtype, transformer=None, vae=None)
    # the reference tokenizes with the genuine processor / tokenizer classes
    assert type(ref.tokenizer).__name__ == ("PixtralProcessor" if flavour == "dev" else "Qwen2Tokenizer")
    return ours, ref, dtype


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_images_per_prompt": 2}, {"max_sequence_length": 100, "num_images_per_prompt": 3}],
    ids=["two-prompts-512", "2-images-per-prompt", "max-seq-100-3-images"],
)
def test_encode_equals_diffusers(loaded: tuple[Encoder, Pipeline, torch.dtype], kwargs: dict) -> None:
    ours, ref, dtype = loaded
    got = ours.encode(PROMPTS, **kwargs)
    assert_same(got, _reference(ref, PROMPTS, **kwargs), dtype)
    n = kwargs.get("num_images_per_prompt", 1)
    length = kwargs.get("max_sequence_length", 512)
    assert got.prompt_embeds.shape == (2 * n, length, TINY_FLUX2.context_in_dim)
    assert got.text_ids.shape == (2 * n, length, 4)
    assert not got.text_ids[..., :3].any() and torch.equal(got.text_ids[0, :, 3], torch.arange(length))
    # rows b * n + j belong to prompt b, and the two prompts give different embeddings
    assert torch.equal(got.prompt_embeds[0], got.prompt_embeds[n - 1])
    assert not torch.equal(got.prompt_embeds[0], got.prompt_embeds[n])


def test_tokens_equal_diffusers(loaded: tuple[Encoder, Pipeline, torch.dtype]) -> None:
    ours, ref, _ = loaded
    prompts = [*PROMPTS, LONG, ""]
    input_ids, attention_mask = ours.tokenize(prompts, 128)
    assert input_ids.dtype == attention_mask.dtype == torch.int64
    assert input_ids.tolist() == _reference_ids(ref, prompts, 128)
    # right padding with the pad token, masked; LONG fills all 128 positions
    lengths = [len(ids) for ids in _reference_ids(ref, prompts, None)]
    assert lengths[2] > 128
    assert attention_mask.sum(dim=1).tolist() == [min(n, 128) for n in lengths]
    assert input_ids[0, lengths[0] :].eq(ours.tokenizer.pad_token_id).all()
    assert not attention_mask[0, lengths[0] :].any() and attention_mask[0, : lengths[0]].all()


def test_long_prompt_is_truncated_like_diffusers_with_a_warning(
    loaded: tuple[Encoder, Pipeline, torch.dtype], caplog: pytest.LogCaptureFixture
) -> None:
    ours, ref, dtype = loaded
    prompts = ["a cat", LONG]
    with caplog.at_level(logging.WARNING, logger="flux_runtime.text"):
        got = ours.encode(prompts, max_sequence_length=128)
    assert_same(got, _reference(ref, prompts, max_sequence_length=128), dtype)
    full = _reference_ids(ref, [LONG], None)[0]
    dropped = repr(ours.tokenizer.decode(full[128:]))[:200]
    assert len(full) > 128 and "a castle on a hill" in dropped
    assert our_messages(caplog) == [
        f"prompt 1 is {len(full)} {ours.family} tokens in its chat template; the limit is 128, so its last "
        f"{len(full) - 128} tokens are dropped: {dropped}"
    ]


def test_img_markers_are_removed_as_diffusers_does(flux2_folders: dict[str, Path]) -> None:
    ours = Flux2TextEncoder.from_pretrained(flux2_folders["dev"], dtype=torch.float32)
    ref = Flux2Pipeline.from_pretrained(flux2_folders["dev"], dtype=torch.float32, transformer=None, vae=None)
    marked = ["a [IMG]photo of a cat[IMG]", "[IMG]"]
    got = ours.encode(marked, max_sequence_length=96)
    assert_same(got, _reference(ref, marked, max_sequence_length=96), torch.float32)
    plain = ours.encode(["a photo of a cat", ""], max_sequence_length=96)
    assert torch.equal(got.prompt_embeds, plain.prompt_embeds)
    assert ours.tokenizer.convert_tokens_to_ids("[IMG]") not in ours.tokenize(marked, 96)[0]


def test_klein_negative_prompt_is_empty_per_prompt(flux2_folders: dict[str, Path]) -> None:
    ours = KleinTextEncoder.from_pretrained(flux2_folders["klein"], dtype=torch.bfloat16)
    ref = Flux2KleinPipeline.from_pretrained(
        flux2_folders["klein"], dtype=torch.bfloat16, transformer=None, vae=None
    )
    # Flux2KleinPipeline.__call__: negative_prompt = "" repeated len(prompt) times, same encode_prompt settings
    got = ours.encode_negative(2, max_sequence_length=64, num_images_per_prompt=2)
    assert_same(
        got, _reference(ref, ["", ""], max_sequence_length=64, num_images_per_prompt=2), torch.bfloat16
    )
    assert NEGATIVE_PROMPT == ""
    assert not torch.equal(got.prompt_embeds, ours.encode(PROMPTS, max_sequence_length=64).prompt_embeds[:1])


def test_constants_match_diffusers() -> None:
    assert SYSTEM_MESSAGE == system_messages.SYSTEM_MESSAGE
    for cls, pipeline in ((Flux2TextEncoder, Flux2Pipeline), (KleinTextEncoder, Flux2KleinPipeline)):
        defaults = inspect.signature(pipeline.encode_prompt).parameters
        assert cls.layers == tuple(defaults["text_encoder_out_layers"].default)
        assert defaults["max_sequence_length"].default == MAX_SEQUENCE_LENGTH


# --- the built-in tiny encoders -----------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_tiny_equals_diffusers_and_fits_the_tiny_flux2_dit(flavour: str, pixtral: type) -> None:
    cls = FLAVOURS[flavour]
    rng = torch.random.get_rng_state()
    encoder = cls.tiny()
    assert torch.equal(rng, torch.random.get_rng_state()), "tiny() changed the global RNG"
    got = encoder.encode(PROMPTS, max_sequence_length=64)
    assert_same(
        got, _reference(pipeline_for(encoder, pixtral), PROMPTS, max_sequence_length=64), torch.float32
    )
    assert encoder.output_dim == TINY_FLUX2.context_in_dim
    assert got.prompt_embeds.shape == (2, 64, TINY_FLUX2.context_in_dim)

    again = cls.tiny().encode(PROMPTS, max_sequence_length=64)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    other = cls.tiny(seed=1).encode(PROMPTS, max_sequence_length=64)
    assert not torch.equal(other.prompt_embeds, got.prompt_embeds)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_tiny_in_half_precision_equals_its_weights_loaded_so(
    flavour: str, dtype: torch.dtype, flux2_folders: dict[str, Path]
) -> None:
    # as from_pretrained(dtype=...) does, only the weights are cast: the RoPE inv_freq buffers stay float32
    tiny = FLAVOURS[flavour].tiny(seed=7, dtype=dtype)
    loaded = FLAVOURS[flavour].from_pretrained(flux2_folders[flavour], dtype=dtype)
    assert tiny.dtype == loaded.dtype == dtype
    got, want = tiny.encode(PROMPTS, max_sequence_length=80), loaded.encode(PROMPTS, max_sequence_length=80)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_tiny_tokenizers_are_shaped_like_mistral_and_qwen3() -> None:
    dev, klein = Flux2TextEncoder.tiny(), KleinTextEncoder.tiny()
    mistral, qwen = dev.tokenizer, klein.tokenizer
    # Mistral Small 3.1's control-token ids; <s> prepended by the tokenizer, right padding with <pad>
    ids = {
        t: mistral.convert_tokens_to_ids(t) for t in ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]")
    }
    ids |= {t: mistral.convert_tokens_to_ids(t) for t in ("<pad>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")}
    assert list(ids.values()) == [0, 1, 2, 3, 4, 10, 11, 17, 18]
    assert (mistral.bos_token, mistral.eos_token, mistral.pad_token) == ("<s>", "</s>", "<pad>")
    assert mistral.padding_side == qwen.padding_side == "right"
    assert mistral("a cat").input_ids[0] == 1
    # Qwen3: no BOS, eos <|im_end|>, pad <|endoftext|>; <think> tags are single tokens
    assert (qwen.bos_token, qwen.eos_token, qwen.pad_token) == (None, "<|im_end|>", "<|endoftext|>")
    think = qwen("<think>\n\n</think>").input_ids
    assert think[0] == qwen.convert_tokens_to_ids("<think>") and think[-1] == qwen.convert_tokens_to_ids(
        "</think>"
    )
    assert len(mistral) < 1000 and len(qwen) < 1000

    assert dev.render(["a cat"]) == [f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]a cat[/INST]"]
    assert klein.render(["a cat"]) == [
        "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ]
    text = string.printable.strip() + " The Quick Brown Fox naïve café — 東京"
    for tokenizer in (mistral, qwen):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text
        assert not set(ids) & set(tokenizer.all_special_ids), "a character maps to a special token"


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_tiny_tokenizer_folders_load_with_auto_classes(flavour: str, pixtral: type) -> None:
    folder = TINY_TOKENIZERS / ("mistral" if flavour == "dev" else "qwen3")
    ours = FLAVOURS[flavour].tiny().tokenizer
    auto = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert auto("a photo of a cat").input_ids == ours("a photo of a cat").input_ids
    if flavour == "dev":
        processor = pixtral.from_pretrained(folder)
        assert processor.chat_template == processor_chat_template(folder)


@pytest.mark.parametrize("layout", ["jinja", "legacy-json", "processor-config"])
def test_chat_template_precedence_is_the_processors(layout: str, tmp_path: Path, pixtral: type) -> None:
    folder = tmp_path / "processor"
    shutil.copytree(TINY_TOKENIZERS / "mistral", folder)
    jinja = (folder / "chat_template.jinja").read_text()
    if layout != "jinja":  # a second template that must win over chat_template.jinja
        other = jinja.replace("[INST]", "[INST] ")
        if layout == "legacy-json":
            (folder / "chat_template.json").write_text(json.dumps({"chat_template": other}))
        else:
            config = json.loads((folder / "processor_config.json").read_text())
            (folder / "processor_config.json").write_text(json.dumps({**config, "chat_template": other}))
    template = processor_chat_template(folder)
    assert template == pixtral.from_pretrained(folder).chat_template
    assert (template == jinja) == (layout == "jinja")


# --- model and tokenizer from their own folders, cached ids ------------------------------------------------


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory, pixtral: type) -> dict[str, Path]:
    """Separate repos as on the Hub: Mistral3 weights; the Pixtral processor; Qwen3 with its tokenizer."""
    root = tmp_path_factory.mktemp("components")
    Flux2TextEncoder.tiny(seed=3).model.save_pretrained(root / "mistral")
    pixtral.from_pretrained(TINY_TOKENIZERS / "mistral").save_pretrained(root / "processor")
    klein = KleinTextEncoder.tiny(seed=3)
    klein.model.save_pretrained(root / "qwen3")
    klein.tokenizer.save_pretrained(root / "qwen3")
    return {"mistral": root / "mistral", "processor": root / "processor", "qwen3": root / "qwen3"}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_from_components(components: dict[str, Path], dtype: torch.dtype) -> None:
    pairs = [
        (
            Flux2TextEncoder.from_components(components["mistral"], components["processor"], dtype=dtype),
            "dev",
        ),
        (KleinTextEncoder.from_components(components["qwen3"], dtype=dtype), "klein"),
        (KleinTextEncoder.from_components(components["qwen3"], components["qwen3"], dtype=dtype), "klein"),
    ]
    for ours, flavour in pairs:
        want = FLAVOURS[flavour].tiny(seed=3, dtype=dtype).encode(PROMPTS, max_sequence_length=72)
        got = ours.encode(PROMPTS, max_sequence_length=72)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_cached_ids(
    components: dict[str, Path],
    flux2_folders: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    cache_repo(tmp_path, MISTRAL_SMALL_ID, components["mistral"])
    cache_repo(tmp_path, MISTRAL_PROCESSOR_ID, components["processor"])
    cache_repo(tmp_path, QWEN3_4B_ID, components["qwen3"])
    cache_repo(tmp_path, "black-forest-labs/FLUX.2-klein-tiny", flux2_folders["klein"])
    opened = [
        (Flux2TextEncoder.from_components(dtype=torch.float32), Flux2TextEncoder.tiny(seed=3)),
        (KleinTextEncoder.from_components(QWEN3_4B_ID, dtype=torch.float32), KleinTextEncoder.tiny(seed=3)),
        (
            KleinTextEncoder.from_pretrained("black-forest-labs/FLUX.2-klein-tiny", dtype=torch.float32),
            KleinTextEncoder.tiny(seed=7),
        ),
    ]
    for ours, tiny in opened:
        got, want = ours.encode(PROMPTS, max_sequence_length=20), tiny.encode(PROMPTS, max_sequence_length=20)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
