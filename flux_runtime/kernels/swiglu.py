"""SwiGLU over FLUX.2's fused feed-forward intermediate: `silu(gate) * up`.

FLUX.2 projects to `[gate | up]` (2 * M wide) in one GEMM (`img_mlp.0`, the MLP part of `linear1`)
and halves it here. Eager runs two ops on views of that GEMM output, each rounding once in the
input dtype: SiLU of the first half, then the product with the second half.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def swiglu_reference(x: Tensor) -> Tensor:
    """`silu(x[..., :M]) * x[..., M:]` for `x` (..., 2M): gate first, as BFL and diffusers store it."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def swiglu(x: Tensor) -> Tensor:
    """SwiGLU; see `swiglu_reference` for the exact semantics."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu: expected an even last dim ([gate | up]), got {x.shape[-1]}")
    return swiglu_reference(x)
