"""FLUX.2's text conditioning: three hidden states of a chat LLM per token, as diffusers computes them.

`Flux2TextEncoder` (FLUX.2 [dev]: Mistral Small 3.x, `Mistral3ForConditionalGeneration`) reproduces
`Flux2Pipeline.encode_prompt` of diffusers 0.42.1 bit for bit, and `KleinTextEncoder` (FLUX.2 [klein]: Qwen3,
`Qwen3ForCausalLM`) reproduces `Flux2KleinPipeline.encode_prompt`: the same models, the same chat formatting and
tokenizer arguments (`flux_runtime.text.chat`), the attention mask passed to the model, the same hidden states,
casts, repetition and ids. [klein] from safetensors with a `tokenizer.json` folder runs without transformers:
our Qwen3 stack (`qwen3_encoder`, the layers up to 27 only), tokenizer and chat template give the same bits.

The tensors `encode` returns are the contract for the DiT (a caller may build them itself, e.g. from cached
embeddings; they must then follow it exactly):

- `prompt_embeds` `[B * n, L, 3 * H]` in the encoder's dtype, `L = max_sequence_length` (all positions,
  padding included: the DiT sees no mask). Per token, the residual streams after layers 10, 20 and 30
  (Mistral, H = 5120 → 15360) or 9, 18 and 27 (Qwen3, H = 2560 / 4096 → 7680 / 12288) side by side, before
  the final norm (`hidden_states[0]` is the token embedding). Tiny encoders: H = 32 → 96.
- `text_ids` `[B * n, L, 4]` int64, `(t, h, w, l) = (0, 0, 0, l)`: text tokens sit on the fourth RoPE axis.

Row `b * n + j` belongs to prompt `b` (`n = num_images_per_prompt`), as diffusers' `repeat` + `view` orders them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from flux_runtime.registry import MISTRAL_PROCESSOR_ID, MISTRAL_SMALL_ID
from flux_runtime.text.chat import load_mistral_tokenizer, load_qwen3_tokenizer, tokenize_chats
from flux_runtime.text.checks import check_count, check_sequence_length, prompt_list
from flux_runtime.text.fast_tokenizers import FastTokenizer
from flux_runtime.text.llm import StackedLLM
from flux_runtime.text.native_weights import load_native
from flux_runtime.text.qwen3_encoder import Qwen3Encoder
from flux_runtime.text.tiny import TINY_WIDTH
from flux_runtime.text.tokenizers import TINY_TOKENIZERS
from flux_runtime.weights.hub import resolve, safetensors_files

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds (klein need not)
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

# BFL's FLUX.2 [dev] and diffusers' converter pair Mistral Small 3.2's weights with Mistral Small 3.1's processor.
# FLUX.2 is trained with 512 text tokens (BFL's MAX_LENGTH); diffusers' default.
MAX_SEQUENCE_LENGTH = 512
# diffusers' pipelines/flux2/system_messages.py (from BFL's flux2 repo): one newline, no trailing one.
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)
# Flux2KleinPipeline's unconditional prompt for classifier-free guidance.
NEGATIVE_PROMPT = ""


class Flux2TextEmbeddings(NamedTuple):
    """What the FLUX.2 DiT reads from the prompt; unpacks like diffusers' `encode_prompt` result."""

    prompt_embeds: Tensor  # (B * n, L, 3 * H), encoder dtype
    text_ids: Tensor  # (B * n, L, 4) int64, (0, 0, 0, l)


