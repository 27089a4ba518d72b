"""A chat LLM read at several depths: what the FLUX.2 and FLUX.3 text encoders share past tokenization.

Subclasses name the hidden-state `layers` they stack, the model `family` and the FLUX `generation` (for
messages), and add their own chat template, tokenization and `encode`. Inference only: the model is put
in eval mode.
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flux_runtime.text.fp8 import decoder_layers, quantize_text_layers

_LLM = TypeVar("_LLM", bound="StackedLLM")


class StackedLLM:
    """The model and tokenizer, the depth check, placement (`to`, `offload`, `parts`) and FP8 quantization."""

    layers: ClassVar[tuple[int, ...]]
    family: ClassVar[str]  # the encoder, for messages
    generation: ClassVar[str]  # "FLUX.2" or "FLUX.3", for messages
    model_type: ClassVar[str]  # config.json's model_type of the checkpoint we read

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        depth = model.config.get_text_config().num_hidden_layers
        if depth < max(self.layers):
            layers = ", ".join(map(str, self.layers))
            raise ValueError(
                f"the {self.family} model has {depth} layers; {self.generation} reads hidden states {layers}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer

    @property
    def device(self) -> torch.device:
        """Where the model runs (and, unless `encode` is told otherwise, where its outputs go)."""
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype, which is also `prompt_embeds`' dtype."""
        return self.model.dtype

    @property
    def output_dim(self) -> int:
        """Width of `prompt_embeds` (layers x hidden size): the DiT's `context_in_dim` must equal it."""
        return len(self.layers) * self.model.config.get_text_config().hidden_size

    def to(self: _LLM, device: torch.device | str) -> _LLM:
        """Move the model to `device` (its dtype stays) and return self."""
        self.model.to(device)
        return self

    def parts(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """(the model, its decoder layers): what a memory plan moves or streams."""
        return [self.model], decoder_layers(self.model)

    def quantize_fp8(self) -> int:
        """The decoder layers' projections to FP8 (`flux_runtime.text.fp8`). Returns how many."""
        return quantize_text_layers(decoder_layers(self.model), self.dtype)

    def offload(self: _LLM) -> _LLM:
        """Move the model to the CPU and release cached GPU memory, e.g. once prompts are encoded."""
        self.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self
