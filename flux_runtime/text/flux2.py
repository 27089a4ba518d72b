"""FLUX.2's text conditioning: three hidden states of a chat LLM per token, as diffusers computes them.

`Flux2TextEncoder` (FLUX.2 [dev]: Mistral Small 3.x, `Mistral3ForConditionalGeneration`) reproduces
`Flux2Pipeline.encode_prompt` of diffusers 0.42.1 bit for bit, and `KleinTextEncoder` (FLUX.2 [klein]: Qwen3,
`Qwen3ForCausalLM`) reproduces `Flux2KleinPipeline.encode_prompt`: the same transformers models, the same chat
formatting and tokenizer arguments (`flux_runtime.text.chat`), the attention mask passed to the model, the same
hidden states, casts, repetition and ids.

The tensors `encode` returns are the contract for the DiT (a caller may build them itself, e.g. from cached
embeddings; they must then follow it exactly):

- `prompt_embeds` `[B * n, L, 3 * H]` in the encoder's dtype, `L = max_sequence_length` (all positions,
  padding included: the DiT sees no mask). Per token, the residual streams after layers 10, 20 and 30
  (Mistral, H = 5120 → 15360) or 9, 18 and 27 (Qwen3, H = 2560 / 4096 → 7680 / 12288) side by side, before
  the final norm (`hidden_states[0]` is the token embedding). Tiny encoders: H = 32 → 96.
- `text_ids` `[B * n, L, 4]` int64, `(t, h, w, l) = (0, 0, 0, l)`: text tokens sit on the fourth RoPE axis.

Row `b * n + j` belongs to prompt `b` (`n = num_images_per_prompt`), as diffusers' `repeat` + `view` orders them.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from flux_runtime.registry import MISTRAL_PROCESSOR_ID, MISTRAL_SMALL_ID
from flux_runtime.text.chat import load_mistral_tokenizer, load_qwen3_tokenizer, tokenize_chats
from flux_runtime.text.flux1 import _prompt_list
from flux_runtime.text.hf_weights import load_pretrained
from flux_runtime.text.llm import StackedLLM
from flux_runtime.text.tiny import TINY_WIDTH, init_random
from flux_runtime.text.tokenizers import TINY_TOKENIZERS
from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.safetensors_io import check_safetensors_folder

# BFL's FLUX.2 [dev] and diffusers' converter pair Mistral Small 3.2's weights with Mistral Small 3.1's processor.
# FLUX.2 is trained with 512 text tokens (BFL's MAX_LENGTH); diffusers' default.
MAX_SEQUENCE_LENGTH = 512
# diffusers' pipelines/flux2/system_messages.py (from BFL's flux2 repo): one newline, no trailing one.
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)
# Flux2KleinPipeline's unconditional prompt for classifier-free guidance.
NEGATIVE_PROMPT = ""

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class Flux2TextEmbeddings(NamedTuple):
    """What the FLUX.2 DiT reads from the prompt; unpacks like diffusers' `encode_prompt` result."""

    prompt_embeds: Tensor  # (B * n, L, 3 * H), encoder dtype
    text_ids: Tensor  # (B * n, L, 4) int64, (0, 0, 0, l)


