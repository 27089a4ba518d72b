"""A tiny random FLUX.3 prompt upsampler folder (Qwen3.5 with a tiny vision tower, the package's tiny Qwen tokenizer
with Qwen's vision tokens added, a Qwen-style chat template, image and video processor configs) and the processors
diffusers' upsampler step is handed in the tests: text only, or with a PIL image processor (no torchvision)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2TokenizerFast, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from flux_runtime.text.tiny import init_random
from flux_runtime.text.tokenizers import TINY_TOKENIZERS

# Qwen's ChatML with content parts (an image part is Qwen's vision placeholder), the generation prompt and the closed
# thinking block of enable_thinking=False.
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
# The processors' sizes: few patches (16 px, merged 2x2) per image, so the tiny vision tower is quick.
PROCESSOR_SIZES = dict(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
)


def diffusers_prompts() -> dict[str, str]:
    """The system prompts, scaffolds and layout request of diffusers' FLUX.3 upsampler step, as a prompts file holds
    them (the layout request read off `format_layout_request` with the slots as its arguments)."""
    from diffusers.modular_pipelines.flux3 import prompt_upsampler as pu

    layout = pu.format_layout_request("{prompt}", [])
    assert layout.endswith("[]")
    return {
        "t2i": pu.SYSTEM_PROMPTS["t2i"],
        "i2i": pu.SYSTEM_PROMPTS["i2i"],
        "i2i_scaffold": pu.I2I_SCAFFOLD[False],
        "t2i_bbox": pu.SYSTEM_PROMPTS["t2i_bbox"],
        "i2i_bbox": pu.SYSTEM_PROMPTS["i2i_bbox"],
        "i2i_bbox_scaffold": pu.I2I_SCAFFOLD[True],
        "layout_request": layout[: -len("[]")] + "{boxes}",
    }


def make_tiny_upsampler(folder: Path, seed: int = 0, prompts: dict[str, str] | None = None) -> Path:
    """A random Qwen3.5 of width 32 (three linear-attention layers and one full one, a one-block vision tower) saved
    with its tokenizer, chat template, image and video processor configs, system prompts and a generation config
    whose stop tokens (a tenth of the vocabulary, drawn with `seed`) end a greedy caption after a few tokens."""
    tokenizer = Qwen2TokenizerFast.from_pretrained(TINY_TOKENIZERS / "qwen3", local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS.values())})
    token_ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in VISION_TOKENS.items()}
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
        config = Qwen3_5Config(text_config=text, vision_config=vision, **token_ids)
        model = Qwen3_5ForConditionalGeneration(config)
    init_random(model, seed)
    gen = torch.Generator().manual_seed(seed)
    stops = torch.randperm(len(tokenizer), generator=gen)[: len(tokenizer) // 10].tolist()
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    # image_processor_type names the torchvision processor; transformers opens the PIL one where that is absent
    _pil_image_processor().save_pretrained(folder)
    video = {"video_processor_type": "Qwen3VLVideoProcessor", **PROCESSOR_SIZES}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    (folder / "system_prompts.json").write_text(json.dumps(prompts or diffusers_prompts()))
    return folder


def text_only_processor(folder: Path):
    """A Qwen3VLProcessor with only the folder's tokenizer and chat template (its image and video processors need
    torchvision): what diffusers' upsampler step calls `apply_chat_template` and `decode` on for a text request."""
    return qwen3_vl_processor(_tokenizer(folder), (folder / "chat_template.jinja").read_text())


def _pil_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**PROCESSOR_SIZES)


def image_processor(folder: Path):
    """A Qwen3VLProcessor of the folder's tokenizer and chat template with the PIL image processor and no video
    processor: one that takes images without torchvision (`AutoProcessor` opens the video processor too, which needs
    it). What both diffusers' upsampler step and ours are handed in the tests of edit requests."""
    return qwen3_vl_processor(
        _tokenizer(folder), (folder / "chat_template.jinja").read_text(), _pil_image_processor()
    )


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def qwen3_vl_processor(tokenizer, chat_template: str, image_processor=None):
    """A Qwen3VLProcessor without a video processor, and without an image processor unless one is given, built
    through its constructor (which sets what `__call__` reads: the vision tokens, since transformers 5.25)."""
    from transformers import Qwen3VLProcessor

    class PartialProcessor(Qwen3VLProcessor):
        # an absent image or video processor passes the check of the processors' classes
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name in ("image_processor", "video_processor") and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return PartialProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=chat_template,
    )
