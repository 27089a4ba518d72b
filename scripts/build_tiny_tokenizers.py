"""Build the tiny tokenizers shipped in `flux_runtime/assets/tokenizers/` (run once, commit output).

The real tokenizers (FLUX.1: CLIP-L's 49408-token BPE, T5's 32100-piece SentencePiece Unigram; FLUX.2: Mistral
Small 3.1's 131072-token tekken BPE, Qwen3's ~152k-token BPE) are large downloads; tests and the offline demo
need tokenizers with the same *structure* but a few hundred entries:

- CLIP: byte-level BPE with the `</w>` end-of-word suffix, the vocabulary laid out like CLIP's (256 byte
  symbols, the same 256 with `</w>`, one token per merge, then `<|startoftext|>`, `<|endoftext|>` as the two
  highest ids), lower-casing, `model_max_length` 77. Every byte has a symbol, so any prompt tokenizes
  without an unknown token (which in CLIP would be `<|endoftext|>` and move the pooled position).
- T5: Unigram with `<pad>`=0, `</s>`=1, `<unk>`=2 (the ids T5 uses; transformers' `T5Tokenizer` fixes
  `unk_id=2`), Metaspace pre-tokenization, `</s>` appended; every printable ASCII character is a piece,
  so any ASCII prompt tokenizes without `<unk>`. No normalizer: transformers rebuilds a T5 tokenizer from
  the vocabulary and keeps a normalizer only if it is a precompiled SentencePiece charsmap.
- Mistral (FLUX.2 [dev]; the `tokenizer/` folder of a diffusers Flux2Pipeline is a PixtralProcessor folder):
  byte-level BPE laid out like tekken (20 control tokens at Mistral Small 3.1's ids: `<unk>`=0, `<s>`=1,
  `</s>`=2, `[INST]`=3, `[/INST]`=4, `[IMG]`=10, `<pad>`=11, `[SYSTEM_PROMPT]`=17, `[/SYSTEM_PROMPT]`=18, ...;
  then the 256 bytes in byte order, then one token per merge), tekken's pre-tokenizer regex, `<s>` prepended,
  no `padding_side` (so transformers pads on the right). Beside the tokenizer files: a `[SYSTEM_PROMPT]` /
  `[INST]` chat template in `chat_template.jinja` and the processor and image-processor configs
  PixtralProcessor reads (the image side is never used for text prompts).
- Qwen3 (FLUX.2 [klein]): byte-level BPE with Qwen2's pre-tokenizer regex and NFC normalizer, the 256 byte
  symbols first, then the merges, then `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos), `<think>`,
  `</think>`; no BOS. Its ChatML template (in tokenizer_config.json, as the Qwen3 repos ship it) honours
  `add_generation_prompt` and `enable_thinking=False` (an empty `<think>` block) the way Qwen3's does.
  Every byte has a symbol in both, so any prompt tokenizes without an unknown token.

CLIP's merges are learned by plain BPE on the small CORPUS below; Mistral's and Qwen3's on CORPUS plus FLUX.2's
system message (so the chat wrapping stays short, as with the real vocabularies); T5's pieces are its printable
ASCII characters and most frequent words, scored by log frequency. All are computed with explicit tie-breaks
(the `tokenizers` trainers break ties by hash order), so a rerun writes the same bytes. The `tokenizers`
library pre-tokenizes the corpus and builds and serializes the tokenizers. The script then loads each folder
through the transformers class diffusers uses (`CLIPTokenizer`, `T5TokenizerFast`, `TokenizersBackend` as
PixtralProcessor loads it, `Qwen2TokenizerFast`) and checks that they tokenize like the `tokenizers` object
written. The chat templates are written here, in Mistral Small 3.1's and Qwen3's formats; they are not copies.

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
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PATTERN

from flux_runtime.text.flux2 import SYSTEM_MESSAGE

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
# Rendered chats (special tokens inside the text), checked on the FLUX.2 tokenizers only.
CHAT_SAMPLES = {
    "mistral": [
        f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]a photo of a cat[/INST]",
        "<s>[INST]Two lines\nand  double  spaces[/INST]ok</s><pad>[IMG][IMG_BREAK][IMG_END]",
    ],
    "qwen3": [
        "<|im_start|>user\na photo of a cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nIt's 3 o'clock!<|im_end|><|endoftext|>",
    ],
}

# tekken's pre-tokenizer pattern (transformers' MistralConverter and its `fix_mistral_regex` use the same).
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral Small 3.1's first 20 control tokens, at their ids (the real vocabulary reserves 1000 such slots).
MISTRAL_CONTROL = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
]  # fmt: skip
# Mistral Small 3.1's format: <s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]user[/INST]assistant</s>, content as
# a string or a list of text / image blocks (an image block renders as [IMG]). Unlike the real template there is
# no default system prompt (and so no date in it) when the conversation has none.
MISTRAL_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['content'] is string %}
        {%- set blocks = [{'type': 'text', 'text': message['content']}] %}
    {%- else %}
        {%- set blocks = message['content'] %}
    {%- endif %}
    {%- if message['role'] == 'system' %}
        {{- '[SYSTEM_PROMPT]' }}
    {%- elif message['role'] == 'user' %}
        {{- '[INST]' }}
    {%- elif message['role'] != 'assistant' %}
        {{- raise_exception('Only system, user and assistant messages are supported') }}
    {%- endif %}
    {%- for block in blocks %}
        {%- if block['type'] == 'text' %}
            {{- block['text'] }}
        {%- elif block['type'] in ['image', 'image_url'] and message['role'] == 'user' %}
            {{- '[IMG]' }}
        {%- else %}
            {{- raise_exception('Unsupported content block in a ' + message['role'] + ' message') }}
        {%- endif %}
    {%- endfor %}
    {%- if message['role'] == 'system' %}
        {{- '[/SYSTEM_PROMPT]' }}
    {%- elif message['role'] == 'user' %}
        {{- '[/INST]' }}
    {%- else %}
        {{- eos_token }}
    {%- endif %}
{%- endfor %}
"""
# Qwen3's ChatML format, reduced to plain system / user / assistant turns: each turn is
# <|im_start|>role\ncontent<|im_end|>\n; the generation prompt opens the assistant turn and, with
# enable_thinking=False, closes an empty think block as Qwen3's template does.
QWEN3_CHAT_TEMPLATE = r"""{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Only system, user and assistant messages are supported') }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


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


def learn_bpe(words: Counter[str], num_merges: int, suffix: str = "</w>") -> list[tuple[str, str]]:
    """Classic BPE merge learning on `words` (byte-level symbols), most frequent pair first, ties by name.

    Each word's last symbol carries `suffix`: `</w>` as in CLIP, nothing for GPT-style byte-level BPE (Mistral,
    Qwen). Stops early when no pair occurs twice.
    """
    seqs = {w: [*w[:-1], w[-1] + suffix] for w in words}
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


def bytelevel_pipeline(tok: Tokenizer, pattern: str) -> None:
    """GPT-style byte-level pre-tokenization (regex split, then bytes to symbols) and decoder, as tekken and
    Qwen2 tokenizers are converted."""
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()


def learn_bytelevel_merges(tok: Tokenizer, num_merges: int) -> list[tuple[str, str]]:
    """`num_merges` BPE merges learned on CORPUS and the system message, pre-tokenized by `tok`'s pipeline."""
    text = CORPUS + " " + SYSTEM_MESSAGE
    if tok.normalizer is not None:
        text = tok.normalizer.normalize_str(text)
    words = Counter(w for w, _ in tok.pre_tokenizer.pre_tokenize_str(text))
    merges = learn_bpe(words, num_merges, suffix="")
    assert len(merges) == num_merges, f"the corpus yields only {len(merges)} merges"
    return merges


