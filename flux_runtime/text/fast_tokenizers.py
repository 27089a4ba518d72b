"""FLUX.1's CLIP-L and T5 tokenizers and FLUX.2 [klein]'s Qwen3 tokenizer built directly on the `tokenizers`
library, without importing transformers.

Importing transformers only to tokenize prompts costs seconds per process; `tokenizers` (the Rust library under
transformers' tokenizers) imports in a fraction of that. The loaders here rebuild, from the files of a tokenizer
folder, the same `tokenizers.Tokenizer` that transformers 5's `CLIPTokenizer` / `T5TokenizerFast.from_pretrained`
assemble (and `Qwen2TokenizerFast`'s, `qwen2_tokenizer`), and `FastTokenizer` calls it the way transformers does
for `tokenizer(prompts, padding="max_length", max_length=..., truncation=True)` (with its attention mask for
Qwen), for the untruncated ids and for `decode`, so the token ids are the same. Qwen's tokenizer also renders its
chat template (`FastTokenizer.apply_chat_template`, through `chat_template`).

What transformers does, and so what is reproduced:

* No class uses `tokenizer.json` as-is: each rebuilds the pipeline (normalizer, pre-tokenizer, model options,
  decoder, post-processor) in code and takes from the file only the vocabulary (CLIP, Qwen: also the merges;
  Qwen: also the post-processor; T5: also the SentencePiece `Precompiled` normalizer map) and its added tokens.
  Without `tokenizer.json`, CLIP reads `vocab.json` + `merges.txt` (Qwen then goes through transformers).
* Special tokens: `tokenizer_config.json`'s `added_tokens_decoder` when it has one, otherwise
  `special_tokens_map.json` and `tokenizer.json`'s `added_tokens`; the named tokens (bos, eos, unk, pad...) are
  then added to the backend, in the same order and with the same flags (`normalized`, `special`...), since these
  decide how a prompt that types `<|endoftext|>` is split.
* Padding to `max_length` with the pad token on `padding_side`; "longest_first" truncation on `truncation_side`
  that keeps room for the closing special token; decode with special tokens kept, CLIP's `</w>` turned into
  spaces and the text stripped, and transformers' space clean-up for non-BPE models when the config asks for it.
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, Unigram

from flux_runtime.weights.errors import WeightsError

# The named special tokens of transformers' tokenizers, in the order it adds them to the backend.
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# CLIP's word split: its special tokens, English contractions, letter runs, single digits, other-symbol runs.
_CLIP_SPLIT = (
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
)
_CLIP_WORD_SUFFIX = "</w>"
# transformers' `clean_up_tokenization`: spaces before punctuation and inside English contractions are removed.
_CLEAN_UP = [(" " + s, s) for s in (".", "?", "!", ",")] + [(" ' ", "'")]
_CLEAN_UP += [(" " + s, s) for s in ("n't", "'m", "'s", "'ve", "'re")]

Token = str | AddedToken
# transformers' `model_max_length` when tokenizer_config.json gives none
_NO_LIMIT = int(1e30)


class Encoded(dict):
    """What `FastTokenizer(text)` returns: transformers' `BatchEncoding` reduced to its `input_ids`, read as an
    attribute or by key as callers of a transformers tokenizer do."""

    @property
    def input_ids(self) -> list[int] | list[list[int]]:
        return self["input_ids"]


class FastTokenizer:
    """A `tokenizers.Tokenizer` called as transformers calls it: padded/truncated ids, untruncated ids, decode."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        pad_token: str,
        padding_side: str = "right",
        truncation_side: str = "right",
        word_suffix: str | None = None,
        clean_up_spaces: bool = False,
        model_max_length: int = _NO_LIMIT,
    ) -> None:
        """Wrap `tokenizer` (special tokens and post-processor set) padding with `pad_token` on `padding_side`."""
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None:
            raise WeightsError(f"the pad token {pad_token!r} is not in the tokenizer's vocabulary")
        self.backend = tokenizer
        self.pad_token, self.pad_id = pad_token, pad_id
        self.padding_side, self.truncation_side = padding_side, truncation_side
        self.word_suffix, self.clean_up_spaces = word_suffix, clean_up_spaces
        self.model_max_length = model_max_length  # tokenizer_config.json's, as transformers reads it
        self.chat_template: str | None = None  # what `apply_chat_template` renders (Qwen's)
        self.special_tokens_map: dict[str, str] = {}  # the named special tokens a chat template sees
        self._lock = (
            threading.Lock()
        )  # padding and truncation are backend settings, switched on for `ids` only

    def __call__(self, text: str | list[str]) -> Encoded:
        """`tokenizer(text).input_ids` as transformers answers it with no options: the untruncated ids (a list
        of them for a list of prompts)."""
        if isinstance(text, str):
            return Encoded(input_ids=self.untruncated([text])[0])
        return Encoded(input_ids=self.untruncated(list(text)))

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the lock behind (each copy gets its own: `copy.deepcopy(tokenizer)` then
        counts tokens beside the pipeline's calls, as one does with a transformers tokenizer)."""
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def pad_token_id(self) -> int:
        """The pad token's id (transformers' name for it)."""
        return self.pad_id

    def __len__(self) -> int:
        """The vocabulary with its added tokens (transformers' `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def ids(self, prompts: list[str], max_length: int) -> torch.Tensor:
        """Token ids int64 `[B, max_length]`: special tokens added, truncated keeping the closing one, padded."""
        return self.padded(prompts, max_length)[0]

    def padded(
        self, prompts: list[str], max_length: int, add_special_tokens: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, attention mask) int64 `[B, max_length]`, as transformers' `tokenizer(prompts,
        padding="max_length", truncation=True, max_length=max_length, add_special_tokens=...)`: "longest_first"
        truncation on `truncation_side` (keeping room for the special tokens added), padding on `padding_side`
        (mask 0 there)."""
        if not prompts:
            empty = torch.zeros((0, max_length), dtype=torch.int64)
            return empty, empty.clone()
        with self._lock:
            self.backend.enable_truncation(
                max_length, stride=0, strategy="longest_first", direction=self.truncation_side
            )
            self.backend.enable_padding(
                direction=self.padding_side,
                pad_id=self.pad_id,
                pad_type_id=0,
                pad_token=self.pad_token,
                length=max_length,
                pad_to_multiple_of=None,
            )
            try:
                encodings = self.backend.encode_batch(prompts, add_special_tokens=add_special_tokens)
            finally:
                self.backend.no_truncation()
                self.backend.no_padding()
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.int64)
        return ids, torch.tensor([e.attention_mask for e in encodings], dtype=torch.int64)

    def untruncated(self, prompts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each prompt's full token ids (with its special tokens unless told not), neither truncated nor padded."""
        with self._lock:
            return [e.ids for e in self.backend.encode_batch(prompts, add_special_tokens=add_special_tokens)]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        chat_template: str | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The text of one chat as transformers' `tokenizer.apply_chat_template(..., tokenize=False)` renders it
        (`chat_template.render_chat`): `chat_template`, else the tokenizer's, with the named special tokens and
        `kwargs` as template variables."""
        from flux_runtime.text.chat_template import render_chat

        if tokenize:
            raise ValueError("FastTokenizer.apply_chat_template renders text only (tokenize=False)")
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        variables = {**self.special_tokens_map, **kwargs}
        return render_chat(template, conversation, add_generation_prompt=add_generation_prompt, **variables)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """The text of `ids`, special tokens kept, as transformers' `decode(ids)` writes it."""
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=False)
        if self.word_suffix is not None:
            text = text.replace(self.word_suffix, " ").strip()
        if self.clean_up_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or `{}` when there is no such file."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _added_token(fields: dict[str, Any], **override: Any) -> AddedToken:
    """An `AddedToken` from its serialized fields (transformers' `__type` marker dropped)."""
    return AddedToken(**({k: v for k, v in fields.items() if k != "__type"} | override))


