"""A chat LLM read at several depths: what the FLUX.2 and FLUX.3 text encoders share past tokenization.

Subclasses name the hidden-state `layers` they stack, the model `family`, the FLUX `generation` (for messages),
the diffusers `pipeline` whose folder `from_pretrained` opens, the transformers `model_class()`, how the model
(`load_model`) and the tokenizer folder (`open_tokenizer`) are read, and add their own chat template, tokenization
and `encode`. The model is a transformers one or our own `Qwen3Encoder` (FLUX.2 [klein] from safetensors), which
runs only the layers read. Inference only: the model is put in eval mode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from flux_runtime.text.fast_tokenizers import FastTokenizer
from flux_runtime.text.fp8 import decoder_layers, quantize_text_layers
from flux_runtime.text.hf_weights import check_model_folder, load_checked, pipeline_root
from flux_runtime.text.qwen3_encoder import Qwen3Encoder
from flux_runtime.text.tiny import init_random

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_LLM = TypeVar("_LLM", bound="StackedLLM")
_Placed = TypeVar("_Placed", bound="PlacedModel")


class PlacedModel:
    """A model (`model`: transformers', or ours with the same `device`) that moves as a whole: `device`, `to`,
    `offload`."""

    model: PreTrainedModel | Qwen3Encoder

    @property
    def device(self) -> torch.device:
        """Where the model runs (and, unless `encode` is told otherwise, where its outputs go)."""
        return self.model.device

    def to(self: _Placed, device: torch.device | str) -> _Placed:
        """Move the model to `device` (its dtype stays) and return self."""
        self.model.to(device)
        return self

    def offload(self: _Placed) -> _Placed:
        """Move the model to the CPU and release cached GPU memory, e.g. once prompts are encoded."""
        self.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self


class StackedLLM(PlacedModel):
    """The model and tokenizer, opening them, the depth check, the stacked hidden states, placement (`to`,
    `offload`, `parts`) and FP8 quantization."""

    layers: ClassVar[tuple[int, ...]]
    family: ClassVar[str]  # the encoder, for messages
    generation: ClassVar[str]  # "FLUX.2" or "FLUX.3", for messages
    model_type: ClassVar[str]  # config.json's model_type of the checkpoint we read
    pipeline: ClassVar[str]  # the diffusers pipeline's model, for messages ("FLUX.2 [dev]")

    def __init__(
        self,
        model: PreTrainedModel | Qwen3Encoder,
        tokenizer: PreTrainedTokenizerBase | FastTokenizer,
        chat_template: str | None = None,
    ) -> None:
        """`model`: transformers' or our `Qwen3Encoder` (built at least `max(layers)` deep); `tokenizer`:
        transformers' or our `FastTokenizer`; `chat_template`: what prompts are rendered with (a processor's);
        None renders with the tokenizer's."""
        depth = text_config(model).num_hidden_layers
        if depth < max(self.layers):
            layers = ", ".join(map(str, self.layers))
            raise ValueError(
                f"the {self.family} model has {depth} layers; {self.generation} reads hidden states {layers}"
            )
        if isinstance(model, Qwen3Encoder) and model.depth < max(self.layers):
            raise ValueError(
                f"the {self.family} encoder runs {model.depth} layers; it must run {max(self.layers)}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def model_class(cls) -> type[PreTrainedModel]:
        """The transformers class of the model (imported here, on first use: importing transformers takes
        seconds)."""
        raise NotImplementedError

    @classmethod
    def from_pretrained(
        cls: type[_LLM],
        path_or_id: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> _LLM:
        """Open `text_encoder/` (the model) and `tokenizer/` of a diffusers folder or cached id of this encoder's
        pipeline (the class says which), weights in `dtype` (FLUX runs them in bf16), on `device`. Never touches
        the network."""
        alternative = f"for the model and tokenizer in their own folders use {cls.__name__}.from_components"
        root = pipeline_root(path_or_id, ("text_encoder", "tokenizer"), cls.pipeline, alternative)
        return cls._open(root / "text_encoder", root / "tokenizer", device, dtype)

    @classmethod
    def _open(
        cls: type[_LLM], model: Path, tokenizer: Path, device: torch.device | str, dtype: torch.dtype
    ) -> _LLM:
        """The model from folder `model` in `dtype` on `device`, the tokenizer (and template) from `tokenizer`."""
        check_llm_folder(model, cls)  # before reading anything large
        text = cls.open_tokenizer(tokenizer)
        return cls(cls.load_model(model, dtype, device), *text).to(device)

    @classmethod
    def load_model(
        cls, folder: Path, dtype: torch.dtype, device: torch.device | str
    ) -> PreTrainedModel | Qwen3Encoder:
        """The model of `folder` (checked by `check_llm_folder`) in `dtype` on `device`: transformers'
        `model_class()` with every weight required (`load_checked`)."""
        return load_checked(cls.model_class(), folder, dtype, device, cls.family)

    @classmethod
    def open_tokenizer(cls, folder: Path) -> tuple[Any, ...]:
        """What the constructor takes after the model, read from `folder`: the tokenizer (and chat template)."""
        raise NotImplementedError

    @classmethod
    def tiny(
        cls: type[_LLM], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> _LLM:
        """A random model of width 32 with the tokenizer (and template) shipped in the package (no files needed),
        whose output fits the generation's tiny DiT preset (`tiny_parts`). The same `seed` gives the same weights
        everywhere; the global RNG is left as it was."""
        config, *text = cls.tiny_parts()
        return cls(tiny_model(cls.model_class(), config, seed, dtype), *text).to(device)

    @classmethod
    def tiny_parts(cls) -> tuple[Any, ...]:
        """The tiny model's config, then what the constructor takes after the model (the shipped tokenizer...)."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype, which is also `prompt_embeds`' dtype."""
        return self.model.dtype

    @property
    def output_dim(self) -> int:
        """Width of `prompt_embeds` (layers x hidden size): the DiT's `context_in_dim` must equal it."""
        return len(self.layers) * text_config(self.model).hidden_size

    def stacked_states(self, device: torch.device, **inputs: Tensor) -> Tensor:
        """(B, L, len(layers) * H): the model run on `inputs` (moved to where it sits), its hidden states `layers`
        side by side per token, padding included, in its dtype on `device`."""
        inputs = {name: t.to(self.device) for name, t in inputs.items()}
        if isinstance(self.model, Qwen3Encoder):  # ours: only the layers read, the same bits
            hidden = self.model(inputs["input_ids"], inputs.get("attention_mask"), self.layers)
        else:
            output = self.model(**inputs, output_hidden_states=True, use_cache=False)
            # hidden_states[k]: the residual stream after k decoder layers (0: embeddings), padding included
            hidden = [output.hidden_states[k] for k in self.layers]
        states = torch.stack(hidden, dim=1)  # (B, n, L, H)
        states = states.to(dtype=self.dtype, device=device)
        batch, count, length, width = states.shape
        return states.permute(0, 2, 1, 3).reshape(batch, length, count * width)

    def parts(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """(the model, its decoder layers): what a memory plan moves or streams."""
        return [self.model], decoder_layers(self.model)

    def quantize_fp8(self) -> int:
        """The decoder layers' projections to FP8 (`flux_runtime.text.fp8`). Returns how many."""
        return quantize_text_layers(decoder_layers(self.model), self.dtype)


def text_config(model: nn.Module) -> Any:
    """The config that gives a model's language width and depth (`hidden_size`, `num_hidden_layers`): a
    transformers multimodal model's text config, else the model's own (ours: the checkpoint's)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_llm_folder(folder: Path, reader: Any) -> None:
    """Fail in our words unless `folder` holds a config.json of `reader`'s `model_type` and weights (`reader`: an
    encoder or model class with `family` and `model_type`)."""
    what, family = f"{reader.family} text encoder", reader.family
    check_model_folder(folder, what, reader.model_type, f"{reader.__name__} reads {family}")


def tiny_model(
    build: Callable[[Any], PreTrainedModel], config: Any, seed: int, dtype: torch.dtype
) -> PreTrainedModel:
    """`build(config)` with seeded random weights (`init_random`; the global RNG is left as it was), cast to `dtype`
    as `from_pretrained(dtype=...)` loads them: the RoPE `inv_freq` buffers stay float32 as there
    (`model.to(dtype)` would round them and change every rotary angle)."""
    # transformers' initializers draw from the global RNG; fork it so building leaves it untouched.
    with torch.random.fork_rng(devices=[]):
        model = build(config)
    init_random(model, seed)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model
