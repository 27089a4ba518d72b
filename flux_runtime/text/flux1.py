"""FLUX.1's text conditioning: CLIP-L's pooled vector and T5-XXL's token embeddings, as diffusers computes them.

`Flux1TextEncoder.encode` reproduces `FluxPipeline.encode_prompt` of diffusers 0.42.1 bit for bit: the same
transformers models and tokenizers, the same tokenizer arguments, no attention mask for either encoder, the
same casts and the same repetition for several images per prompt.

The tensors it returns are the contract for the DiT (a caller may also build them itself, e.g. from cached
embeddings; they must then follow it exactly):

- `prompt_embeds` `[B * n, L, D_t5]` (T5-XXL: 4096; tiny: 32), in the T5's dtype: the T5 encoder's last hidden
  state (after its final RMS norm) at all `L = max_sequence_length` positions, padding positions included.
- `pooled_prompt_embeds` `[B * n, D_clip]` (CLIP-L: 768; tiny: 32), in the CLIP's dtype: CLIP's final-layer-
  norm state at the first `<|endoftext|>`.
- `text_ids` `[L, 3]`: zeros in the CLIP's dtype (text tokens sit at RoPE position 0 on all three axes).

Row `b * n + j` belongs to prompt `b` (`n = num_images_per_prompt`), as diffusers' `repeat` + `view` orders them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

from flux_runtime.registry import CLIP_L_ID, T5_XXL_ID
from flux_runtime.text.checks import check_count, check_sequence_length, prompt_list
from flux_runtime.text.clip_encoder import ClipTextEncoder
from flux_runtime.text.fp8 import quantize_text_layers
from flux_runtime.text.hf_weights import check_model_folder, load_checked, pipeline_root
from flux_runtime.text.native_weights import Kind, load_native
from flux_runtime.text.t5_encoder import T5Encoder
from flux_runtime.text.tiny import init_random, tiny_clip_config, tiny_t5_config
from flux_runtime.text.tokenizers import (
    load_clip_tokenizer,
    load_t5_tokenizer,
    tiny_tokenizer_path,
    tokenize,
    transformers_tokenizers,
)
from flux_runtime.weights.hub import resolve, safetensors_files

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds
    from transformers import CLIPTextModel, PreTrainedTokenizerBase, T5EncoderModel

logger = logging.getLogger(__name__)

# FLUX.1 was trained with at most 512 T5 tokens; diffusers refuses more.
MAX_SEQUENCE_LENGTH = 512

_DIFFUSERS_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")


class Flux1TextEmbeddings(NamedTuple):
    """What the FLUX.1 DiT reads from the prompt; unpacks like diffusers' `encode_prompt` result."""

    prompt_embeds: Tensor  # (B * n, L, D_t5), T5 dtype
    pooled_prompt_embeds: Tensor  # (B * n, D_clip), CLIP dtype
    text_ids: Tensor  # (L, 3) zeros, CLIP dtype