def _special_tokens(
    folder: Path, config: dict[str, Any], tokenizer_json: dict[str, Any], defaults: dict[str, str]
) -> tuple[list[AddedToken], dict[str, Token]]:
    """The added tokens (by id) and the named special tokens, resolved from the folder's files as transformers does.

    Updates `config` in place with `special_tokens_map.json`'s entries when those are read (no `added_tokens_decoder`
    in the config). Named tokens that match an added token by text become that token (and its flags).
    """
    added: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in config:
        added = {int(i): _added_token(t) for i, t in config["added_tokens_decoder"].items()}
    else:
        for key, value in _read_json(folder / "special_tokens_map.json").items():
            if isinstance(value, dict):
                value = _added_token({k: v for k, v in value.items() if k != "special"}, special=True)
            if key == "extra_special_tokens" and isinstance(value, list):
                merged = list(config.get(key) or [])
                value = merged + [t for t in value if t not in merged]
            config[key] = value
        for fields in tokenizer_json.get("added_tokens", []):
            added[fields["id"]] = _added_token({k: v for k, v in fields.items() if k != "id"})
    by_text = {t.content: t for t in added.values()}
    named: dict[str, Token] = {}
    for key in _NAMED:
        value = config.get(key, defaults.get(key))
        if isinstance(value, dict):
            value = _added_token(value)
        if value:
            named[key] = by_text.get(str(value), value)
    return [added[i] for i in sorted(added)], named