class _StackedStatesEncoder(StackedLLM):
    """The FLUX.2 reading of a chat LLM at three depths, shared by Mistral Small and Qwen3.

    Subclasses name the `layers` read, the model family and classes (`StackedLLM`), and `render` prompts in their
    chat template.
    Inference only: the model is put in eval mode and runs under `torch.no_grad`.
    """

    generation = "FLUX.2"

    @torch.no_grad()
    def encode(
        self,
        prompts: str | list[str],
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
        device: torch.device | str | None = None,
    ) -> Flux2TextEmbeddings:
        """Encode `prompts` as the diffusers pipeline's `encode_prompt(prompt, device, n, max_sequence_length)`.

        Each prompt is wrapped in the chat template, then padded or truncated to `max_sequence_length` tokens
        (1..512); longer chats are cut with a logged warning. The model runs where it sits; the outputs go to
        `device` (default: the model's). Shapes and dtypes: see `Flux2TextEmbeddings` and this module's docstring.
        """
        check_count(num_images_per_prompt, "num_images_per_prompt")
        input_ids, attention_mask = self.tokenize(prompts, max_sequence_length)  # (B, L) each
        device = self.device if device is None else torch.device(device)
        n = num_images_per_prompt

        # (B, L, 3H): the three hidden states side by side per token
        prompt_embeds = self.stacked_states(device, input_ids=input_ids, attention_mask=attention_mask)
        batch, length, _ = prompt_embeds.shape
        prompt_embeds = prompt_embeds.repeat(1, n, 1).view(batch * n, length, -1)  # (B * n, L, 3H)

        text_ids = torch.zeros(batch * n, length, 4, dtype=torch.int64, device=device)
        text_ids[..., 3] = torch.arange(length, device=device)  # (B * n, L, 4): (0, 0, 0, l)
        return Flux2TextEmbeddings(prompt_embeds, text_ids)

    def tokenize(
        self, prompts: str | list[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[Tensor, Tensor]:
        """`(input_ids, attention_mask)` `[B, max_sequence_length]` int64: what the model reads for `prompts`.

        The chat-formatted prompts (`render`) tokenized, padded (mask 0) and truncated as diffusers does, with a
        warning per truncated prompt.
        """
        prompts = prompt_list(prompts, "prompts")
        limit = MAX_SEQUENCE_LENGTH
        check_sequence_length(max_sequence_length, limit, f"FLUX.2 takes at most {limit} text tokens")
        texts = self.render(prompts)
        return tokenize_chats(
            self.tokenizer,
            texts,
            max_sequence_length,
            add_special_tokens=self._add_special_tokens(texts),
            encoder=self.family,
        )

    def render(self, prompts: list[str]) -> list[str]:
        """Each prompt in the encoder's chat template, as text (special tokens written out)."""
        raise NotImplementedError

    def _add_special_tokens(self, texts: list[str]) -> bool:
        """Whether the tokenizer adds its special tokens to the rendered chats; diffusers lets it (the default)."""
        return True


class Flux2TextEncoder(_StackedStatesEncoder):
    """FLUX.2 [dev]'s encoder: Mistral Small 3.x with Mistral Small 3.1's tokenizer and chat template.

    Each prompt (with `[IMG]` removed, as diffusers' `format_input` does) follows FLUX.2's system message in a
    `[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]` chat; hidden states 10, 20 and 30 are stacked. Open one with
    `from_pretrained` (a diffusers FLUX.2 [dev] folder or cached id such as black-forest-labs/FLUX.2-dev:
    `text_encoder/` holds Mistral3ForConditionalGeneration, `tokenizer/` the PixtralProcessor folder),
    `from_components` (model and processor from their own folders or cached ids, as BFL loads them) or `tiny`
    (random, for tests and the demo).
    """

    layers = (10, 20, 30)
    family = "Mistral"
    model_type = "mistral3"
    pipeline = "FLUX.2 [dev]"

    @classmethod
    def model_class(cls) -> type[Mistral3ForConditionalGeneration]:
        from transformers import Mistral3ForConditionalGeneration

        return Mistral3ForConditionalGeneration

    @classmethod
    def from_components(
        cls,
        model: str | Path = MISTRAL_SMALL_ID,
        processor: str | Path = MISTRAL_PROCESSOR_ID,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> Flux2TextEncoder:
        """Open the model and the processor (tokenizer + chat template) from two folders or cached ids.

        The defaults are the pair BFL's reference code loads: Mistral Small 3.2's weights, Mistral Small 3.1's
        processor. Never touches the network.
        """
        return cls._open(resolve(model), resolve(processor), device, dtype)

    @classmethod
    def open_tokenizer(cls, folder: Path) -> tuple[PreTrainedTokenizerBase, str]:
        return load_mistral_tokenizer(folder)

    @classmethod
    def tiny_parts(cls) -> tuple[Mistral3Config, PreTrainedTokenizerBase, str]:
        """A Mistral3 of width 32 (output 3 x 32 = 96 wide, the tiny FLUX.2 DiT's), the shipped tokenizer and
        template."""
        tokenizer, template = load_mistral_tokenizer(TINY_TOKENIZERS / "mistral")
        return tiny_mistral3_config(tokenizer), tokenizer, template

    def render(self, prompts: list[str]) -> list[str]:
        """FLUX.2's system message and each prompt in Mistral's chat template, as diffusers' `format_input` and
        `PixtralProcessor.apply_chat_template` render them: `<s>[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]`."""
        # format_input drops "[IMG]" (the processor would count it as an image placeholder).
        conversations = [
            [
                {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
            ]
            for prompt in prompts
        ]
        return self.tokenizer.apply_chat_template(
            conversations, chat_template=self.chat_template, add_generation_prompt=False, tokenize=False
        )

    def _add_special_tokens(self, texts: list[str]) -> bool:
        # PixtralProcessor.apply_chat_template adds none when the (first) chat already starts with <s>.
        bos = self.tokenizer.bos_token
        return not (bos is not None and texts[0].startswith(bos))


class KleinTextEncoder(_StackedStatesEncoder):
    """FLUX.2 [klein]'s encoder: Qwen3 (4B for klein 4B, 8B for klein 9B) with its tokenizer and chat template.

    Each prompt is one user turn rendered with `add_generation_prompt=True, enable_thinking=False` (no system
    message); hidden states 9, 18 and 27 are stacked. The base (not step-distilled) klein models guide with real
    classifier-free guidance when guidance_scale > 1; their unconditional input is `encode_negative`. Open one
    with `from_pretrained` (a diffusers FLUX.2 [klein] folder or cached id: `text_encoder/` holds
    Qwen3ForCausalLM, `tokenizer/` Qwen2TokenizerFast), `from_components` (a Qwen3 folder or cached id such as
    Qwen/Qwen3-4B) or `tiny` (random, for tests and the demo).

    Opened from files, safetensors weights load into our `Qwen3Encoder` (`load_model`) and a tokenizer folder with
    `tokenizer.json` and a chat template into our `FastTokenizer` (`open_tokenizer`): the same bits as
    transformers' classes, which read anything else (`.bin` weights, a `vocab.json` tokenizer...).
    """

    layers = (9, 18, 27)
    family = "Qwen3"
    model_type = "qwen3"
    pipeline = "FLUX.2 [klein]"

    @classmethod
    def model_class(cls) -> type[Qwen3ForCausalLM]:
        from transformers import Qwen3ForCausalLM

        return Qwen3ForCausalLM

    @classmethod
    def load_model(
        cls, folder: Path, dtype: torch.dtype, device: torch.device | str
    ) -> Qwen3Encoder | PreTrainedModel:
        """Qwen3 of `folder` in `dtype` on `device`: from safetensors our `Qwen3Encoder`, only the layers up to the
        deepest state read (`native_weights.load_native`); from `.bin` files transformers' `Qwen3ForCausalLM`."""
        files = safetensors_files(folder, "model")
        if not files:
            return super().load_model(folder, dtype, device)
        model = load_native(
            "qwen3", folder, files, dtype, device, f"{cls.family} text encoder", max(cls.layers)
        )
        assert isinstance(model, Qwen3Encoder)
        return model

    @classmethod
    def from_components(
        cls,
        model: str | Path,
        tokenizer: str | Path | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> KleinTextEncoder:
        """Open Qwen3 from a folder or cached id (`QWEN3_4B_ID` for klein 4B, `QWEN3_8B_ID` for klein 9B), its
        tokenizer from the same place unless `tokenizer` names another. Never touches the network."""
        model_dir = resolve(model)
        return cls._open(model_dir, model_dir if tokenizer is None else resolve(tokenizer), device, dtype)

    @classmethod
    def open_tokenizer(cls, folder: Path) -> tuple[FastTokenizer | PreTrainedTokenizerBase]:
        return (load_qwen3_tokenizer(folder),)

    @classmethod
    def tiny_parts(cls) -> tuple[Qwen3Config, PreTrainedTokenizerBase]:
        """A Qwen3 of width 32 (output 3 x 32 = 96 wide, the tiny FLUX.2 DiT's) and the shipped tokenizer, both
        transformers' (tests hand them to diffusers as they are)."""
        tokenizer = load_qwen3_tokenizer(TINY_TOKENIZERS / "qwen3", native=False)
        return tiny_qwen3_config(tokenizer), tokenizer

    def encode_negative(
        self,
        num_prompts: int,
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
        device: torch.device | str | None = None,
    ) -> Flux2TextEmbeddings:
        """The unconditional embeddings for `num_prompts` prompts: `NEGATIVE_PROMPT` ("") once per prompt, encoded
        with the same settings, as Flux2KleinPipeline does when guidance_scale > 1 and the model is not
        distilled."""
        check_count(num_prompts, "num_prompts")
        return self.encode(
            [NEGATIVE_PROMPT] * num_prompts,
            max_sequence_length=max_sequence_length,
            num_images_per_prompt=num_images_per_prompt,
            device=device,
        )

    def render(self, prompts: list[str]) -> list[str]:
        """Each prompt as a Qwen3 user turn, then the generation prompt with an empty think block, as
        Flux2KleinPipeline renders it: `<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n<think>…`."""
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            for prompt in prompts
        ]


# --- tiny random encoders ----------------------------------------------------------------------------------


def tiny_mistral3_config(tokenizer: PreTrainedTokenizerBase) -> Mistral3Config:
    """Mistral Small 3.x shrunk to width 32: 31 text layers (so hidden state 30 is a pre-norm residual state, as
    in the 40-layer original), grouped-query attention, no sliding window, untied head; a 1-layer Pixtral
    vision tower (unused by text prompts) with Mistral Small 3.1's projector settings."""
    from transformers import Mistral3Config

    text = {
        "model_type": "mistral",
        "vocab_size": len(tokenizer),
        "hidden_size": TINY_WIDTH,
        "intermediate_size": 2 * TINY_WIDTH,
        "num_hidden_layers": 31,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e9,
        "max_position_embeddings": 131072,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "image_size": 56,
        "patch_size": 14,
    }
    return Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        projector_hidden_act="gelu",
        multimodal_projector_bias=False,
        vision_feature_layer=-1,
    )


def tiny_qwen3_config(tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    """Qwen3 shrunk to width 32: 28 layers (so hidden state 27 is a pre-norm residual state, as in the 36-layer
    originals), grouped-query attention with per-head q/k norms, tied embeddings as Qwen3-4B."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TINY_WIDTH,
        intermediate_size=2 * TINY_WIDTH,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
