"""Tokenizers of the FLUX.1 text encoders: opening them, the tiny shipped ones, and diffusers' padding/truncation.

FLUX.1 tokenizes each prompt twice: CLIP-L's BPE (lower-cased, `<|startoftext|>` … `<|endoftext|>`, padded with
`<|endoftext|>` to 77) and T5's SentencePiece Unigram (`</s>` appended, padded with `<pad>`=0 to
`max_sequence_length`). Both go through transformers' tokenizer classes with the exact arguments diffusers'
`FluxPipeline` uses, so the ids match it token for token.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

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


def load_clip_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """CLIP-L's tokenizer from `folder` (`vocab.json` + `merges.txt`, or `tokenizer.json`), as diffusers opens it."""
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        raise WeightsError(
            f"{folder}: no CLIP tokenizer here (expected tokenizer.json or vocab.json + merges.txt)"
        )
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(folder, local_files_only=True)


def load_t5_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """T5's tokenizer from `folder` (`tokenizer.json` or `spiece.model`) with `T5TokenizerFast`, as diffusers opens it."""
    if not (folder / "tokenizer.json").is_file() and not (folder / "spiece.model").is_file():
        raise WeightsError(f"{folder}: no T5 tokenizer here (expected tokenizer.json or spiece.model)")
    from transformers import T5TokenizerFast

    return T5TokenizerFast.from_pretrained(folder, local_files_only=True)


def tokenize(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_length: int, encoder: str
) -> torch.Tensor:
    """Token ids `[B, max_length]` int64, padded and truncated to `max_length` exactly as diffusers does.

    A prompt longer than `max_length` tokens keeps its first tokens and its closing special token; a warning
    names the prompt, its length, how many tokens are dropped and (the start of) their text; `encoder` names
    the tokenizer in that message.
    """
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
    for i, ids in enumerate(tokenizer(prompts, verbose=False).input_ids):
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
