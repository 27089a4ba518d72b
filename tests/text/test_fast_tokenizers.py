"""`fast_tokenizers` against transformers' `CLIPTokenizer` / `T5TokenizerFast`: the same ids, token for token.

For each tokenizer folder (the package's tiny CLIP and T5; the tiny CLIP reduced to `vocab.json` + `merges.txt`
+ the two JSON configs, as FLUX.1-dev ships it; and config variants with an `added_tokens_decoder`, dict-valued
special tokens, space clean-up and T5 sentinels, as the real CLIP-L / T5-XXL configs have) and a varied prompt
list, batches of 1 and 3 must give `torch.equal` padded/truncated ids, the same untruncated ids and the same
decoded text, and the rebuilt backend must serialize like transformers' (padding/truncation aside). Importing
`fast_tokenizers` must not import transformers.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import CLIPTokenizer, PreTrainedTokenizerBase, T5TokenizerFast

from flux_runtime.text.fast_tokenizers import FastTokenizer, clip_tokenizer, t5_tokenizer
from flux_runtime.weights.errors import WeightsError

ASSETS = Path(__file__).resolve().parents[2] / "flux_runtime" / "assets" / "tokenizers"
CLIP_FILES = ("vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json")

PROMPTS = [
    "",
    "A photo of a cat",
    "Café crème brûlée, naïve façade — Ångström",
    "東京の夜景、ネオンサイン 🌃🐱‍👤 and 👍🏽",
    "MiXeD CaSe WoRdS and ALLCAPS",
    "wow!!! ... ??? ,,, ;;; --- ((nested)) [brackets] {braces} <angle> @#$%^&*",
    "many    spaces\tand\ttabs\nand\n\nnewlines\r\n end",
    "digits 0123456789 3.14159 1,000,000 2024-01-01",
    "a cat <|endoftext|> a dog <|startoftext|>again<|endoftext|>",
    "uppercase special <|ENDOFTEXT|> <|StartOfText|> and </s> <pad> <unk> <extra_id_3> typed in",
    "   leading and trailing spaces   ",
    "it's don't we're they've I'm you'll he'd",
    "a photo of a cat sitting on a mat, highly detailed, 8k " * 12,  # > 77 CLIP tokens
    "an astronaut riding a horse on the moon, cinematic lighting " * 60,  # > 512 T5 tokens
    "\u00a0non-breaking\u2003em-space\u200bzero-width ﬁ ligature ① Ⅻ ＡＢＣ",
]


def _clip_reduced(tmp: Path) -> Path:
    """The tiny CLIP as FLUX.1-dev ships its `tokenizer/`: no tokenizer.json."""
    folder = tmp / "clip-no-json"
    folder.mkdir()
    for name in CLIP_FILES:
        shutil.copy(ASSETS / "clip" / name, folder / name)
    return folder


def _clip_like_clip_l(tmp: Path) -> Path:
    """The reduced tiny CLIP with an openai/clip-vit-large-patch14 style config: `added_tokens_decoder` with
    a normalized bos and an unnormalized eos, clean-up on, dict-valued special tokens in special_tokens_map."""
    folder = _clip_reduced(tmp)
    vocab = json.loads((folder / "vocab.json").read_text())
    flags = {"lstrip": False, "rstrip": False, "single_word": False, "special": True}
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = True
    config["added_tokens_decoder"] = {
        str(vocab["<|startoftext|>"]): {"content": "<|startoftext|>", "normalized": True, **flags},
        str(vocab["<|endoftext|>"]): {"content": "<|endoftext|>", "normalized": False, **flags},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _clip_dict_special_map(tmp: Path) -> Path:
    """The reduced tiny CLIP whose special_tokens_map.json stores AddedToken dicts (normalized) and no pad."""
    folder = tmp / "clip-dict-map"
    folder.mkdir()
    for name in CLIP_FILES:
        shutil.copy(ASSETS / "clip" / name, folder / name)
    token = {"lstrip": False, "rstrip": False, "single_word": False, "normalized": True}
    special = {
        "bos_token": {"content": "<|startoftext|>", **token},
        "eos_token": {"content": "<|endoftext|>", **token},
        "unk_token": {"content": "<|endoftext|>", **token},
    }
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        config.pop(key)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _t5_like_t5_xxl(tmp: Path) -> Path:
    """The tiny T5 with a google/t5-v1_1-xxl style config: 100 sentinels listed, `added_tokens_decoder`, clean-up."""
    folder = tmp / "t5-xxl-config"
    shutil.copytree(ASSETS / "t5", folder)
    flags = {"lstrip": False, "rstrip": False, "single_word": False, "normalized": False, "special": True}
    size = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    decoder = {str(i): {"content": t, **flags} for i, t in enumerate(["<pad>", "</s>", "<unk>"])}
    decoder |= {str(size + 99 - i): {"content": f"<extra_id_{i}>", **flags} for i in range(100)}
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {
        "extra_ids": 100,
        "legacy": True,
        "clean_up_tokenization_spaces": True,
        "added_tokens_decoder": decoder,
    }
    config["additional_special_tokens"] = [f"<extra_id_{i}>" for i in range(100)]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _t5_precompiled(tmp: Path) -> Path:
    """The tiny T5 with T5-XXL's kind of normalizer: SentencePiece's nmt_nfkc `Precompiled` map (from a
    SentencePiece model trained here in a fraction of a second), then runs of spaces replaced by one."""
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2

    model = io.BytesIO()
    sentences = [f"a photo of a cat number {i} on the moon" for i in range(100)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=30,
        normalization_rule_name="nmt_nfkc",
        minloglevel=2,
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    charsmap = base64.b64encode(proto.normalizer_spec.precompiled_charsmap).decode()
    folder = tmp / "t5-precompiled"
    shutil.copytree(ASSETS / "t5", folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Precompiled", "precompiled_charsmap": charsmap},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
        ],
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


FOLDERS: dict[str, tuple[Callable[[Path], Path], str, tuple[int, ...]]] = {
    "clip": (lambda tmp: ASSETS / "clip", "clip", (77,)),
    "clip-vocab-merges": (_clip_reduced, "clip", (77,)),
    "clip-l-config": (_clip_like_clip_l, "clip", (77,)),
    "clip-dict-special-map": (_clip_dict_special_map, "clip", (77,)),
    "t5": (lambda tmp: ASSETS / "t5", "t5", (512, 256)),
    "t5-xxl-config": (_t5_like_t5_xxl, "t5", (512, 256)),
    "t5-precompiled": (_t5_precompiled, "t5", (512, 256)),
}


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(ours, transformers', max lengths) for one tokenizer folder."""
    make, kind, lengths = FOLDERS[request.param]
    folder = make(tmp_path_factory.mktemp(request.param))
    if kind == "clip":
        ref = CLIPTokenizer.from_pretrained(folder, local_files_only=True)
        return clip_tokenizer(folder), ref, lengths
    return t5_tokenizer(folder), T5TokenizerFast.from_pretrained(folder, local_files_only=True), lengths


