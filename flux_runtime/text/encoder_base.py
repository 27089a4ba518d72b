"""What our text encoder modules share with a transformers model that the pipeline reads: `device` and `dtype`."""

from __future__ import annotations

import torch
from torch import nn


class EncoderModule(nn.Module):
    """An `nn.Module` that says where it runs and in what dtype, as transformers' `PreTrainedModel` does."""

    @property
    def device(self) -> torch.device:
        """The device of its first parameter (the whole model sits on one)."""
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its first floating-point parameter (T5 in float16 keeps `wo` in float32: still float16)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())


def embedding(num: int, dim: int) -> nn.Embedding:
    """An `nn.Embedding` whose table is left uninitialized (loading fills it). `nn.Embedding`'s own random
    init on the `meta` device goes through torch's reference ops, whose first use imports `torch._dynamo`:
    1.4 s and more of a fresh process, spent on numbers that are overwritten at once."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