def _add_special_tokens(
    tokenizer: Tokenizer, added: list[AddedToken], named: dict[str, Token], extras: list
) -> None:
    """Add the added tokens, then the named and extra special tokens not among them, as transformers does."""
    pending: list[Token] = list(added)
    known = {str(t) for t in added}
    for value in [*named.values(), *extras]:
        if str(value) not in known and value not in pending:
            pending.append(value)
    named_texts = {str(t) for t in named.values()}
    tokens = []
    for token in pending:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_texts:
            token.special = True
        tokens.append(token)
    if tokens:
        tokenizer.add_tokens(tokens)


def _config_extras(config: dict[str, Any]) -> list | None:
    """The config's extra special tokens (`additional_special_tokens` is their older name), None when it names none."""
    extras = config.get("extra_special_tokens")
    if not extras and "additional_special_tokens" in config:
        return list(config["additional_special_tokens"] or [])
    if isinstance(extras, dict):
        return list(extras.values())
    return None if "extra_special_tokens" not in config else list(extras or [])


def _sides(config: dict[str, Any], tokenizer_json: dict[str, Any]) -> tuple[str, str]:
    """(padding side, truncation side): the config's, else those saved in `tokenizer.json`, else right."""
    padding = (tokenizer_json.get("padding") or {}).get("direction", "Right").lower()
    truncation = (tokenizer_json.get("truncation") or {}).get("direction", "Right").lower()
    return config.get("padding_side", padding), config.get("truncation_side", truncation)


