"""A tiny random FLUX.3 prompt upsampler folder (Qwen3.5, the package's tiny Qwen tokenizer, a Qwen-style chat
template) and the text-only processor diffusers' upsampler step is handed in the tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2TokenizerFast, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from flux_runtime.text.tiny import init_random
from flux_runtime.text.tokenizers import TINY_TOKENIZERS

# Qwen's ChatML with content parts, the generation prompt and the closed thinking block of enable_thinking=False.
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def diffusers_prompts() -> dict[str, str]:
    """The system prompts and edit scaffold of diffusers' FLUX.3 upsampler step, as a prompts file holds them."""
    from diffusers.modular_pipelines.flux3 import prompt_upsampler as pu

    return {
        "t2i": pu.SYSTEM_PROMPTS["t2i"],
        "i2i": pu.SYSTEM_PROMPTS["i2i"],
        "i2i_scaffold": pu.I2I_SCAFFOLD[False],
    }


def make_tiny_upsampler(folder: Path, seed: int = 0, prompts: dict[str, str] | None = None) -> Path:
    """A random Qwen3.5 of width 32 (three linear-attention layers and one full one) saved with its tokenizer,
    chat template, system prompts and a generation config whose stop tokens (a tenth of the vocabulary, drawn with
    `seed`) end a greedy caption after a few tokens."""
    tokenizer = Qwen2TokenizerFast.from_pretrained(TINY_TOKENIZERS / "qwen3", local_files_only=True)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 0, 0]},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, max_position_embeddings=8192,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    init_random(model, seed)
    gen = torch.Generator().manual_seed(seed)
    stops = torch.randperm(len(tokenizer), generator=gen)[: len(tokenizer) // 10].tolist()
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "system_prompts.json").write_text(json.dumps(prompts or diffusers_prompts()))
    return folder


def text_only_processor(folder: Path):
    """A Qwen3VLProcessor with only the folder's tokenizer and chat template (its image and video processors need
    torchvision): what diffusers' upsampler step calls `apply_chat_template` and `decode` on for a text request."""
    from transformers import AutoTokenizer, Qwen3VLProcessor

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    processor.chat_template = (folder / "chat_template.jinja").read_text()
    return processor
