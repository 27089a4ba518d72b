"""LoRAs of PEFT's lora_A / lora_B names in the common form: diffusers / PEFT ones, and BFL-named ones (ai-toolkit,
fal, BFL's own, BFL's FLUX.1 control LoRAs). What each layout means is written out in `lora_formats`."""

from __future__ import annotations

import math
import re

from torch import Tensor

from flux_runtime.weights.flux1_layout import swap_halves
from flux_runtime.weights.keys import strip_prefix
from flux_runtime.weights.lora_common import Factors, LoraError, LoraWeights, check_pair, no_text_encoder
from flux_runtime.weights.lora_layers import LayerTable

# The prefixes a LoRA's BFL-named keys may carry (fal's `base_model.model.`, ComfyUI's, ai-toolkit's).
BFL_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.")
# PEFT's names for one layer's tensors, after the module name (BFL-named and diffusers LoRAs alike).
PEFT_KEY = re.compile(r"^(.+)\.(lora_A\.weight|lora_B\.weight|lora_B\.bias|alpha)$")


def convert_bfl(sd: dict[str, Tensor], table: LayerTable, name: str, unmatched: list[str]) -> LoraWeights:
    """BFL module names with PEFT's lora_A / lora_B: a merged layer's lora_A is shared by its parts and its
    lora_B (and bias) split by rows. FLUX.1's final-adaLN lora_B is swapped into diffusers' half order
    (in a control LoRA lora_A's rows too, as diffusers does); diffusers maps FLUX.2's as it stands, and so
    does this; FLUX.3's is swapped as FLUX.1's (diffusers drops it). `alpha` tensors scale by alpha / rank."""
    out = LoraWeights("bfl")
    control = table.family == "flux1" and any("query_norm.scale" in k for k in sd)
    groups: dict[str, dict[str, Tensor]] = {}
    norm_of = {bfl: d for d, bfl in table.norms.items()}
    for key, t in sd.items():
        k = strip_prefix(key, BFL_PREFIXES)
        if k in norm_of:
            out.norms[norm_of[k]] = t
            continue
        m = PEFT_KEY.match(k)
        if m is None or m.group(1) not in table.layers:
            unmatched.append(key)
            continue
        groups.setdefault(m.group(1), {})[m.group(2)] = t
    for module, g in groups.items():
        layer = table.layers[module]
        if "lora_A.weight" not in g or "lora_B.weight" not in g:
            unmatched.append(f"{module} (lora_A and lora_B are not both there)")
            continue
        down, up, bias = g["lora_A.weight"], g["lora_B.weight"], g.get("lora_B.bias")
        rank = check_pair(down, up, module, name)
        scaling: float | Tensor = 1.0 if "alpha" not in g else g["alpha"] / rank
        if layer.swap and table.family in ("flux1", "flux3"):
            up, bias = swap_halves(up), None if bias is None else swap_halves(bias)
            if control:  # diffusers' control-LoRA converter swaps lora_A's (rank) row halves as well
                down = swap_halves(down)
        if len(layer.parts) == 1:
            out.transformer[layer.parts[0]] = Factors(down, up, bias, scaling)
            continue
        if up.shape[0] != layer.out_features:
            raise LoraError(
                f"{name}: {module}.lora_B has {up.shape[0]} rows; the model's layer has {layer.out_features}"
            )
        ups = up.split(list(layer.sizes), dim=0)
        biases = [None] * len(ups) if bias is None else bias.split(list(layer.sizes), dim=0)
        for p, u, b in zip(layer.parts, ups, biases, strict=True):
            out.transformer[p] = Factors(down, u, b, scaling)
    if out.norms or any(f.up_bias is not None for f in out.transformer.values()):
        out.format = "bfl-control"
    return out


def convert_diffusers(
    sd: dict[str, Tensor],
    metadata: dict | None,
    table: LayerTable,
    clip: set[str] | None,
    name: str,
    unmatched: list[str],
) -> LoraWeights:
    """diffusers / PEFT names, with or without the `transformer.` prefix; `text_encoder.` is CLIP-L."""
    out = LoraWeights("diffusers")
    groups: dict[str, dict[str, dict[str, Tensor]]] = {"transformer": {}, "text_encoder": {}}
    alphas: dict[str, dict[str, Tensor]] = {"transformer": {}, "text_encoder": {}}
    for key, t in sd.items():
        owner, k = "transformer", strip_prefix(key, ("transformer.", *BFL_PREFIXES))
        if key.startswith("text_encoder."):
            owner, k = "text_encoder", key.removeprefix("text_encoder.")
        elif key.startswith("text_encoder_2."):
            raise LoraError(f"{name}: T5 text-encoder LoRA weights ({key}) are not supported; only CLIP-L's")
        m = PEFT_KEY.match(k)
        if m is None:
            unmatched.append(key)
        elif m.group(2) == "alpha":
            alphas[owner][m.group(1)] = t
        else:
            groups[owner].setdefault(m.group(1), {})[m.group(2)] = t
    if groups["text_encoder"] and clip is None:
        raise no_text_encoder(name, next(iter(groups["text_encoder"])))
    for owner, known in (("transformer", set(table.parts)), ("text_encoder", clip or set())):
        config = _adapter_config(metadata, owner, name)
        target = out.transformer if owner == "transformer" else out.text_encoder
        first_alpha = next(iter(alphas[owner].values()), None)
        for module, g in groups[owner].items():
            if module not in known or "lora_A.weight" not in g or "lora_B.weight" not in g:
                unmatched.append(f"{owner}.{module}")
                continue
            down, up = g["lora_A.weight"], g["lora_B.weight"]
            rank = check_pair(down, up, module, name)
            if config is not None:
                scaling = _config_scaling(config, module, rank, name)
            elif first_alpha is not None:
                # PEFT's alpha_pattern: a layer's own alpha where it differs from the first one, else the first
                own = alphas[owner].get(module)
                alpha = own if own is not None and bool(own != first_alpha) else first_alpha
                scaling = alpha / rank
            else:
                scaling = 1.0
            target[module] = Factors(down, up, g.get("lora_B.bias"), scaling)
    return out


def _adapter_config(metadata: dict | None, owner: str, name: str) -> dict | None:
    if not metadata:
        return None
    config = {k.removeprefix(f"{owner}."): v for k, v in metadata.items() if k.startswith(f"{owner}.")}
    if not config:
        return None
    if config.get("use_dora"):
        raise LoraError(f"{name} is a DoRA adapter (use_dora in its metadata); only plain LoRAs can be fused")
    if not isinstance(config.get("r"), int):
        raise LoraError(f"{name}: its lora_adapter_metadata gives no integer {owner}.r")
    return config


def _pattern(patterns: dict, module: str, default: object) -> object:
    """PEFT's pattern lookup: the first pattern matching the end of the module's name, else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _config_scaling(config: dict, module: str, rank: int, name: str) -> float:
    r = _pattern(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", r))
    if r != rank:
        raise LoraError(f"{name}: {module} has rank {rank}, its metadata says {r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError(f"{name}: its metadata gives {module} the lora_alpha {alpha!r}, not a number")
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
