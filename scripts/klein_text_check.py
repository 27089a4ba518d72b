"""FLUX.2 [klein]'s text encoder on real weights: ours (native Qwen3, tokenizer, chat template) against transformers'.

    python scripts/klein_text_check.py [MODEL] [--device cuda] [--dtype bf16]

MODEL: a diffusers FLUX.2 [klein] folder or cached id (default black-forest-labs/FLUX.2-klein-4B; -9B reads
Qwen3-8B). Opens the encoder twice, ours (`KleinTextEncoder.from_pretrained`: `Qwen3Encoder` and `FastTokenizer`)
and transformers' (`Qwen3ForCausalLM` through our streamed loader and `Qwen2TokenizerFast`), then checks over a
hard prompt list that the rendered chats, the ids and masks (512 tokens, one prompt truncated) and the
`prompt_embeds` are equal bit for bit, and prints each load's time. Exits 1 on any difference. Needs the weights
in the local Hugging Face cache (never touches the network).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

PROMPTS = [
    "",
    "a red fox in the snow",
    "  two spaces, a tab\tand\nnew lines\n",
    "Ünïcödé café, 日本語, русский, العربية, e\u0301",
    "emoji 🐱🚀👩‍👩‍👧 🇫🇷 👍🏽",
    "{{ messages }} {% if x %}y{% endif %} <|im_end|> <think>no</think>",
    "a castle on a hill at sunset, fantasy style, highly detailed, " * 60,
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="black-forest-labs/FLUX.2-klein-4B")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    from flux_runtime.text import KleinTextEncoder
    from flux_runtime.text.qwen3_encoder import Qwen3Encoder
    from flux_runtime.weights.hub import resolve

    start = time.perf_counter()
    ours = KleinTextEncoder.from_pretrained(args.model, device=args.device, dtype=dtype)
    native_s = time.perf_counter() - start
    assert isinstance(ours.model, Qwen3Encoder), "the native path was not taken"
    fresh = "transformers" not in sys.modules

    from flux_runtime.text.chat import load_qwen3_tokenizer
    from flux_runtime.text.hf_weights import load_checked

    root = resolve(args.model)
    start = time.perf_counter()
    model = load_checked(KleinTextEncoder.model_class(), root / "text_encoder", dtype, args.device, "Qwen3")
    ref = KleinTextEncoder(model, load_qwen3_tokenizer(root / "tokenizer", native=False)).to(args.device)
    ref_s = time.perf_counter() - start
    print(f"load: ours {native_s:.1f} s (transformers imported: {not fresh}), transformers' {ref_s:.1f} s")

    bad = 0
    if ours.render(PROMPTS) != ref.render(PROMPTS):
        print("rendered chats differ")
        bad += 1
    for name, a, b in zip(
        ("input_ids", "attention_mask"), ours.tokenize(PROMPTS), ref.tokenize(PROMPTS), strict=True
    ):
        if not torch.equal(a, b):
            print(f"{name} differ")
            bad += 1
    for batch in (PROMPTS[:1], PROMPTS[1:2], PROMPTS):
        got, want = ours.encode(batch).prompt_embeds, ref.encode(batch).prompt_embeds
        same = torch.equal(got, want)
        diff = (got.float() - want.float()).abs().max().item()
        print(f"{len(batch)} prompt(s): prompt_embeds {tuple(got.shape)} equal={same} max|diff|={diff:.3g}")
        bad += not same
    print("OK" if not bad else f"{bad} DIFFERENCES")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
