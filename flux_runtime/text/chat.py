"""Chat-formatted tokenization of FLUX.2's language-model encoders, as diffusers' pipelines do it.

FLUX.2 wraps each prompt in its encoder's chat template before tokenizing, then pads or truncates to exactly
`max_length` tokens:

- [dev] (Mistral Small 3.x): the `tokenizer/` folder is a PixtralProcessor folder. diffusers calls
  `processor.apply_chat_template(conversations, tokenize=True, padding="max_length", truncation=True, ...)`;
  for text-only conversations the processor renders its own chat template (from `chat_template.jinja`,
  `chat_template.json` or `processor_config.json`, never the tokenizer's) and tokenizes with a
  `TokenizersBackend` tokenizer, adding no special tokens when the text already starts with `<s>`. We do the
  same without the processor, whose image side needs torchvision.
- [klein] (Qwen3): `Qwen2TokenizerFast` renders its own template with `add_generation_prompt=True,
  enable_thinking=False`, then tokenizes the text with its defaults (no special tokens exist to add). A folder with
  `tokenizer.json` and one chat template is read without transformers (`fast_tokenizers.qwen2_tokenizer`: the
  same backend, rendered text and ids); another through `Qwen2TokenizerFast` itself.

Both pad on the tokenizer's `padding_side` (right for these classes: Mistral's folder sets none) and truncate on
its `truncation_side` (right), returning the attention mask the encoder is run with.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flux_runtime.text.fast_tokenizers import FastTokenizer, qwen2_native_reason, qwen2_tokenizer
from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def load_mistral_tokenizer(folder: Path) -> tuple[PreTrainedTokenizerBase, str]:
    """Mistral Small 3.1's tokenizer and chat template from a PixtralProcessor folder, as the processor loads them.

    PixtralProcessor opens the tokenizer with `TokenizersBackend` whatever `tokenizer_class` says (the Hub folders
    declare LlamaTokenizer, whose transformers 5 class would rebuild the byte-level vocabulary as SentencePiece).
    """
    if not (folder / "tokenizer.json").is_file():
        raise WeightsError(
            f"{folder}: no tokenizer.json; expected Mistral Small 3.1's processor folder "
            "(tokenizer.json, tokenizer_config.json and a chat template)"
        )
    from transformers import TokenizersBackend

    tokenizer = TokenizersBackend.from_pretrained(folder, local_files_only=True)
    return tokenizer, processor_chat_template(folder)


def processor_chat_template(folder: Path) -> str:
    """The chat template a transformers processor loaded from `folder` renders with.

    Its precedence: a `chat_template` key in `processor_config.json`, else the legacy `chat_template.json`, else
    `chat_template.jinja`. A template stored only in `tokenizer_config.json` is not the processor's.
    """
    config = folder / "processor_config.json"
    if config.is_file() and (template := read_json_object(config).get("chat_template")) is not None:
        return _template_string(template, config)
    legacy = folder / "chat_template.json"
    if legacy.is_file():
        return _template_string(read_json_object(legacy).get("chat_template"), legacy)
    raw = folder / "chat_template.jinja"
    if raw.is_file():
        return raw.read_text(encoding="utf-8")
    raise WeightsError(
        f"{folder}: no chat template (chat_template.jinja, chat_template.json or processor_config.json); "
        "FLUX.2 [dev] formats prompts with Mistral Small 3.1's processor template"
    )


def load_qwen3_tokenizer(folder: Path, native: bool = True) -> FastTokenizer | PreTrainedTokenizerBase:
    """Qwen3's tokenizer (and chat template) from `folder` as diffusers' Flux2KleinPipeline opens it with
    `Qwen2TokenizerFast`: our `FastTokenizer` when the folder allows (`qwen2_native_reason`) and `native`, else
    transformers' class."""
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        raise WeightsError(
            f"{folder}: no Qwen3 tokenizer here (expected tokenizer.json, or vocab.json and merges.txt)"
        )
    if native and qwen2_native_reason(folder) is None:
        return qwen2_tokenizer(folder)
    from transformers import Qwen2TokenizerFast

    tokenizer = Qwen2TokenizerFast.from_pretrained(folder, local_files_only=True)
    if tokenizer.chat_template is None:
        raise WeightsError(
            f"{folder}: the Qwen3 tokenizer has no chat template (tokenizer_config.json or chat_template.jinja); "
            "FLUX.2 [klein] formats prompts with it"
        )
    return tokenizer


def tokenize_chats(
    tokenizer: FastTokenizer | PreTrainedTokenizerBase,
    texts: list[str],
    max_length: int,
    *,
    add_special_tokens: bool,
    encoder: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask `[B, max_length]` int64 of rendered chats, padded and truncated as diffusers.

    A chat longer than `max_length` tokens loses its end (the end of the prompt and the template's closing
    tokens); a warning names the prompt, its length, how many tokens are dropped and (the start of) their
    text; `encoder` names the tokenizer in that message.
    """
    if isinstance(tokenizer, FastTokenizer):
        input_ids, attention_mask = tokenizer.padded(texts, max_length, add_special_tokens)
        full = tokenizer.untruncated(texts, add_special_tokens)
    else:
        batch = tokenizer(
            texts,
            padding="max_length",
            truncation=True,
            max_length=max_length,
            add_special_tokens=add_special_tokens,
            return_tensors="pt",
        )
        input_ids, attention_mask = batch.input_ids, batch.attention_mask
        # verbose=False: our warning below replaces transformers' "sequence length is longer than" message.
        full = tokenizer(texts, add_special_tokens=add_special_tokens, verbose=False).input_ids
    left = tokenizer.truncation_side == "left"
    for i, ids in enumerate(full):
        if len(ids) > max_length:
            excess = len(ids) - max_length
            dropped = ids[:excess] if left else ids[max_length:]
            logger.warning(
                "prompt %d is %d %s tokens in its chat template; the limit is %d, so its %s %d tokens are "
                "dropped: %.200r",
                i,
                len(ids),
                encoder,
                max_length,
                "first" if left else "last",
                excess,
                tokenizer.decode(dropped),
            )
    return input_ids, attention_mask


def _template_string(template: object, path: Path) -> str:
    if not isinstance(template, str):
        raise WeightsError(f"{path}: 'chat_template' is not a single template string")
    return template
