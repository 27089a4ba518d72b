"""Tokenizers of the FLUX.1 text encoders: opening them, the tiny shipped ones, and diffusers' padding/truncation.

FLUX.1 tokenizes each prompt twice: CLIP-L's BPE (lower-cased, `<|startoftext|>` … `<|endoftext|>`, padded with
`<|endoftext|>` to 77) and T5's SentencePiece Unigram (`</s>` appended, padded with `<pad>`=0 to
`max_sequence_length`). Both are built on the `tokenizers` library as transformers' `CLIPTokenizer` and
`T5TokenizerFast` build them (`fast_tokenizers`), called with the padding and truncation diffusers' `FluxPipeline`
asks for, so the ids match it token for token without importing transformers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from flux_runtime.text.fast_tokenizers import FastTokenizer, clip_tokenizer, t5_tokenizer
from flux_runtime.weights.errors import WeightsError

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Built by scripts/build_tiny_tokenizers.py: same structure as CLIP-L's and T5's, a few hundred tokens.
TINY_TOKENIZERS = Path(__file__).resolve().parent.parent / "assets" / "tokenizers"


def tiny_tokenizer_path(kind: Literal["clip", "t5"]) -> Path:
    """The folder of the tiny `kind` tokenizer shipped in the package (for tests and the offline demo)."""
    if kind not in ("clip", "t5"):
        raise ValueError(f"unknown tiny tokenizer {kind!r}; there are 'clip' and 't5'")
    return TINY_TOKENIZERS / kind


def load_clip_tokenizer(folder: Path) -> FastTokenizer:
    """CLIP-L's tokenizer from `folder` (`vocab.json` + `merges.txt`, or `tokenizer.json`), as transformers'
    `CLIPTokenizer` builds it (the same ids), on the `tokenizers` library alone."""
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        raise WeightsError(
            f"{folder}: no CLIP tokenizer here (expected tokenizer.json or vocab.json + merges.txt)"
        )
    return clip_tokenizer(folder)


def load_t5_tokenizer(folder: Path) -> FastTokenizer | PreTrainedTokenizerBase:
    """T5's tokenizer from `folder` as transformers' `T5TokenizerFast` builds it (the same ids): from
    `tokenizer.json` on the `tokenizers` library alone; a folder with only `spiece.model` through transformers,
    which converts it."""
    if (folder / "tokenizer.json").is_file():
        return t5_tokenizer(folder)
    if not (folder / "spiece.model").is_file():
        raise WeightsError(f"{folder}: no T5 tokenizer here (expected tokenizer.json or spiece.model)")
    from transformers import T5TokenizerFast

    return T5TokenizerFast.from_pretrained(folder, local_files_only=True)


def transformers_tokenizers(clip_folder: Path, t5_folder: Path) -> tuple[PreTrainedTokenizerBase, ...]:
    """transformers' `CLIPTokenizer` and `T5TokenizerFast` of two folders (the same ids as ours): for encoders
    whose models are transformers' too (`Flux1TextEncoder.tiny`), so that diffusers can be handed them whole."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    return (
        CLIPTokenizer.from_pretrained(clip_folder, local_files_only=True),
        T5TokenizerFast.from_pretrained(t5_folder, local_files_only=True),
    )


def tokenize(
    tokenizer: FastTokenizer | PreTrainedTokenizerBase, prompts: list[str], max_length: int, encoder: str
) -> torch.Tensor:
    """Token ids `[B, max_length]` int64, padded and truncated to `max_length` exactly as diffusers does.

    A prompt longer than `max_length` tokens keeps its first tokens and its closing special token; a warning
    names the prompt, its length, how many tokens are dropped and (the start of) their text; `encoder` names
    the tokenizer in that message.
    """
    if isinstance(tokenizer, FastTokenizer):
        input_ids = tokenizer.ids(prompts, max_length)
        full = tokenizer.untruncated(prompts)
    else:
        input_ids = tokenizer(
            prompts,
            padding="max_length",
            max_length=max_length,
            truncation=True,
            return_length=False,
            return_overflowing_tokens=False,
            return_tensors="pt",
        ).input_ids
        # verbose=False: our warning below replaces transformers' "sequence length is longer than" message.
        full = tokenizer(prompts, verbose=False).input_ids
    for i, ids in enumerate(full):
        if len(ids) > max_length:
            # Truncation keeps the trailing special token, so the dropped tokens end just before it.
            dropped = ids[max_length - 1 : -1]
            logger.warning(
                "prompt %d is %d %s tokens; the limit is %d, so its last %d tokens are dropped: %.200r",
                i,
                len(ids),
                encoder,
                max_length,
                len(dropped),
                tokenizer.decode(dropped),
            )
    return input_ids
