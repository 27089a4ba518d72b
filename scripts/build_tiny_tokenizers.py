"""Build the tiny CLIP and T5 tokenizers shipped in `flux_runtime/assets/tokenizers/` (run once, commit output).

The real FLUX.1 tokenizers (CLIP-L's 49408-token BPE, T5's 32100-piece SentencePiece Unigram) are large
downloads; tests and the offline demo need tokenizers with the same *structure* but a few hundred entries:

- CLIP: byte-level BPE with the `</w>` end-of-word suffix, the vocabulary laid out like CLIP's (256 byte
  symbols, the same 256 with `</w>`, one token per merge, then `<|startoftext|>`, `<|endoftext|>` as the two
  highest ids), lower-casing, `model_max_length` 77. Every byte has a symbol, so any prompt tokenizes
  without an unknown token (which in CLIP would be `<|endoftext|>` and move the pooled position).
- T5: Unigram with `<pad>`=0, `</s>`=1, `<unk>`=2 (the ids T5 uses; transformers' `T5Tokenizer` fixes
  `unk_id=2`), Metaspace pre-tokenization, `</s>` appended; every printable ASCII character is a piece,
  so any ASCII prompt tokenizes without `<unk>`. No normalizer: transformers rebuilds a T5 tokenizer from
  the vocabulary and keeps a normalizer only if it is a precompiled SentencePiece charsmap.

CLIP's merges are learned by plain BPE on the small CORPUS below; T5's pieces are its printable ASCII
characters and most frequent words, scored by log frequency. Both are computed with explicit tie-breaks
(the `tokenizers` trainers break ties by hash order), so a rerun writes the same bytes. The `tokenizers`
library pre-tokenizes the corpus and builds and serializes the tokenizers. The script then loads each folder
through transformers' `CLIPTokenizer` / `T5TokenizerFast` and checks that they tokenize like the
`tokenizers` object written.

Usage: python scripts/build_tiny_tokenizers.py [--out flux_runtime/assets/tokenizers]
"""

from __future__ import annotations

import argparse
import json
import math
import string
from collections import Counter
from itertools import pairwise
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

CORPUS = """\
a photo of a cat sitting on a wooden table next to a window
a portrait of a woman with long red hair, soft light, high detail
an astronaut riding a horse on the moon, digital art
a dog running through a green field under a blue sky with white clouds
a cup of coffee on a desk in the morning, shallow depth of field
the city at night with neon lights and rain on the street
a small house in the mountains covered in snow, winter landscape
a bowl of fresh fruit: apples, oranges, bananas and grapes
a close up of a flower with water drops, macro photography
an old man reading a book by the fire in a dark room
a red car parked in front of a modern building
a beautiful sunset over the ocean with waves and a sandy beach
a forest path in autumn with yellow and orange leaves
a robot painting a picture in an art studio
a bird flying over a lake at sunrise, golden hour
two children playing with a ball in the park
a plate of pasta with tomato sauce and cheese
a black and white photo of a bridge over a river
a castle on a hill, fantasy style, highly detailed
a young girl wearing a hat and a blue dress
a cute cartoon fox in the style of an anime illustration
an oil painting of a ship in a storm at sea
a man in a suit standing in the rain holding an umbrella
a glass of water on a kitchen counter, studio lighting
A sign that says "hello world" in big letters
The quick brown fox jumps over the lazy dog.
Paris, New York, London and Tokyo at night
a watercolor of mountains and trees, soft colors
a 3d render of a cube and a sphere, 4k, 8k, hdr
a street market with people, food and music
a horse in a field of tall grass, cinematic, film grain
a lion with a big mane, wildlife photo, sharp focus
a cozy bedroom with a bed, a lamp and a plant
an elephant walking in the desert under the sun
a logo with the text flux, simple, vector, minimal
a woman smiling, looking at the camera, natural light
a train crossing a bridge in the snow
the face of a wise old wizard with a long white beard
a tiger, a bear, a wolf and a rabbit in the woods
a spaceship flying past a planet with rings, stars in the background
a plate of sushi, a bowl of rice and green tea
a man playing guitar on a stage, concert lights
a cat and a dog sleeping together on a sofa
a tall tree alone on a hill, dramatic sky
a boat on a calm river at dawn, mist, reflection
a vintage poster of a city, bold colors, 1950s
a knight in shining armor holding a sword
a dragon breathing fire over a village
an empty road through the desert, long shot
a girl with a red balloon walking in the rain
a happy family having dinner at home
a butterfly on a pink flower in a garden
""".replace("\n", " ")