def _batches(size: int) -> list[list[str]]:
    return [PROMPTS[i : i + size] for i in range(0, len(PROMPTS), size)]


@pytest.mark.parametrize("batch", [1, 3])
def test_ids_equal_transformers(
    pair: tuple[FastTokenizer, PreTrainedTokenizerBase, tuple[int, ...]], batch: int
):
    ours, ref, lengths = pair
    for max_length in lengths:
        for prompts in _batches(batch):
            expected = ref(
                prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
            ).input_ids
            got = ours.ids(prompts, max_length)
            assert got.dtype == torch.int64 and got.shape == (len(prompts), max_length)
            assert torch.equal(got, expected), prompts


def test_long_prompts_are_truncated_keeping_the_closing_token(pair):
    ours, _, lengths = pair
    full = ours.untruncated([PROMPTS[-2]])[0]
    for max_length in lengths:
        assert len(full) > max_length
        ids = ours.ids([PROMPTS[-2]], max_length)[0].tolist()
        assert ids[:-1] == full[: max_length - 1] and ids[-1] == full[-1]


@pytest.mark.parametrize("batch", [1, 3])
def test_untruncated_and_decode_equal_transformers(pair, batch: int):
    ours, ref, lengths = pair
    for prompts in _batches(batch):
        expected = ref(prompts, verbose=False).input_ids
        assert ours.untruncated(prompts) == expected
        for ids in expected:
            for part in (ids, ids[1:-1], ids[lengths[-1] - 1 : -1], ids[:3]):
                assert ours.decode(part) == ref.decode(part), part
    padded = ours.ids(PROMPTS[:3], lengths[0])
    for row in padded:
        assert ours.decode(row) == ref.decode(row)
        assert ours.decode(row.tolist()) == ref.decode(row.tolist())


def test_backend_serializes_like_transformers(pair):
    ours, ref, _ = pair
    mine, theirs = json.loads(ours.backend.to_str()), json.loads(ref.backend_tokenizer.to_str())
    for config in (mine, theirs):
        config.pop("padding"), config.pop("truncation")
    assert mine == theirs
    assert ours.backend.encode_special_tokens == ref.backend_tokenizer.encode_special_tokens


def test_an_empty_batch_is_an_empty_tensor():
    assert clip_tokenizer(ASSETS / "clip").ids([], 77).shape == (0, 77)


def test_missing_files_are_one_line_errors(tmp_path: Path):
    (tmp_path / "spiece.model").write_bytes(b"")
    with pytest.raises(WeightsError, match=r"no tokenizer\.json"):
        t5_tokenizer(tmp_path)
    with pytest.raises(WeightsError, match="no CLIP tokenizer"):
        clip_tokenizer(tmp_path)


def test_importing_does_not_import_transformers():
    code = (
        "import sys, flux_runtime.text.fast_tokenizers; assert 'transformers' not in sys.modules, 'imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