class Flux1TextEncoder:
    """CLIP-L (pooled) and T5-XXL (sequence) with their tokenizers, encoding prompts as diffusers' FluxPipeline.

    Open one with `from_pretrained` (a diffusers FLUX.1 folder or cached id), `from_components` (CLIP-L and
    T5 from their own folders or cached ids, as BFL's code loads them) or `tiny` (random, for tests and the
    demo). Inference only: the models are put in eval mode and run under `torch.no_grad`.
    """

    def __init__(
        self,
        clip: CLIPTextModel,
        clip_tokenizer: PreTrainedTokenizerBase,
        t5: T5EncoderModel,
        t5_tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        # diffusers pads CLIP prompts to the tokenizer's model_max_length (77 for CLIP-L).
        clip_max_length = clip_tokenizer.model_max_length
        positions = clip.config.max_position_embeddings
        if clip_max_length > positions:
            raise ValueError(
                f"the CLIP tokenizer pads to {clip_max_length} tokens but the CLIP model has {positions} positions"
            )
        self.clip = clip.eval()
        self.clip_tokenizer = clip_tokenizer
        self.clip_max_length = clip_max_length
        self.t5 = t5.eval()
        self.t5_tokenizer = t5_tokenizer

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> Flux1TextEncoder:
        """Open the encoders of a diffusers FLUX.1 folder (or a cached id such as black-forest-labs/FLUX.1-dev).

        Reads `text_encoder/` (CLIPTextModel), `tokenizer/` (CLIPTokenizer), `text_encoder_2/` (T5EncoderModel)
        and `tokenizer_2/` (T5TokenizerFast) with the classes FLUX.1's model_index.json names, loads the
        weights in `dtype` (FLUX.1 runs them in bf16) and moves them to `device`. Never touches the network.
        """
        root = pipeline_root(
            path_or_id,
            _DIFFUSERS_FOLDERS,
            "FLUX.1",
            "for separate CLIP-L and T5 folders use Flux1TextEncoder.from_components",
        )
        return cls._open(
            root / "text_encoder",
            root / "tokenizer",
            root / "text_encoder_2",
            root / "tokenizer_2",
            device,
            dtype,
        )

    @classmethod
    def from_components(
        cls,
        clip: str | Path = CLIP_L_ID,
        t5: str | Path = T5_XXL_ID,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> Flux1TextEncoder:
        """Open CLIP-L and T5 from two folders or cached ids, each holding its model and its tokenizer.

        This is how BFL's reference code loads them (`openai/clip-vit-large-patch14`, `google/t5-v1_1-xxl`,
        the defaults); a full CLIPModel or T5ForConditionalGeneration checkpoint works, only the text tower /
        encoder weights are read. Never touches the network.
        """
        clip_dir, t5_dir = resolve(clip), resolve(t5)
        return cls._open(clip_dir, clip_dir, t5_dir, t5_dir, device, dtype)

    @classmethod
    def _open(
        cls,
        clip: Path,
        clip_tokenizer: Path,
        t5: Path,
        t5_tokenizer: Path,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> Flux1TextEncoder:
        """The encoders from their folders in `dtype` on `device` (streamed onto a GPU), the tokenizers from theirs."""
        encoder = cls(
            _load_model("clip", clip, dtype, device, "CLIP text encoder"),
            load_clip_tokenizer(clip_tokenizer),
            _load_model("t5", t5, dtype, device, "T5 encoder"),
            load_t5_tokenizer(t5_tokenizer),
        )
        return encoder.to(device)

    @classmethod
    def tiny(
        cls, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> Flux1TextEncoder:
        """Random CLIP and T5 of width 32 with the tokenizers shipped in the package (no files needed).

        Their outputs fit the tiny DiT preset (`context_in_dim=32`, `vec_in_dim=32`). The same `seed` gives
        the same weights everywhere; the global RNG is left as it was.
        """
        from transformers import CLIPTextModel, T5EncoderModel

        # transformers' models and tokenizers alike: a test hands them to diffusers as they are
        clip_tokenizer, t5_tokenizer = transformers_tokenizers(
            tiny_tokenizer_path("clip"), tiny_tokenizer_path("t5")
        )
        # transformers' initializers draw from the global RNG; fork it so building leaves it untouched.
        with torch.random.fork_rng(devices=[]):
            clip = CLIPTextModel(tiny_clip_config(len(clip_tokenizer)))
            t5 = T5EncoderModel(tiny_t5_config(len(t5_tokenizer)))
        init_random(clip, seed)
        init_random(t5, seed + 1)
        clip.to(dtype=dtype)
        # As from_pretrained in float16 does, T5's `wo` layers (`_keep_in_fp32_modules`) stay in float32.
        keep = set(t5._keep_in_fp32_modules or ()) if dtype == torch.float16 else set()
        for name, param in t5.named_parameters():
            if keep.isdisjoint(name.split(".")):
                param.data = param.data.to(dtype)
        encoder = cls(clip, clip_tokenizer, t5, t5_tokenizer)
        return encoder.to(device)

    @property
    def device(self) -> torch.device:
        """Where the T5 runs (and, unless `encode` is told otherwise, where its outputs go)."""
        return self.t5.device

    def to(self, device: torch.device | str) -> Flux1TextEncoder:
        """Move both encoders to `device` (their dtypes stay) and return self."""
        self.clip.to(device)
        self.t5.to(device)
        return self

    def parts(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """(the models, their repeated layers): what a memory plan moves or streams (CLIP whole, T5's blocks)."""
        return [self.clip, self.t5], list(self.t5.encoder.block)

    def quantize_fp8(self) -> int:
        """T5's projections to FP8 (`flux_runtime.text.fp8`); CLIP is small and stays. Returns how many."""
        return quantize_text_layers(list(self.t5.encoder.block), self.t5.dtype)

    def offload(self) -> Flux1TextEncoder:
        """Move both encoders to the CPU and release cached GPU memory, e.g. once prompts are encoded."""
        self.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self

    @torch.no_grad()
    def encode(
        self,
        prompts: str | list[str],
        *,
        prompts_2: str | list[str] | None = None,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_images_per_prompt: int = 1,
        device: torch.device | str | None = None,
    ) -> Flux1TextEmbeddings:
        """Encode `prompts` as diffusers' `FluxPipeline.encode_prompt(prompt, prompt_2, device, n, ...)`.

        CLIP reads `prompts` (77 tokens); T5 reads `prompts_2` (default: `prompts`), padded or truncated to
        `max_sequence_length` tokens (at most 512; BFL uses 256 for schnell). Longer prompts are cut with a
        logged warning. Each encoder runs where it sits; the outputs go to `device` (default: the T5's).
        Shapes and dtypes: see `Flux1TextEmbeddings` and this module's docstring.
        """
        prompts = prompt_list(prompts, "prompts")
        prompts_2 = prompts if prompts_2 is None else prompt_list(prompts_2, "prompts_2")
        if len(prompts_2) != len(prompts):
            raise ValueError(f"prompts_2 has {len(prompts_2)} prompts but prompts has {len(prompts)}")
        limit = MAX_SEQUENCE_LENGTH
        check_sequence_length(max_sequence_length, limit, f"FLUX.1 takes at most {limit} T5 tokens")
        check_count(num_images_per_prompt, "num_images_per_prompt")
        device = self.device if device is None else torch.device(device)
        batch, n = len(prompts), num_images_per_prompt

        # CLIP-L: pooled state at the first <|endoftext|>; no attention mask (CLIP applies its causal mask)
        clip_ids = tokenize(self.clip_tokenizer, prompts, self.clip_max_length, "CLIP")
        pooled = _clip_pooled(self.clip, clip_ids.to(self.clip.device))
        pooled = pooled.to(dtype=self.clip.dtype, device=device)
        pooled = pooled.repeat(1, n).view(batch * n, -1)  # (B * n, D_clip)

        # T5: every position's last hidden state; no attention mask, so padding attends and is attended to
        t5_ids = tokenize(self.t5_tokenizer, prompts_2, max_sequence_length, "T5")
        prompt_embeds = _t5_states(self.t5, t5_ids.to(self.t5.device))
        prompt_embeds = prompt_embeds.to(dtype=self.t5.dtype, device=device)
        prompt_embeds = prompt_embeds.repeat(1, n, 1).view(
            batch * n, max_sequence_length, -1
        )  # (B * n, L, D_t5)

        text_ids = torch.zeros(max_sequence_length, 3).to(device=device, dtype=self.clip.dtype)  # (L, 3)
        return Flux1TextEmbeddings(prompt_embeds, pooled, text_ids)


def _clip_pooled(clip: nn.Module, ids: Tensor) -> Tensor:
    """CLIP's pooled output: our `ClipTextEncoder` returns it, transformers' model in `.pooler_output`."""
    if isinstance(clip, ClipTextEncoder):
        return clip(ids)
    return clip(ids, output_hidden_states=False).pooler_output


def _t5_states(t5: nn.Module, ids: Tensor) -> Tensor:
    """T5's last hidden state: our `T5Encoder` returns it, transformers' model as its first output."""
    if isinstance(t5, T5Encoder):
        return t5(ids)
    return t5(ids, output_hidden_states=False)[0]


def _load_model(
    kind: Kind, folder: Path, dtype: torch.dtype, device: torch.device | str, what: str
) -> nn.Module:
    """The `kind` encoder of `folder` in `dtype` on `device`, offline, failing on missing files or weights in our
    words. Safetensors weights load into our own modules (`native_weights`: the same bits as transformers',
    without importing it); `.bin` weights through transformers' `from_pretrained` (streamed onto a GPU)."""
    check_model_folder(folder, what)
    if kind == "t5" and dtype == torch.float16:
        logger.warning(
            "T5 overflows in float16 (its `wo` layers stay in float32, as transformers keeps them); FLUX.1 uses "
            "bfloat16"
        )
    files = safetensors_files(folder, "model")
    if files:
        return load_native(kind, folder, files, dtype, device, what)
    from transformers import CLIPTextModel, T5EncoderModel

    return load_checked(CLIPTextModel if kind == "clip" else T5EncoderModel, folder, dtype, device, what)
