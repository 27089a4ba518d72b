"""FLUX.3's text conditioning: eight hidden states of Qwen3-VL per token, as diffusers' modular pipeline computes them.

`Flux3TextEncoder` runs `Qwen3VLForConditionalGeneration` (Qwen3-VL-4B-Instruct) through transformers and
reproduces diffusers 0.42.1 `Flux3TextEncoderStep` bit for bit: one prompt per call, rendered as a single user turn
with the generation prompt, tokenized to its own length (at most `max_sequence_length`), right-padded to the next
multiple of 80 tokens, the padding masked inside Qwen3-VL but given position id 1 (what the training environment,
transformers 4.57, computed), and the residual streams after layers 4, 8, ..., 32 side by side.

The tensors `encode` returns are the contract for the DiT:

- `prompt_embeds` `[n, L, 8 * H]` in the encoder's dtype (H = 2560 → 20480; the tiny encoder 32 → 256), all `L`
  positions, padding included (the DiT sees no mask), the row repeated for `n = num_images_per_prompt`;
- `text_ids` `[L, 4]` float32 `(0, 0, 0, l)`: text tokens sit on the fourth RoPE axis.

Only the tokenizer and the chat template of the Qwen3-VL processor are read: a text prompt never reaches its
image and video processors. The chat template is the processor's (`chat_template.jinja` or `chat_template.json`
beside the tokenizer), rendered by the tokenizer with the arguments the processor passes.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor
from transformers import (
    PreTrainedTokenizerBase,
    Qwen2TokenizerFast,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from flux_runtime.registry import QWEN3_VL_4B_ID
from flux_runtime.text.checks import check_count, check_sequence_length
from flux_runtime.text.llm import StackedLLM
from flux_runtime.text.tiny import TINY_WIDTH
from flux_runtime.text.tokenizers import TINY_TOKENIZERS
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve

log = logging.getLogger(__name__)

# diffusers' Flux3TextEncoderStep defaults: the text window's cap, the multiple it is padded to, the layers read.
MAX_SEQUENCE_LENGTH = 8192
PAD_MULTIPLE = 80
LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)
PAD_POSITION_ID = 1
# The base model's unconditional prompt for classifier-free guidance.
NEGATIVE_PROMPT = ""
# The tiny encoder's chat template, in Qwen3-VL's ChatML format: one `<|im_start|>role\n…<|im_end|>\n` turn per
# message (string content, or the text parts of a content list), then `<|im_start|>assistant\n` when asked.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class Flux3TextEmbeddings(NamedTuple):
    """What the FLUX.3 DiT reads from one prompt."""

    prompt_embeds: Tensor  # (n, L, 8 * H), encoder dtype
    text_ids: Tensor  # (L, 4) float32, (0, 0, 0, l)


class Flux3TextEncoder(StackedLLM):
    """Qwen3-VL read at eight depths. Open one with `from_pretrained` (a diffusers FLUX.3 folder or cached id:
    `text_encoder/` holds Qwen3VLForConditionalGeneration, `tokenizer/` the Qwen3-VL processor folder),
    `from_components` (Qwen3-VL's own folder or cached id) or `tiny` (random, for tests and the demo).
    Inference only: the model is put in eval mode and runs under `torch.no_grad`."""

    family = "Qwen3-VL"
    generation = "FLUX.3"
    model_type = "qwen3_vl"
    layers = LAYERS
    pipeline = "FLUX.3"

    @classmethod
    def model_class(cls) -> type[Qwen3VLForConditionalGeneration]:
        return Qwen3VLForConditionalGeneration

    @classmethod
    def from_components(
        cls,
        model: str | Path = QWEN3_VL_4B_ID,
        processor: str | Path | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> Flux3TextEncoder:
        """Open Qwen3-VL from a folder or cached id (default Qwen3-VL-4B-Instruct), its processor (tokenizer and chat
        template) from the same place unless `processor` names another. Never touches the network."""
        model_dir = resolve(model)
        return cls._open(model_dir, model_dir if processor is None else resolve(processor), device, dtype)

    @classmethod
    def open_tokenizer(cls, folder: Path) -> tuple[PreTrainedTokenizerBase, str]:
        return load_processor_text(folder)

    @classmethod
    def tiny_parts(cls) -> tuple[Qwen3VLConfig, PreTrainedTokenizerBase, str]:
        """A Qwen3-VL of width 32 (output 8 x 32 = 256 wide, the tiny FLUX.3 DiT's), the tiny Qwen tokenizer
        shipped in the package and `TINY_CHAT_TEMPLATE`."""
        tokenizer = Qwen2TokenizerFast.from_pretrained(TINY_TOKENIZERS / "qwen3", local_files_only=True)
        return tiny_qwen3_vl_config(tokenizer), tokenizer, TINY_CHAT_TEMPLATE

    def render(self, prompt: str) -> str:
        """The prompt as one Qwen3-VL user turn plus the generation prompt, as text (special tokens written out)."""
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )

    def text_window(self, prompt: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> int:
        """How many tokens `tokenize` gives `prompt` (its chat text rounded up to a multiple of 80, capped), without
        encoding it: what a memory plan budgets the transformer's text stream with."""
        return _window(len(self.tokenizer(self.render(prompt), verbose=False).input_ids), max_sequence_length)

    def tokenize(
        self, prompt: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`(input_ids, attention_mask, position_ids)`, each `[1, L]` int64, for one prompt.

        `L` is the rendered prompt's token count rounded up to a multiple of 80 and capped at `max_sequence_length`
        (1..8192); a longer prompt is cut to that cap with a logged warning. Padding sits on the right, masked, at
        position id 1.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"FLUX.3 encodes one prompt (a string) per call, got {type(prompt).__name__}")
        limit = MAX_SEQUENCE_LENGTH
        check_sequence_length(max_sequence_length, limit, f"FLUX.3 takes at most {limit} text tokens")
        text = self.render(prompt)
        full = len(self.tokenizer(text, verbose=False).input_ids)
        if full > max_sequence_length:
            log.warning(
                "the prompt is %d Qwen3-VL tokens in its chat template; the limit is %d, so its last %d are dropped",
                full,
                max_sequence_length,
                full - max_sequence_length,
            )
        length = _window(full, max_sequence_length)  # the count above, not a second tokenization
        batch = self.tokenizer(
            text,
            return_tensors="pt",
            padding="max_length",
            padding_side="right",
            truncation=True,
            max_length=length,
        )
        mask = batch["attention_mask"]
        position_ids = torch.arange(length)[None].masked_fill(mask == 0, PAD_POSITION_ID)
        return batch["input_ids"], mask, position_ids

    @torch.no_grad()
    def encode(
        self,
        prompt: str,
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
        device: torch.device | str | None = None,
    ) -> Flux3TextEmbeddings:
        """Encode one prompt as diffusers' `Flux3TextEncoderStep` does; outputs on `device` (default: the model's)."""
        check_count(num_images_per_prompt, "num_images_per_prompt")
        input_ids, mask, position_ids = self.tokenize(prompt, max_sequence_length)
        device = self.device if device is None else torch.device(device)
        # (1, L, 8H): the eight hidden states side by side per token
        prompt_embeds = self.stacked_states(
            device, input_ids=input_ids, attention_mask=mask, position_ids=position_ids
        )
        prompt_embeds = prompt_embeds.repeat_interleave(num_images_per_prompt, dim=0)  # (n, L, 8H)
        return Flux3TextEmbeddings(prompt_embeds, text_ids(prompt_embeds.shape[1], device))

    def encode_negative(
        self,
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
        device: torch.device | str | None = None,
    ) -> Flux3TextEmbeddings:
        """The unconditional embeddings of the base model's CFG: `NEGATIVE_PROMPT` ("") encoded the same way."""
        return self.encode(
            NEGATIVE_PROMPT,
            max_sequence_length=max_sequence_length,
            num_images_per_prompt=num_images_per_prompt,
            device=device,
        )


def text_ids(length: int, device: torch.device | str = "cpu") -> Tensor:
    """(length, 4) float32 text positions `(0, 0, 0, l)`."""
    ids = torch.zeros(length, 4, dtype=torch.float32, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def load_processor_text(folder: Path) -> tuple[PreTrainedTokenizerBase, str]:
    """The tokenizer and the chat template of a Qwen3-VL processor folder (what text prompts go through)."""
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        raise WeightsError(
            f"{folder}: no Qwen3-VL tokenizer here (expected tokenizer.json, or vocab.json and merges.txt)"
        )
    tokenizer = Qwen2TokenizerFast.from_pretrained(folder, local_files_only=True)
    template = processor_template(folder) or tokenizer.chat_template
    if not isinstance(template, str):
        raise WeightsError(
            f"{folder}: no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json); "
            "FLUX.3 formats prompts with Qwen3-VL's"
        )
    return tokenizer, template


def processor_template(folder: Path) -> str | None:
    """The processor-level chat template saved beside the tokenizer, which the processor prefers, or None."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    path = folder / "chat_template.json"
    if path.is_file():
        try:
            template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as e:
            raise WeightsError(f"{path}: not a JSON object with a 'chat_template' string ({e})") from None
        if not isinstance(template, str):
            raise WeightsError(f"{path}: 'chat_template' is not a single template string")
        return template
    return None


def tiny_qwen3_vl_config(tokenizer: PreTrainedTokenizerBase) -> Qwen3VLConfig:
    """Qwen3-VL shrunk to width 32: 33 text layers (so hidden state 32 is a pre-norm residual state, as in the
    36-layer 4B), grouped-query attention with per-head q/k norms, interleaved multimodal RoPE (sections 2/1/1 of
    the 4 frequency pairs), tied embeddings as the 4B; a 1-block vision tower that text prompts never use."""
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": TINY_WIDTH,
        "intermediate_size": 2 * TINY_WIDTH,
        "num_hidden_layers": 33,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAX_SEQUENCE_LENGTH,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": TINY_WIDTH,
        "deepstack_visual_indexes": [0],
        "num_position_embeddings": 16,
    }
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)


def _window(tokens: int, max_sequence_length: int) -> int:
    """The text window of a prompt of `tokens` chat tokens: rounded up to a multiple of 80, capped."""
    return min(math.ceil(min(tokens, max_sequence_length) / PAD_MULTIPLE) * PAD_MULTIPLE, max_sequence_length)