SAMPLES = [
    "a photo of a cat",
    "An astronaut riding a horse on the moon, 4k!",
    'A Sign That Says "Hello World" -- 100% (ASCII ~ {}[]<>|\\^`@#$&*_+=/?;:\')',
    "naïve café — 東京",
    "",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable unicode characters (the byte-level alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def clip_pipeline(tok: Tokenizer) -> None:
    """Normalizer and pre-tokenizer as transformers' `CLIPTokenizer` builds them."""
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(
                    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
                ),
                behavior="removed",
                invert=True,
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )


def learn_bpe(words: Counter[str], num_merges: int) -> list[tuple[str, str]]:
    """Classic BPE merge learning on `words` (byte-level symbols), most frequent pair first, ties by name.

    Each word ends in a `</w>` symbol as in CLIP. Stops early when no pair occurs twice.
    """
    seqs = {w: [*w[:-1], w[-1] + "</w>"] for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, n in words.items():
            s = seqs[w]
            for pair in pairwise(s):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), n = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if n < 2:
            break
        merges.append((a, b))
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_clip(out: Path, num_merges: int) -> Tokenizer:
    """Learn `num_merges` BPE merges on CORPUS and write a CLIP-layout tokenizer folder to `out`."""
    alphabet = list(bytes_to_unicode().values())
    splitter = Tokenizer(models.BPE())
    clip_pipeline(splitter)
    normalized = splitter.normalizer.normalize_str(CORPUS)
    words = Counter(w for w, _ in splitter.pre_tokenizer.pre_tokenize_str(normalized))
    merges = learn_bpe(words, num_merges)
    assert len(merges) == num_merges, f"the corpus yields only {len(merges)} merges"

    # CLIP's layout: bytes, bytes + "</w>", one token per merge, then the two special tokens last.
    tokens = alphabet + [c + "</w>" for c in alphabet] + [a + b for a, b in merges]
    assert len(set(tokens)) == len(tokens)
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}

    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="</w>",
            fuse_unk=False,
            unk_token="<|endoftext|>",
        )
    )
    clip_pipeline(tok)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, normalized=True, special=True) for t in ("<|startoftext|>", "<|endoftext|>")]
    )
    tok.post_processor = processors.RobertaProcessing(
        ("<|endoftext|>", vocab["<|endoftext|>"]), ("<|startoftext|>", vocab["<|startoftext|>"]), False, False
    )

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    specials = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
    }
    write_json(out / "special_tokens_map.json", specials)
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "CLIPTokenizer",
            "model_max_length": 77,
            "do_lower_case": True,
            "errors": "replace",
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            **specials,
        },
    )
    return tok


def build_t5(out: Path, num_words: int) -> Tokenizer:
    """Write a T5-layout Unigram tokenizer folder to `out`: ASCII characters plus CORPUS's frequent words.

    A piece's score is its log relative frequency in CORPUS (a unigram language model fitted by counting);
    characters get one extra count so unseen ones still have a finite score.
    """
    specials = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2 as in T5

    def pipeline(t: Tokenizer) -> None:
        t.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.WhitespaceSplit(),
                pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
            ]
        )

    splitter = Tokenizer(models.Unigram())
    pipeline(splitter)
    words = Counter(w for w, _ in splitter.pre_tokenizer.pre_tokenize_str(CORPUS))
    chars = Counter("".join(w * n for w, n in words.items()))
    counts: Counter[str] = Counter({c: chars[c] + 1 for c in [*string.printable.strip(), "▁"]})
    ranked = sorted(((n, w) for w, n in words.items()), key=lambda nw: (-nw[0], nw[1]))
    counts.update({w: n for n, w in ranked[:num_words]})
    total = sum(counts.values())
    scored = sorted(((p, math.log(n / total)) for p, n in counts.items()), key=lambda ps: (-ps[1], ps[0]))
    pieces = [(p, 0.0) for p in specials] + scored

    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    pipeline(tok)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    specials_map = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    write_json(out / "special_tokens_map.json", specials_map)
    write_json(
        out / "tokenizer_config.json",
        {"tokenizer_class": "T5Tokenizer", "model_max_length": 512, "extra_ids": 0, **specials_map},
    )
    return tok


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check(folder: Path, raw: Tokenizer, cls_name: str) -> None:
    """Fail unless transformers' `cls_name` loaded from `folder` gives the ids of the written tokenizer."""
    import transformers

    hf = getattr(transformers, cls_name).from_pretrained(folder, local_files_only=True)
    for text in SAMPLES:
        want = raw.encode(text).ids
        got = hf(text).input_ids
        assert got == want, f"{cls_name} {folder}: {text!r}: {got} != {want}"
    print(
        f"{folder}: {len(hf)} tokens, {sum(f.stat().st_size for f in folder.iterdir()) // 1024} KiB; {cls_name} agrees"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parents[1]
    parser.add_argument("--out", type=Path, default=root / "flux_runtime" / "assets" / "tokenizers")
    args = parser.parse_args()
    clip = build_clip(args.out / "clip", num_merges=200)
    t5 = build_t5(args.out / "t5", num_words=256)
    check(args.out / "clip", clip, "CLIPTokenizer")
    check(args.out / "t5", t5, "T5TokenizerFast")
    unk = t5.token_to_id("<unk>")
    assert unk not in t5.encode(string.printable.strip()).ids, "an ASCII character maps to <unk>"


if __name__ == "__main__":
    main()