def build_mistral(out: Path, num_merges: int) -> Tokenizer:
    """Write a Mistral-Small-3.1-layout tokenizer folder (a PixtralProcessor folder) to `out`."""
    splitter = Tokenizer(models.BPE())
    bytelevel_pipeline(splitter, TEKKEN_PATTERN)
    merges = learn_bytelevel_merges(splitter, num_merges)

    # tekken's layout: control tokens, the 256 bytes in byte order, then one token per merge.
    byte_symbols = bytes_to_unicode()
    tokens = MISTRAL_CONTROL + [byte_symbols[b] for b in range(256)] + [a + b for a, b in merges]
    assert len(set(tokens)) == len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    # transformers' tekken conversion sets ignore_merges (a word that is a token is taken whole).
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    bytelevel_pipeline(tok, TEKKEN_PATTERN)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in MISTRAL_CONTROL])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", vocab["<s>"])]
    )

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    write_json(out / "special_tokens_map.json", specials)
    # As Mistral Small 3.1's: a LlamaTokenizer class name (PixtralProcessor ignores it), <s> added, no padding_side.
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "LlamaTokenizer",
            "processor_class": "PixtralProcessor",
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 131072,
            **specials,
        },
    )
    (out / "chat_template.jinja").write_text(MISTRAL_CHAT_TEMPLATE, encoding="utf-8")
    # PixtralProcessor's own settings and its image processor's (Mistral Small 3.1's values; unused for text).
    write_json(
        out / "processor_config.json",
        {
            "processor_class": "PixtralProcessor",
            "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
            "patch_size": 14,
            "spatial_merge_size": 2,
        },
    )
    write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "PixtralImageProcessor",
            "processor_class": "PixtralProcessor",
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "patch_size": 14,
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"longest_edge": 1540},
        },
    )
    return tok