def clip_tokenizer(folder: Path) -> FastTokenizer:
    """CLIP-L's byte-level BPE tokenizer from `folder` (`tokenizer.json`, or `vocab.json` + `merges.txt`)."""
    folder = Path(folder)
    config = _read_json(folder / "tokenizer_config.json")
    tokenizer_json = _read_json(folder / "tokenizer.json")
    if tokenizer_json:
        model = tokenizer_json["model"]
        vocab = model["vocab"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        vocab, merges = BPE.read_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
    else:
        raise WeightsError(f"{folder}: no CLIP tokenizer here (tokenizer.json or vocab.json + merges.txt)")
    defaults = dict.fromkeys(("eos_token", "unk_token", "pad_token"), "<|endoftext|>")
    defaults["bos_token"] = "<|startoftext|>"
    added, named = _special_tokens(folder, config, tokenizer_json, defaults)
    extras = _config_extras(config) or []

    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix=_CLIP_WORD_SUFFIX,
            fuse_unk=False,
            unk_token=str(named["unk_token"]),
        )
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, added, named, extras)
    tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
    bos, eos = str(named["bos_token"]), str(named["eos_token"])
    tokenizer.post_processor = processors.RobertaProcessing(
        (eos, tokenizer.token_to_id(eos)),
        (bos, tokenizer.token_to_id(bos)),
        trim_offsets=False,
        add_prefix_space=False,
    )
    clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and bool(
        config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    )
    padding_side, truncation_side = _sides(config, tokenizer_json)
    return FastTokenizer(
        tokenizer, str(named["pad_token"]), padding_side, truncation_side, _CLIP_WORD_SUFFIX, clean_up,
        int(config.get("model_max_length", _NO_LIMIT)),
    )  # fmt: skip


def _precompiled_charsmap(tokenizer_json: dict[str, Any]) -> bytes | None:
    """The SentencePiece normalization map of `tokenizer.json`'s `Precompiled` normalizer, if it has one."""
    normalizer = tokenizer_json.get("normalizer") or {}
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    for step in steps:
        if step.get("type") == "Precompiled" and "precompiled_charsmap" in step:
            return base64.b64decode(step["precompiled_charsmap"])
    return None