class _StackedStatesEncoder(StackedLLM):
    """The FLUX.2 reading of a chat LLM at three depths, shared by Mistral Small and Qwen3.

    Subclasses name the `layers` read and the model family, and `render` prompts in their chat template.
    Inference only: the model is put in eval mode and runs under `torch.no_grad`.
    """

    generation = "FLUX.2"

    @torch.no_grad()
    def encode(
        self,
        prompts: str | list[str],
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
        device: torch.device | str | None = None,
    ) -> Flux2TextEmbeddings:
        """Encode `prompts` as the diffusers pipeline's `encode_prompt(prompt, device, n, max_sequence_length)`.

        Each prompt is wrapped in the chat template, then padded or truncated to `max_sequence_length` tokens
        (1..512); longer chats are cut with a logged warning. The model runs where it sits; the outputs go to
        `device` (default: the model's). Shapes and dtypes: see `Flux2TextEmbeddings` and this module's docstring.
        """
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt {num_images_per_prompt!r} is not a positive integer")
        input_ids, attention_mask = self.tokenize(prompts, max_sequence_length)  # (B, L) each
        device = self.device if device is None else torch.device(device)
        n = num_images_per_prompt

        output = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            output_hidden_states=True,
            use_cache=False,
        )
        # hidden_states[k]: the residual stream after k decoder layers (0: embeddings), padding included
        states = torch.stack([output.hidden_states[k] for k in self.layers], dim=1)  # (B, 3, L, H)
        states = states.to(dtype=self.dtype, device=device)
        batch, count, length, width = states.shape
        prompt_embeds = states.permute(0, 2, 1, 3).reshape(batch, length, count * width)  # (B, L, 3H)
        prompt_embeds = prompt_embeds.repeat(1, n, 1).view(batch * n, length, -1)  # (B * n, L, 3H)

        text_ids = torch.zeros(batch * n, length, 4, dtype=torch.int64, device=device)
        text_ids[..., 3] = torch.arange(length, device=device)  # (B * n, L, 4): (0, 0, 0, l)
        return Flux2TextEmbeddings(prompt_embeds, text_ids)

    def tokenize(
        self, prompts: str | list[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[Tensor, Tensor]:
        """`(input_ids, attention_mask)` `[B, max_sequence_length]` int64: what the model reads for `prompts`.

        The chat-formatted prompts (`render`) tokenized, padded (mask 0) and truncated as diffusers does, with a
        warning per truncated prompt.
        """
        prompts = _prompt_list(prompts, "prompts")
        if not isinstance(max_sequence_length, int) or not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(
                f"max_sequence_length {max_sequence_length!r} is not in 1..{MAX_SEQUENCE_LENGTH} "
                f"(FLUX.2 takes at most {MAX_SEQUENCE_LENGTH} text tokens)"
            )
        texts = self.render(prompts)
        return tokenize_chats(
            self.tokenizer,
            texts,
            max_sequence_length,
            add_special_tokens=self._add_special_tokens(texts),
            encoder=self.family,
        )

    def render(self, prompts: list[str]) -> list[str]:
        """Each prompt in the encoder's chat template, as text (special tokens written out)."""
        raise NotImplementedError

    def _add_special_tokens(self, texts: list[str]) -> bool:
        """Whether the tokenizer adds its special tokens to the rendered chats; diffusers lets it (the default)."""
        return True


class Flux2TextEncoder(_StackedStatesEncoder):
    """FLUX.2 [dev]'s encoder: Mistral Small 3.x with Mistral Small 3.1's tokenizer and chat template.

    Each prompt (with `[IMG]` removed, as diffusers' `format_input` does) follows FLUX.2's system message in a
    `[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]` chat; hidden states 10, 20 and 30 are stacked. Open one with
    `from_pretrained` (a diffusers FLUX.2 [dev] folder or cached id), `from_components` (model and processor from
    their own folders or cached ids, as BFL loads them) or `tiny` (random, for tests and the demo).
    """

    layers = (10, 20, 30)
    family = "Mistral"
    model_type = "mistral3"

    def __init__(
        self, model: Mistral3ForConditionalGeneration, tokenizer: PreTrainedTokenizerBase, chat_template: str
    ) -> None:
        super().__init__(model, tokenizer)
        self.chat_template = chat_template

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> Flux2TextEncoder:
        """Open `text_encoder/` (Mistral3ForConditionalGeneration) and `tokenizer/` (the PixtralProcessor folder)
        of a diffusers FLUX.2 [dev] folder or cached id (black-forest-labs/FLUX.2-dev), weights in `dtype`
        (FLUX.2 runs them in bf16), on `device`. Never touches the network."""
        root = _pipeline_root(path_or_id, "FLUX.2 [dev]", "Flux2TextEncoder.from_components")
        return cls._open(root / "text_encoder", root / "tokenizer", device, dtype)

    @classmethod
    def from_components(
        cls,
        model: str | Path = MISTRAL_SMALL_ID,
        processor: str | Path = MISTRAL_PROCESSOR_ID,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> Flux2TextEncoder:
        """Open the model and the processor (tokenizer + chat template) from two folders or cached ids.

        The defaults are the pair BFL's reference code loads: Mistral Small 3.2's weights, Mistral Small 3.1's
        processor. Never touches the network.
        """
        return cls._open(resolve(model), resolve(processor), device, dtype)

    @classmethod
    def _open(
        cls, model: Path, processor: Path, device: torch.device | str, dtype: torch.dtype
    ) -> Flux2TextEncoder:
        _check_model_folder(model, cls)  # before reading anything large
        tokenizer, template = load_mistral_tokenizer(processor)
        loaded = _load_model(Mistral3ForConditionalGeneration, model, dtype, device, cls)
        return cls(loaded, tokenizer, template).to(device)

    @classmethod
    def tiny(
        cls, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> Flux2TextEncoder:
        """A random Mistral3 of width 32 with the tokenizer and template shipped in the package (no files needed).

        Its output (3 x 32 = 96 wide) fits the tiny FLUX.2 DiT preset. The same `seed` gives the same weights
        everywhere; the global RNG is left as it was.
        """
        tokenizer, template = load_mistral_tokenizer(TINY_TOKENIZERS / "mistral")
        # transformers' initializers draw from the global RNG; fork it so building leaves it untouched.
        with torch.random.fork_rng(devices=[]):
            model = Mistral3ForConditionalGeneration(tiny_mistral3_config(tokenizer))
        init_random(model, seed)
        return cls(_cast_parameters(model, dtype), tokenizer, template).to(device)

    def render(self, prompts: list[str]) -> list[str]:
        """FLUX.2's system message and each prompt in Mistral's chat template, as diffusers' `format_input` and
        `PixtralProcessor.apply_chat_template` render them: `<s>[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]`."""
        # format_input drops "[IMG]" (the processor would count it as an image placeholder).
        conversations = [
            [
                {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
            ]
            for prompt in prompts
        ]
        return self.tokenizer.apply_chat_template(
            conversations, chat_template=self.chat_template, add_generation_prompt=False, tokenize=False
        )

    def _add_special_tokens(self, texts: list[str]) -> bool:
        # PixtralProcessor.apply_chat_template adds none when the (first) chat already starts with <s>.
        bos = self.tokenizer.bos_token
        return not (bos is not None and texts[0].startswith(bos))


class KleinTextEncoder(_StackedStatesEncoder):
    """FLUX.2 [klein]'s encoder: Qwen3 (4B for klein 4B, 8B for klein 9B) with its tokenizer and chat template.

    Each prompt is one user turn rendered with `add_generation_prompt=True, enable_thinking=False` (no system
    message); hidden states 9, 18 and 27 are stacked. The base (not step-distilled) klein models guide with real
    classifier-free guidance when guidance_scale > 1; their unconditional input is `encode_negative`. Open one
    with `from_pretrained` (a diffusers FLUX.2 [klein] folder or cached id), `from_components` (a Qwen3 folder or
    cached id such as Qwen/Qwen3-4B) or `tiny` (random, for tests and the demo).
    """

    layers = (9, 18, 27)
    family = "Qwen3"
    model_type = "qwen3"

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> KleinTextEncoder:
        """Open `text_encoder/` (Qwen3ForCausalLM) and `tokenizer/` (Qwen2TokenizerFast) of a diffusers FLUX.2
        [klein] folder or cached id, weights in `dtype` (FLUX.2 runs them in bf16), on `device`. Never touches
        the network."""
        root = _pipeline_root(path_or_id, "FLUX.2 [klein]", "KleinTextEncoder.from_components")
        return cls._open(root / "text_encoder", root / "tokenizer", device, dtype)

    @classmethod
    def from_components(
        cls,
        model: str | Path,
        tokenizer: str | Path | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> KleinTextEncoder:
        """Open Qwen3 from a folder or cached id (`QWEN3_4B_ID` for klein 4B, `QWEN3_8B_ID` for klein 9B), its
        tokenizer from the same place unless `tokenizer` names another. Never touches the network."""
        model_dir = resolve(model)
        return cls._open(model_dir, model_dir if tokenizer is None else resolve(tokenizer), device, dtype)

    @classmethod
    def _open(
        cls, model: Path, tokenizer: Path, device: torch.device | str, dtype: torch.dtype
    ) -> KleinTextEncoder:
        _check_model_folder(model, cls)  # before reading anything large
        loaded_tokenizer = load_qwen3_tokenizer(tokenizer)
        loaded = _load_model(Qwen3ForCausalLM, model, dtype, device, cls)
        return cls(loaded, loaded_tokenizer).to(device)

    @classmethod
    def tiny(
        cls, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> KleinTextEncoder:
        """A random Qwen3 of width 32 with the tokenizer shipped in the package (no files needed).

        Its output (3 x 32 = 96 wide) fits the tiny FLUX.2 DiT preset. The same `seed` gives the same weights
        everywhere; the global RNG is left as it was.
        """
        tokenizer = load_qwen3_tokenizer(TINY_TOKENIZERS / "qwen3")
        with torch.random.fork_rng(devices=[]):
            model = Qwen3ForCausalLM(tiny_qwen3_config(tokenizer))
        init_random(model, seed)
        return cls(_cast_parameters(model, dtype), tokenizer).to(device)

    def encode_negative(
        self,
        num_prompts: int,
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
        device: torch.device | str | None = None,
    ) -> Flux2TextEmbeddings:
        """The unconditional embeddings for `num_prompts` prompts: `NEGATIVE_PROMPT` ("") once per prompt, encoded
        with the same settings, as Flux2KleinPipeline does when guidance_scale > 1 and the model is not
        distilled."""
        if not isinstance(num_prompts, int) or num_prompts < 1:
            raise ValueError(f"num_prompts {num_prompts!r} is not a positive integer")
        return self.encode(
            [NEGATIVE_PROMPT] * num_prompts,
            max_sequence_length=max_sequence_length,
            num_images_per_prompt=num_images_per_prompt,
            device=device,
        )

    def render(self, prompts: list[str]) -> list[str]:
        """Each prompt as a Qwen3 user turn, then the generation prompt with an empty think block, as
        Flux2KleinPipeline renders it: `<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n<think>…`."""
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            for prompt in prompts
        ]


# --- tiny random encoders ----------------------------------------------------------------------------------


def tiny_mistral3_config(tokenizer: PreTrainedTokenizerBase) -> Mistral3Config:
    """Mistral Small 3.x shrunk to width 32: 31 text layers (so hidden state 30 is a pre-norm residual state, as
    in the 40-layer original), grouped-query attention, no sliding window, untied head; a 1-layer Pixtral
    vision tower (unused by text prompts) with Mistral Small 3.1's projector settings."""
    text = {
        "model_type": "mistral",
        "vocab_size": len(tokenizer),
        "hidden_size": TINY_WIDTH,
        "intermediate_size": 2 * TINY_WIDTH,
        "num_hidden_layers": 31,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e9,
        "max_position_embeddings": 131072,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "image_size": 56,
        "patch_size": 14,
    }
    return Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        projector_hidden_act="gelu",
        multimodal_projector_bias=False,
        vision_feature_layer=-1,
    )


def tiny_qwen3_config(tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    """Qwen3 shrunk to width 32: 28 layers (so hidden state 27 is a pre-norm residual state, as in the 36-layer
    originals), grouped-query attention with per-head q/k norms, tied embeddings as Qwen3-4B."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TINY_WIDTH,
        intermediate_size=2 * TINY_WIDTH,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _cast_parameters(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """Cast the weights to `dtype` as `from_pretrained(dtype=...)` loads them; the RoPE `inv_freq` buffers stay
    float32 as there (`model.to(dtype)` would round them and change every rotary angle)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


# --- loading -----------------------------------------------------------------------------------------------


def _pipeline_root(path_or_id: str | Path, model: str, alternative: str) -> Path:
    """The diffusers folder `path_or_id` resolves to, failing in our words unless it has the text encoder."""
    root = resolve(path_or_id)
    missing = [f"{name}/" for name in ("text_encoder", "tokenizer") if not (root / name).is_dir()]
    if missing:
        raise WeightsError(
            f"{root} has no {', '.join(missing)}: a diffusers {model} folder holds text_encoder/ and tokenizer/ "
            f"(for the model and tokenizer in their own folders use {alternative})"
        )
    return root


def _check_model_folder(folder: Path, encoder: type[_StackedStatesEncoder]) -> None:
    """Fail in our words unless `folder` holds a config.json of `encoder`'s model type and weights."""
    config = folder / "config.json"
    if not config.is_file():
        raise WeightsError(f"{folder}: no config.json; expected the {encoder.family} text encoder")
    model_type = read_json_object(config).get("model_type")
    if model_type != encoder.model_type:
        raise WeightsError(
            f"{folder} holds a {model_type!r} model; {encoder.__name__} reads {encoder.family} "
            f"(model_type {encoder.model_type!r})"
        )
    if not any((folder / name).is_file() for name in _WEIGHT_FILES):
        raise WeightsError(
            f"{folder}: no weights for the {encoder.family} text encoder (expected one of {', '.join(_WEIGHT_FILES)})"
        )
    check_safetensors_folder(folder)  # a damaged file fails here in our words, not inside transformers


def _load_model(
    cls: type[Mistral3ForConditionalGeneration] | type[Qwen3ForCausalLM],
    folder: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    encoder: type[_StackedStatesEncoder],
) -> PreTrainedModel:
    """`cls.from_pretrained(folder)` in `dtype` on `device` (streamed onto a GPU), offline; a checkpoint
    missing weights is an error."""
    # transformers random-initializes weights missing from the checkpoint; for us that is an error.
    model, info = load_pretrained(cls, folder, dtype, device)
    missing = sorted(info["missing_keys"])
    if missing:
        raise WeightsError(
            f"{folder}: the {encoder.family} checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}"
        )
    return model