def build_qwen3(out: Path, num_merges: int) -> Tokenizer:
    """Write a Qwen3-layout tokenizer folder to `out`."""
    splitter = Tokenizer(models.BPE())
    splitter.normalizer = normalizers.NFC()
    bytelevel_pipeline(splitter, QWEN2_PATTERN)
    merges = learn_bytelevel_merges(splitter, num_merges)

    # Qwen's layout: the byte alphabet, one token per merge, then the added tokens.
    tokens = list(bytes_to_unicode().values()) + [a + b for a, b in merges]
    assert len(set(tokens)) == len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
    )
    # transformers' Qwen2Tokenizer rebuilds exactly this normalizer and pre-tokenizer when it loads the folder.
    tok.normalizer = normalizers.NFC()
    bytelevel_pipeline(tok, QWEN2_PATTERN)
    # <think> and </think> are ordinary added tokens in Qwen3 (decoded even with skip_special_tokens).
    added = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True)]
    added += [("<think>", False), ("</think>", False)]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, special in added if special])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, special in added if not special])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    write_json(out / "special_tokens_map.json", specials)
    decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for t, special in added
    }
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": decoder,
            "bos_token": None,
            "chat_template": QWEN3_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "model_max_length": 131072,
            "split_special_tokens": False,
            "unk_token": None,
            **specials,
        },
    )
    return tok


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check(folder: Path, raw: Tokenizer, cls_name: str, samples: list[str] = SAMPLES) -> None:
    """Fail unless transformers' `cls_name` loaded from `folder` gives the ids of the written tokenizer."""
    import transformers

    hf = getattr(transformers, cls_name).from_pretrained(folder, local_files_only=True)
    for text in samples:
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
    mistral = build_mistral(args.out / "mistral", num_merges=256)
    qwen3 = build_qwen3(args.out / "qwen3", num_merges=256)
    check(args.out / "clip", clip, "CLIPTokenizer")
    check(args.out / "t5", t5, "T5TokenizerFast")
    # PixtralProcessor loads its tokenizer with TokenizersBackend whatever tokenizer_class says.
    check(args.out / "mistral", mistral, "TokenizersBackend", SAMPLES + CHAT_SAMPLES["mistral"])
    check(args.out / "qwen3", qwen3, "Qwen2TokenizerFast", SAMPLES + CHAT_SAMPLES["qwen3"])
    unk = t5.token_to_id("<unk>")
    assert unk not in t5.encode(string.printable.strip()).ids, "an ASCII character maps to <unk>"


if __name__ == "__main__":
    main()
