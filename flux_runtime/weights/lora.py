"""Fusing LoRAs into a loaded FLUX transformer (and CLIP-L), and taking them out again bit for bit.

A layer's update is computed as PEFT's `merge` computes it for diffusers' `fuse_lora`, so the fused
weights are diffusers' bits: lora_A and lora_B cast to the layer's dtype and device, on the CPU a bf16 /
fp16 product taken in fp32 and rounded back, `(B @ A) * scaling` with `scaling = alpha / r * scale`,
added in place (`W += ΔW`; `b += scaling * lora_B.bias`). One diffusers layer is a row block of ours
(q, k, v of a merged qkv): its product is taken on its own, as diffusers takes it, and added to its rows.

Only touched layers are saved, once, before their first change: `unfuse` puts those very tensors back.
FP8 layers are dequantized to bf16, every LoRA fused so far is added to that in order, and the sum is
quantized again (e4m3, one scale per output channel); their saved e4m3 bytes and scales restore them.
A FLUX.1 control LoRA may widen `img_in` (the model's config follows) and replace QK-norm scales.
A GGUF layer's weight is computed from its blocks at every call, so a LoRA cannot add into it: the touched
layer is replaced by a plain one holding its dequantized weight (diffusers' dequantization, in the compute
dtype), and the LoRA is fused there as into any bf16 layer; `unfuse` puts the quantized layer back. Those layers
then take the compute dtype's memory (the others stay quantized).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from flux_runtime.models.dit.layers import Fp8Linear, GgufLinear, Linear
from flux_runtime.weights.fp8 import Fp8Tensors, dequantize, quantize_weight
from flux_runtime.weights.lora_common import Factors, LoraError, LoraWeights
from flux_runtime.weights.lora_layers import Layer, LayerTable, Part

log = logging.getLogger(__name__)

Piece = tuple[Part, Factors, float]  # a diffusers layer's factors inside one of ours, and the user's scale


@dataclass
class FuseReport:
    """What one `fuse` changed: transformer layers, of those FP8 ones requantized, CLIP layers, norms."""

    layers: int
    fp8_layers: int
    text_layers: int
    norms: int
    widened: str | None  # "img_in 64 -> 128" when a control LoRA widened the input
    gguf_layers: int = 0  # of `layers`, GGUF ones replaced by their dequantized weight to fuse into


@dataclass
class FusedState:
    """The originals of every layer the fused LoRAs touched, and what FP8 layers need to be rebuilt."""

    saved: dict[tuple[str, str], dict[str, object]] = field(default_factory=dict)  # (owner, module) → tensors
    fp8_pieces: dict[str, list[Piece]] = field(default_factory=dict)  # FP8 layer → every LoRA's pieces
    config: object | None = None  # the transformer's config before a LoRA widened img_in

    @property
    def empty(self) -> bool:
        return not self.saved


def lora_delta(f: Factors, scale: float, like: Tensor) -> tuple[Tensor, Tensor | None]:
    """`(ΔW, Δb)` of one diffusers layer in `like`'s dtype and device, rounded as PEFT's merge rounds them."""
    dtype, device = like.dtype, like.device
    down, up = f.down.to(device=device, dtype=dtype), f.up.to(device=device, dtype=dtype)
    scaling = f.scaling if scale == 1 else f.scaling * scale
    widen = like.shape[1] - down.shape[1]
    if widen > 0:  # a LoRA for the narrower input of the base model (e.g. on a control model): zero columns
        down = torch.cat([down, down.new_zeros(down.shape[0], widen)], dim=1)
    cast = device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast:
        down, up = down.float(), up.float()
    delta = (up @ down) * scaling
    if cast:
        delta = delta.to(dtype)
    bias = None if f.up_bias is None else f.up_bias.to(device=device, dtype=dtype) * scaling
    return delta, bias


def fuse(
    model: nn.Module,
    table: LayerTable,
    weights: LoraWeights,
    scale: float,
    state: FusedState,
    *,
    text_encoder: nn.Module | None,
    name: str,
) -> FuseReport:
    """Fuse `weights` at `scale` into `model` (and `text_encoder`), saving originals into `state`.

    Every shape is checked before the first weight changes, so a refused LoRA leaves the models as they were.
    """
    by_layer: dict[str, list[Piece]] = {}
    for module, f in weights.transformer.items():
        part = table.parts[module]
        by_layer.setdefault(part.layer.name, []).append((part, f, scale))
    widened = _check_transformer(model, table, by_layer, weights, name)
    text = _check_text(text_encoder, weights, name)

    fp8 = gguf = 0
    for layer_name, pieces in by_layer.items():
        layer = table.layers[layer_name]
        module = model.get_submodule(layer_name)
        if isinstance(module, GgufLinear):
            module = _dequantized(model, layer_name, module, state)
            gguf += 1
        if layer_name == "img_in" and widened is not None:
            module = _widen(model, module, widened[1], state)
        if isinstance(module, Fp8Linear):
            state.fp8_pieces.setdefault(layer_name, []).extend(pieces)
            _rebuild_fp8(module, layer, state)
            fp8 += 1
        else:
            _save(state, "transformer", layer_name, module)
            bias = None if module.bias is None else module.bias.data
            for part, f, s in pieces:
                _add(module.weight.data, bias, layer, part, f, s)
    for module_name, f in weights.text_encoder.items():
        assert text_encoder is not None  # checked
        lin = text_encoder.get_submodule(module_name)
        _save(state, "text_encoder", module_name, lin)
        delta, bias = lora_delta(f, scale, lin.weight)
        lin.weight.data += delta
        if bias is not None:
            lin.bias.data += bias
    for norm, t in weights.norms.items():
        ours = table.norms[norm]
        owner, _, leaf = ours.rpartition(".")
        holder = model.get_submodule(owner)
        key = ("transformer", ours)
        param = getattr(holder, leaf)
        if key not in state.saved:
            state.saved[key] = {"data": param.data}
        param.data = t.to(device=param.device, dtype=param.dtype)
    what = None if widened is None else f"img_in {widened[0]} -> {widened[1]}"
    return FuseReport(len(by_layer), fp8, text, len(weights.norms), what, gguf)


def unfuse(model: nn.Module, text_encoder: nn.Module | None, state: FusedState) -> None:
    """Put back every tensor (and a widened `img_in`, and the config) that `state` saved; empties it."""
    for (owner, name), saved in state.saved.items():
        root = model if owner == "transformer" else text_encoder
        assert root is not None
        if "module" in saved:  # a widened img_in: the original module goes back in
            parent, _, child = name.rpartition(".")
            (root.get_submodule(parent) if parent else root).register_module(child, saved["module"])  # type: ignore[arg-type]
            continue
        if "data" in saved:  # a QK-norm scale
            holder_name, _, leaf = name.rpartition(".")
            getattr(root.get_submodule(holder_name), leaf).data = saved["data"]
            continue
        module = root.get_submodule(name)
        for attr, t in saved.items():
            if isinstance(module, Fp8Linear) and attr in ("weight", "weight_scale"):
                setattr(module, attr, t)
            else:
                getattr(module, attr).data = t
    if state.config is not None:
        model.config = state.config  # type: ignore[assignment]
    state.saved.clear()
    state.fp8_pieces.clear()
    state.config = None


# --------------------------------------------------------------------------------------------------


def _check_transformer(
    model: nn.Module, table: LayerTable, by_layer: dict[str, list[Piece]], weights: LoraWeights, name: str
) -> tuple[int, int] | None:
    """Every piece's shapes against its layer; returns `(old, new)` input widths when img_in must widen."""
    widen = None
    for layer_name, pieces in by_layer.items():
        layer = table.layers[layer_name]
        for part, f, _ in pieces:
            rows, cols = f.up.shape[0], f.down.shape[1]
            if rows != part.rows or (f.up_bias is not None and tuple(f.up_bias.shape) != (rows,)):
                raise LoraError(
                    f"{name}: {layer.parts[part.index]} (our {layer_name}) gets a LoRA update of shape "
                    f"({rows}, {cols}); the model's layer is ({part.rows}, {layer.in_features})"
                )
            if cols != layer.in_features:
                if layer_name != "img_in" or (cols > layer.in_features and table.family != "flux1"):
                    raise LoraError(
                        f"{name}: {layer_name} gets a LoRA update of shape ({rows}, {cols}); the model's "
                        f"layer is ({part.rows}, {layer.in_features})"
                    )
                if cols > layer.in_features:  # a control LoRA widens the input (narrower ones get zeros)
                    widen = (layer.in_features, cols)
            if f.up_bias is not None and model.get_submodule(layer_name).bias is None:
                raise LoraError(f"{name}: {layer_name} has no bias for the LoRA's lora_B.bias")
    for norm, t in weights.norms.items():
        param = model.get_parameter(table.norms[norm])
        if t.shape != param.shape:
            raise LoraError(
                f"{name}: {table.norms[norm]} has shape {tuple(param.shape)}, the LoRA's {tuple(t.shape)}"
            )
    return widen