def t5_tokenizer(folder: Path) -> FastTokenizer:
    """T5's SentencePiece Unigram tokenizer from `folder`'s `tokenizer.json` (a lone `spiece.model` is refused)."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise WeightsError(
            f"{folder}: no tokenizer.json here (T5 is read from tokenizer.json, not spiece.model)"
        )
    config = _read_json(folder / "tokenizer_config.json")
    tokenizer_json = _read_json(folder / "tokenizer.json")
    defaults = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    added, named = _special_tokens(folder, config, tokenizer_json, defaults)
    extras = _config_extras(config)
    if extras is None:  # T5 names `extra_ids` sentinels of its own when the config lists no extra tokens
        extras = [f"<extra_id_{i}>" for i in range(config.get("extra_ids", 100))]

    vocab = [(str(piece), float(score)) for piece, score in tokenizer_json["model"]["vocab"]]
    tokenizer = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    charsmap = _precompiled_charsmap(tokenizer_json)
    if charsmap is not None:
        tokenizer.normalizer = normalizers.Precompiled(charsmap)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    _add_special_tokens(tokenizer, added, named, extras)
    tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
    # T5 closes every sequence with the literal "</s>", given the eos token's id.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"],
        pair=["$A", "</s>", "$B", "</s>"],
        special_tokens=[("</s>", tokenizer.token_to_id(str(named["eos_token"])))],
    )
    clean_up = bool(config.get("clean_up_tokenization_spaces", False))
    padding_side, truncation_side = _sides(config, tokenizer_json)
    return FastTokenizer(
        tokenizer, str(named["pad_token"]), padding_side, truncation_side, None, clean_up,
        int(config.get("model_max_length", _NO_LIMIT)),
    )  # fmt: skip


# Qwen2's word split (transformers' Qwen2Tokenizer): English contractions, letter runs with one leading non-letter,
# single digits, punctuation runs with their line breaks, line-break runs, then whitespace.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
# What a Qwen tokenizer folder may say that the native reader does not reproduce (transformers then reads it).
_QWEN2_UNSUPPORTED = ("model_specific_special_tokens",)


def qwen2_native_reason(folder: Path) -> str | None:
    """Why `qwen2_tokenizer` cannot reproduce transformers' `Qwen2TokenizerFast` for `folder`, or None when it can:
    it needs `tokenizer.json` and one chat template (`chat_template.jinja` or `tokenizer_config.json`'s), and
    reads no model-specific named tokens (`image_token`...) or named template sets."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        return "no tokenizer.json"
    if (folder / "additional_chat_templates").is_dir():
        return "named chat templates (additional_chat_templates/)"
    config = _read_json(folder / "tokenizer_config.json")
    if not (folder / "chat_template.jinja").is_file() and not isinstance(config.get("chat_template"), str):
        return "no single chat template"
    named = {k for k, v in config.items() if k.endswith("_token") and isinstance(v, (str, dict))}
    if named - set(_NAMED) or any(k in config for k in _QWEN2_UNSUPPORTED):
        return "model-specific special tokens"
    if isinstance(config.get("extra_special_tokens"), dict):
        return "named extra special tokens"
    return None


def qwen2_tokenizer(folder: Path) -> FastTokenizer:
    """Qwen2/Qwen3's byte-level BPE tokenizer and chat template from `folder`, as transformers 5's
    `Qwen2TokenizerFast.from_pretrained` assembles them (`qwen2_native_reason(folder)` must be None).

    As there, `tokenizer.json` gives the vocabulary, the merges, the post-processor and the added tokens, and the
    pipeline is rebuilt in code: NFC, the Qwen2 split regex then byte-level (no prefix space), byte-level decoding.
    Its special tokens are then added as the class does after the backend's own (every named and extra special
    token again, as special), which decides their final flags. The chat template is `chat_template.jinja` when
    the folder has one, else `tokenizer_config.json`'s."""
    folder = Path(folder)
    reason = qwen2_native_reason(folder)
    if reason is not None:
        raise WeightsError(f"{folder}: the Qwen tokenizer is read through transformers here ({reason})")
    config = _read_json(folder / "tokenizer_config.json")
    tokenizer_json = _read_json(folder / "tokenizer.json")
    model = tokenizer_json.get("model") or {}
    if model.get("type") not in (None, "BPE") or not isinstance(model.get("vocab"), dict):
        raise WeightsError(f"{folder}/tokenizer.json: not a byte-level BPE vocabulary (Qwen's tokenizer)")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    defaults = dict.fromkeys(("unk_token", "eos_token", "pad_token"), "<|endoftext|>")
    added, named = _special_tokens(folder, config, tokenizer_json, defaults)
    extras = [_added_token(t) if isinstance(t, dict) else t for t in _config_extras(config) or []]

    tokenizer = Tokenizer(
        BPE(
            vocab=model["vocab"],
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(
                add_prefix_space=bool(config.get("add_prefix_space") or False), use_regex=False
            ),
        ]
    )
    tokenizer.post_processor = _file_post_processor(tokenizer_json) or processors.TemplateProcessing(
        single="$A:0", pair="$A:0 $B:1", special_tokens=[]
    )
    _add_special_tokens(tokenizer, added, named, extras)
    tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
    special = list(dict.fromkeys([*(str(t) for t in named.values()), *(str(t) for t in extras)]))
    tokenizer.add_tokens([AddedToken(t, special=True) for t in special])
    padding_side, truncation_side = _sides(config, tokenizer_json)
    fast = FastTokenizer(
        tokenizer, str(named["pad_token"]), padding_side, truncation_side, None,
        bool(config.get("clean_up_tokenization_spaces", False)), int(config.get("model_max_length", _NO_LIMIT)),
    )  # fmt: skip
    template = folder / "chat_template.jinja"
    fast.chat_template = (
        template.read_text(encoding="utf-8") if template.is_file() else config["chat_template"]
    )
    fast.special_tokens_map = {key: str(value) for key, value in named.items()}
    return fast


def _file_post_processor(tokenizer_json: dict[str, Any]) -> Any:
    """The post-processor `tokenizer.json` declares (None when it has none), parsed without its vocabulary."""
    if not tokenizer_json.get("post_processor"):
        return None
    minimal = dict(tokenizer_json, added_tokens=[])
    minimal["model"] = dict(tokenizer_json["model"], vocab={}, merges=[])
    return Tokenizer.from_str(json.dumps(minimal)).post_processor
