"""tanh-approximated GELU over the feed-forward intermediate (fusion F10's activation)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def gelu_tanh_reference(x: Tensor) -> Tensor:
    """`F.gelu(x, approximate="tanh")`: one rounding per element."""
    return F.gelu(x, approximate="tanh")


def gelu_tanh(x: Tensor) -> Tensor:
    """tanh-GELU; see `gelu_tanh_reference`."""
    return gelu_tanh_reference(x)