def _check_text(text_encoder: nn.Module | None, weights: LoraWeights, name: str) -> int:
    for module_name, f in weights.text_encoder.items():
        assert text_encoder is not None  # refused by the conversion
        lin = text_encoder.get_submodule(module_name)
        want = tuple(lin.weight.shape)
        if (f.up.shape[0], f.down.shape[1]) != want:
            raise LoraError(
                f"{name}: text encoder {module_name} gets a LoRA update of shape "
                f"{(f.up.shape[0], f.down.shape[1])}; the layer is {want}"
            )
    return len(weights.text_encoder)


def _save(state: FusedState, owner: str, name: str, module: nn.Module) -> None:
    """Keep a touched layer's tensors (once) and give it fresh copies to add into."""
    key = (owner, name)
    if key in state.saved:
        return
    saved: dict[str, object] = {"weight": module.weight.data}
    module.weight.data = module.weight.data.clone()
    if module.bias is not None:
        saved["bias"] = module.bias.data
        module.bias.data = module.bias.data.clone()
    state.saved[key] = saved


def _add(weight: Tensor, bias: Tensor | None, layer: Layer, part: Part, f: Factors, scale: float) -> None:
    """Add one diffusers layer's update into its rows of our layer (halves swapped back where stored so)."""
    start, rows = layer.offset(part.index), part.rows
    delta, db = lora_delta(f, scale, weight[start : start + rows])
    if layer.swap:
        delta = torch.cat(delta.chunk(2, dim=0)[::-1])
        db = None if db is None else torch.cat(db.chunk(2, dim=0)[::-1])
    weight[start : start + rows] += delta
    if db is not None:
        assert bias is not None  # checked
        bias[start : start + rows] += db


