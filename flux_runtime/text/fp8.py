"""FP8 text encoders: T5-XXL, Qwen3 and Mistral Small with e4m3 projections, quantized as they load.

Every `nn.Linear` inside the encoder's repeated layers (attention q/k/v/o, the MLP's gate/up/down) becomes
the transformer's own `Fp8Linear`: an e4m3 weight with one scale per output channel (`amax / 448`, as
`flux-convert quantize` and the DiT's `fp8=True` compute them) and activations quantized per token row at
run time. Embeddings, norms, the vision tower and the unused LM head stay in bf16. That halves the largest
encoders (Mistral Small 3.x: 48 → 25 GB) at a small, measured cost in the embeddings the DiT reads:
`embedding_error` gives the cosine similarity and relative error against the bf16 encoder.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from flux_runtime.kernels.fp8 import check_fp8_gemm
from flux_runtime.models.dit.layers import Fp8Linear
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.fp8 import quantize_weight


class Fp8TextLinear(nn.Module):
    """An `Fp8Linear` where a transformers model had an `nn.Linear`.

    `weight` reads as None so transformers' T5 does not cast its feed-forward input to the weight's dtype
    (it does so for a plain `wo` weight of another dtype, and e4m3 would be that dtype); the e4m3 weight
    is `fp8.weight`.
    """

    weight = None

    def __init__(self, fp8: Fp8Linear) -> None:
        super().__init__()
        self.fp8 = fp8

    def forward(self, x: Tensor) -> Tensor:
        return self.fp8(x)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """A transformers model's repeated layers: the children of its largest `nn.ModuleList` (T5's blocks,
    the language model's decoder layers of Qwen3 and Mistral3, not Pixtral's smaller vision layers)."""
    best, best_size = None, 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            size = sum(t.numel() for t in (*m.parameters(), *m.buffers()))  # FP8 weights are buffers
            if size > best_size:
                best, best_size = m, size
    return [] if best is None else list(best)


@torch.no_grad()
def quantize_text_layers(layers: list[nn.Module], dtype: torch.dtype) -> int:
    """Swap every `nn.Linear` in `layers` for an FP8 one (in place, one layer at a time); returns how many."""
    if dtype != torch.bfloat16:
        raise WeightsError(
            f"FP8 text encoders compute in bf16 between their FP8 GEMMs; load them in bf16, not {dtype}"
        )
    count = 0
    for layer in layers:
        for name, module in list(layer.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            reason = check_fp8_gemm(module.weight.device)
            if reason is not None:
                raise WeightsError(f"fp8 text encoders: {reason}; load them without fp8")
            t = quantize_weight(module.weight)
            with torch.device("meta"):
                fp8 = Fp8Linear(
                    module.in_features,
                    module.out_features,
                    module.bias is not None,
                    per_channel=True,
                    dtype=dtype,
                )
            fp8.weight, fp8.weight_scale = t.weight, t.weight_scale
            if module.bias is not None:
                fp8.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
            parent, _, child = name.rpartition(".")
            (layer.get_submodule(parent) if parent else layer).register_module(child, Fp8TextLinear(fp8))
            count += 1
    return count


class EmbeddingError(NamedTuple):
    """How far FP8 embeddings are from bf16 ones: mean and worst per-token cosine, relative L2 error."""

    cosine: float
    min_cosine: float
    rel_error: float


def embedding_error(reference: Tensor, other: Tensor) -> EmbeddingError:
    """Compare (..., D) embeddings row by row in fp32: cosine similarity per token, and
    `||other - reference|| / ||reference||` over all of them."""
    if reference.shape != other.shape:
        raise ValueError(f"embeddings differ in shape: {tuple(reference.shape)} vs {tuple(other.shape)}")
    a, b = reference.float().flatten(0, -2), other.float().flatten(0, -2)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    rel = (b - a).norm() / a.norm().clamp(min=1e-30)
    return EmbeddingError(float(cos.mean()), float(cos.min()), float(rel))
