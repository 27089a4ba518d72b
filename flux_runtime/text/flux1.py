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
from flux_runtime.text.clip_encoder import ClipTextEncoder
from flux_runtime.text.fp8 import quantize_text_layers
from flux_runtime.text.hf_weights import load_pretrained
from flux_runtime.text.native_weights import Kind, has_safetensors, load_native
from flux_runtime.text.t5_encoder import T5Encoder
from flux_runtime.text.tiny import init_random, tiny_clip_config, tiny_t5_config
from flux_runtime.text.tokenizers import (
    load_clip_tokenizer,
    load_t5_tokenizer,
    tiny_tokenizer_path,
    tokenize,
    transformers_tokenizers,
)
from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.safetensors_io import check_safetensors_folder

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds
    from transformers import CLIPTextModel, PreTrainedTokenizerBase, T5EncoderModel

logger = logging.getLogger(__name__)

# FLUX.1 was trained with at most 512 T5 tokens; diffusers refuses more.
MAX_SEQUENCE_LENGTH = 512

_DIFFUSERS_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


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
        root = resolve(path_or_id)
        missing = [f"{name}/" for name in _DIFFUSERS_FOLDERS if not (root / name).is_dir()]
        if missing:
            raise WeightsError(
                f"{root} has no {', '.join(missing)}: a diffusers FLUX.1 folder holds text_encoder/, tokenizer/, "
                "text_encoder_2/ and tokenizer_2/ (for separate CLIP-L and T5 folders use "
                "Flux1TextEncoder.from_components)"
            )
        encoder = cls(
            _load_model("clip", root / "text_encoder", dtype, device, "CLIP text encoder"),
            load_clip_tokenizer(root / "tokenizer"),
            _load_model("t5", root / "text_encoder_2", dtype, device, "T5 encoder"),
            load_t5_tokenizer(root / "tokenizer_2"),
        )
        return encoder.to(device)

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
        encoder = cls(
            _load_model("clip", clip_dir, dtype, device, "CLIP text encoder"),
            load_clip_tokenizer(clip_dir),
            _load_model("t5", t5_dir, dtype, device, "T5 encoder"),
            load_t5_tokenizer(t5_dir),
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
        prompts = _prompt_list(prompts, "prompts")
        prompts_2 = prompts if prompts_2 is None else _prompt_list(prompts_2, "prompts_2")
        if len(prompts_2) != len(prompts):
            raise ValueError(f"prompts_2 has {len(prompts_2)} prompts but prompts has {len(prompts)}")
        if not isinstance(max_sequence_length, int) or not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(
                f"max_sequence_length {max_sequence_length!r} is not in 1..{MAX_SEQUENCE_LENGTH} "
                f"(FLUX.1 takes at most {MAX_SEQUENCE_LENGTH} T5 tokens)"
            )
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt {num_images_per_prompt!r} is not a positive integer")
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


def _prompt_list(prompts: str | list[str], name: str) -> list[str]:
    """`prompts` as a non-empty list of strings (a single string is one prompt)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"{name} must be a string or a list of strings, got {prompts!r:.80}")
    if not prompts:
        raise ValueError(f"{name} is empty; give at least one prompt (an empty string is a valid prompt)")
    return list(prompts)


def _load_model(
    kind: Kind, folder: Path, dtype: torch.dtype, device: torch.device | str, what: str
) -> nn.Module:
    """The `kind` encoder of `folder` in `dtype` on `device`, offline, failing on missing files or weights in our
    words. Safetensors weights load into our own modules (`native_weights`: the same bits as transformers',
    without importing it); `.bin` weights through transformers' `from_pretrained`."""
    if not (folder / "config.json").is_file():
        raise WeightsError(f"{folder}: no config.json; expected the {what} (config.json and its weights)")
    if not any((folder / name).is_file() for name in _WEIGHT_FILES):
        raise WeightsError(
            f"{folder}: no weights for the {what} (expected one of {', '.join(_WEIGHT_FILES)})"
        )
    # a damaged config or safetensors file fails here in our words, not inside a loader
    read_json_object(folder / "config.json")
    check_safetensors_folder(folder)
    if kind == "t5" and dtype == torch.float16:
        logger.warning(
            "T5 overflows in float16 (its `wo` layers stay in float32, as transformers keeps them); FLUX.1 uses "
            "bfloat16"
        )
    if has_safetensors(folder):
        return load_native(kind, folder, dtype, device, what)
    from transformers import CLIPTextModel, T5EncoderModel

    # transformers random-initializes weights missing from the checkpoint; for us that is an error.
    cls = CLIPTextModel if kind == "clip" else T5EncoderModel
    model, info = load_pretrained(cls, folder, dtype, device)
    missing = sorted(info["missing_keys"])
    if missing:
        raise WeightsError(
            f"{folder}: the {what} checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}"
        )
    return model
