"""Filling a transformer from a GGUF checkpoint: quantized projections stay quantized (`GgufLinear`).

What diffusers does with the same file (`from_single_file` with a `GGUFQuantizationConfig`), and so
what we do: every weight the file stores in a block-quantized GGML type (Q8_0, Q6_K, ... Q2_K) that
belongs to a projection keeps its blocks on the device and is dequantized (fp16, then the compute dtype)
just before its GEMM; tensors stored in a plain float type (float32, float16 or bfloat16: norm scales, biases,
whatever a quantizer left unquantized) load as plain tensors in the model's dtype. bfloat16 projections are plain
here, where diffusers
dequantizes them before each GEMM: bf16 to fp32 is exact, so the weight it multiplies by is the same.

Merged layers (BFL's fused q/k/v) concatenate the rows of their shards' blocks, which dequantize row by row,
so a checkpoint in diffusers' layout fills the same `GgufLinear`s; its shards must share one GGML type.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch
from torch import Tensor, nn

from flux_runtime.kernels.gguf_dequant import GgmlType, dequantize
from flux_runtime.models.dit.layers import GgufLinear, Linear
from flux_runtime.weights.checks import FiniteCheck
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_layout import Rule
from flux_runtime.weights.gguf_file import GgufSource
from flux_runtime.weights.keys import KeyView

log = logging.getLogger(__name__)

Quantized = tuple[Tensor, GgmlType]  # (uint8 blocks (out, bytes per row), their type)


class GgufWeights:
    """The quantized side of a GGUF checkpoint seen through a loader's reader (a `KeyView` or the source)."""

    def __init__(self, src: GgufSource, name_of: Callable[[str], str]) -> None:
        self.src, self.name_of = src, name_of

    @classmethod
    def of(cls, reader: object) -> GgufWeights | None:
        """The GGUF weights behind `reader`, or None when it reads a safetensors checkpoint."""
        if isinstance(reader, GgufSource):
            return cls(reader, lambda k: k)
        if isinstance(reader, KeyView) and isinstance(reader.src, GgufSource):
            return cls(reader.src, reader.names.__getitem__)
        return None

    def is_quantized(self, keys: tuple[str, ...]) -> bool:
        """True when every shard is block-quantized; a mix with plain shards is an error naming them."""
        flags = [self.src.is_quantized(self.name_of(k)) for k in keys]
        if any(flags) and not all(flags):
            raise WeightsError(
                f"{self.src.path}: {', '.join(keys)} are merged into one layer but only some are quantized"
            )
        return all(flags)

    def stored_type(self, keys: tuple[str, ...]) -> str:
        """The GGML type name of the first shard of one of our tensors (a plain float type or a block type such
        as Q8_0)."""
        return self.src.ggml_type(self.name_of(keys[0])).name

    def read(self, keys: tuple[str, ...], swap_halves: bool, device: torch.device) -> Quantized:
        """The blocks of one of our layers from its shards' rows (halves swapped where the layout says)."""
        names = [self.name_of(k) for k in keys]
        types = {self.src.ggml_type(n).name for n in names}
        if len(types) > 1:
            raise WeightsError(
                f"{self.src.path}: {', '.join(keys)} are merged into one layer but are stored as "
                f"{', '.join(sorted(types))}; one GGML type is needed"
            )
        parts = [self.src.raw(n, device) for n in names]
        raw = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if swap_halves:
            raw = torch.cat(raw.chunk(2, dim=0)[::-1])
        return raw, self.src.ggml_type(names[0])


def precision_of(layers: dict[str, Quantized], plain: Counter[str] | None = None) -> str:
    """`gguf-<type>`: the GGML type that holds most of the quantized projections' weights.

    A GGUF file is known by its quantization (`flux1-dev-Q4_K_S.gguf`), and the quantizers keep a few
    sensitive layers in a wider type, so the dominant type is the name users recognise; the full per-type
    count is logged at load and kept as the model's `gguf_types`. A file with no block-quantized projection (plain
    16-bit floats) is named by the stored type holding most of its projections' weights (`plain`: weights per
    stored type): `gguf-` and GGML's name of that type.
    """
    counts = type_counts(layers) or dict(plain or {})
    return "gguf-" + max(counts, key=counts.__getitem__) if counts else "gguf"


def type_counts(layers: dict[str, Quantized]) -> dict[str, int]:
    """Weights (values, not bytes) per GGML type over the quantized projections."""
    counts: Counter[str] = Counter()
    for raw, qtype in layers.values():
        counts[qtype.name] += raw.shape[0] * raw.shape[1] // qtype.type_size * qtype.block
    return dict(counts.most_common())


def load_state(
    model: nn.Module,
    rules: list[Rule],
    read: Callable[[str], Tensor],
    assemble: Callable[[Rule, Callable[[str], Tensor]], Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    weights: GgufWeights,
    finite: FiniteCheck,
) -> str:
    """Stream every rule's tensor into `model` (built on meta); returns its precision (`precision_of`).

    Quantized weights of projections go into `GgufLinear`s as their blocks, each dequantized once here for
    `finite` (a NaN or infinite scale, or an fp16 overflow, is named at load as in any checkpoint); any other
    quantized tensor (none in the FLUX files seen so far) is dequantized to `dtype` through `read`, as
    diffusers does.
    """
    sd: dict[str, Tensor] = {}
    layers: dict[str, Quantized] = {}
    plain: Counter[str] = Counter()  # the stored types of the projections loaded as plain tensors
    for rule in rules:
        module, _, leaf = rule.bfl.rpartition(".")
        projection = leaf == "weight" and isinstance(model.get_submodule(module), Linear)
        if projection and weights.is_quantized(rule.diffusers):
            raw, qtype = layers[module] = weights.read(rule.diffusers, rule.swap_halves, device)
            finite.watch(rule.bfl, weights.src.path, dequantize(raw, qtype))
            continue
        sd[rule.bfl] = assemble(rule, read)
        if projection:
            plain[weights.stored_type(rule.diffusers)] += sd[rule.bfl].numel()
    _install(model, layers, sd, dtype)
    model.load_state_dict(sd, strict=True, assign=True)
    model.gguf_types = type_counts(layers)
    log.info(
        "%s: %d projections kept quantized (%s)",
        weights.src.path,
        len(layers),
        ", ".join(f"{k} {v:,}" for k, v in model.gguf_types.items()) or "none",
    )
    return precision_of(layers, plain)


def _install(
    model: nn.Module, layers: dict[str, Quantized], sd: dict[str, Tensor], dtype: torch.dtype
) -> None:
    """Swap each named `Linear` for a `GgufLinear` on meta and add its blocks (and bias) to `sd`."""
    for module, (raw, qtype) in layers.items():
        old = model.get_submodule(module)
        with torch.device("meta"):
            new = GgufLinear(old.in_features, old.out_features, old.bias is not None, qtype, dtype)
        if tuple(raw.shape) != tuple(new.qweight.shape):
            raise WeightsError(
                f"{module}.weight: expected shape {(old.out_features, old.in_features)}, "
                f"checkpoint has {qtype.name} blocks of shape {tuple(raw.shape)}"
            )
        parent, _, child = module.rpartition(".")
        model.get_submodule(parent).register_module(child, new)
        sd[f"{module}.qweight"] = raw
