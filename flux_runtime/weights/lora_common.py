"""The common form every LoRA layout is converted to (`LoraWeights`), and what the layouts' converters share.

`lora_formats` says what each layout means; the converters (`lora_kohya`, `lora_peft`) build on this module
alone, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from flux_runtime.weights.errors import WeightsError


class LoraError(WeightsError):
    """A LoRA file that cannot be read, is of another model, or does not fit this one."""


@dataclass
class Factors:
    """One low-rank update `scaling * (up @ down)` (+ `scaling * up_bias`) of one diffusers layer.

    `down` (r, in) and `up` (out, r) in the file's dtype, after the layout's own conversion; `scaling` is
    PEFT's `alpha / r` for that layer (a Python float, or a 0-dim tensor when the alpha came as one).
    """

    down: Tensor
    up: Tensor
    up_bias: Tensor | None = None
    scaling: float | Tensor = 1.0


@dataclass
class LoraWeights:
    """A LoRA file in the common form: diffusers layer names → factors, plus what is not low-rank."""

    format: str  # diffusers, kohya, xlabs, bfl, bfl-control
    transformer: dict[str, Factors] = field(default_factory=dict)
    norms: dict[str, Tensor] = field(default_factory=dict)  # diffusers QK-norm weights, replaced outright
    text_encoder: dict[str, Factors] = field(default_factory=dict)  # CLIP-L module names


def check_pair(down: Tensor, up: Tensor, key: str, name: str) -> int:
    """The rank of a down/up pair, checked: down (r, in), up (out, r)."""
    if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
        raise LoraError(
            f"{name}: {key} has down {tuple(down.shape)} and up {tuple(up.shape)}; expected (r, in) and (out, r)"
        )
    return down.shape[0]


def no_text_encoder(name: str, key: str) -> LoraError:
    """The refusal of text-encoder LoRA weights (`key`) for a pipeline without CLIP-L."""
    return LoraError(
        f"{name} holds text-encoder LoRA weights ({key}); only FLUX.1's CLIP-L takes LoRAs and this "
        "pipeline has none: use a LoRA of the transformer alone"
    )