def _dequantized(model: nn.Module, name: str, old: GgufLinear, state: FusedState) -> Linear:
    """A plain layer in place of the GGUF layer `name`: its weight dequantized as every call would (in the
    compute dtype), its bias copied; the GGUF layer kept in `state` to go back in."""
    weight = old.weight
    with torch.device("meta"):
        new = Linear(old.in_features, old.out_features, old.bias is not None)
    new.weight = nn.Parameter(weight, requires_grad=False)
    if old.bias is not None:
        new.bias = nn.Parameter(old.bias.data.clone(), requires_grad=False)
    parent, _, child = name.rpartition(".")
    model.get_submodule(parent).register_module(child, new)
    state.saved[("transformer", name)] = {"module": old}
    return new


def _widen(model: nn.Module, old: nn.Module, width: int, state: FusedState) -> nn.Module:
    """A wider `img_in` (zeros in the new columns, the old weight in the first), as diffusers expands it."""
    weight = old.weight.data
    with torch.device("meta"):
        new = Linear(width, old.out_features, old.bias is not None)
    w = torch.zeros(old.out_features, width, dtype=weight.dtype, device=weight.device)
    w[:, : old.in_features] = weight
    new.weight = nn.Parameter(w, requires_grad=False)
    if old.bias is not None:
        new.bias = nn.Parameter(old.bias.data.clone(), requires_grad=False)
    model.register_module("img_in", new)
    state.saved[("transformer", "img_in")] = {"module": old}
    if state.config is None:
        state.config = model.config
    model.config = dataclasses.replace(model.config, in_channels=width)  # type: ignore[assignment]
    log.info("img_in widened from %d to %d input channels (a control LoRA)", old.in_features, width)
    return new


def _rebuild_fp8(module: Fp8Linear, layer: Layer, state: FusedState) -> None:
    """An FP8 layer from its original e4m3 weight in bf16 plus every fused LoRA in order, requantized."""
    key = ("transformer", layer.name)
    if key not in state.saved:
        state.saved[key] = {"weight": module.weight, "weight_scale": module.weight_scale}
        if module.bias is not None:
            state.saved[key]["bias"] = module.bias.data
    saved = state.saved[key]
    w = dequantize(Fp8Tensors(saved["weight"], saved["weight_scale"], None), module.compute_dtype)  # type: ignore[arg-type]
    bias = None if module.bias is None else saved["bias"].clone()  # type: ignore[union-attr]
    for part, f, s in state.fp8_pieces[layer.name]:
        _add(w, bias, layer, part, f, s)
    q = quantize_weight(w)
    module.weight, module.weight_scale = q.weight, q.weight_scale
    if bias is not None:
        module.bias.data = bias  # type: ignore[union-attr]
