"""LoRAs of down / up factor names in the common form: kohya / sd-scripts ones (ComfyUI's spelling too), and
XLabs'. What each layout means is written out in `lora_formats`."""

from __future__ import annotations

import logging
import re

import torch
from torch import Tensor

from flux_runtime.weights.flux1_layout import swap_halves
from flux_runtime.weights.lora_common import Factors, LoraError, LoraWeights, check_pair, no_text_encoder
from flux_runtime.weights.lora_layers import Layer, LayerTable

log = logging.getLogger(__name__)

_KOHYA_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".alpha")


def convert_kohya(
    sd: dict[str, Tensor], table: LayerTable, clip: set[str] | None, name: str, unmatched: list[str]
) -> LoraWeights:
    """sd-scripts names in diffusers' layers (keys that land nowhere are added to `unmatched`)."""
    groups, others = _kohya_groups(sd)
    out = LoraWeights("kohya")
    clip_names = {m.replace(".", "_"): m for m in clip or ()}
    t5: list[str] = []
    for lora, g in groups.items():
        if "lora_down.weight" not in g or "lora_up.weight" not in g:
            unmatched.append(f"{lora} (a lone {next(iter(g))})")
            continue
        down, up, alpha = g["lora_down.weight"], g["lora_up.weight"], g.get("alpha")
        check_pair(down, up, lora, name)
        if lora.startswith("lora_unet_") and lora[10:] in table.underscored:
            layer = table.layers[table.underscored[lora[10:]]]
            out.transformer.update(_kohya_layer(layer, down, up, alpha, table.family))
        elif lora.startswith("lora_transformer_") and lora[17:] in table.underscored_parts:
            # diffusers module names, underscored: the alpha as a tensor for every layer
            out.transformer[table.underscored_parts[lora[17:]]] = _scaled(down, up, alpha, as_tensor=True)
        elif lora.startswith(("lora_te_", "lora_te1_")):
            module = clip_names.get(lora.split("_", 2)[2] if lora.startswith("lora_te1_") else lora[8:])
            if clip is None:
                raise no_text_encoder(name, lora)
            if module is None:
                unmatched.append(lora)
                continue
            # kohya's text-encoder factors: scaled only where an alpha is given, alpha as a float
            out.text_encoder[module] = (
                Factors(down, up) if alpha is None else _scaled(down, up, alpha, as_tensor=False)
            )
        elif lora.startswith("lora_te2_"):
            t5.append(lora)
        else:
            unmatched.append(lora)
    _refuse_nonzero(t5, groups, name, "T5 text-encoder LoRA weights (only CLIP-L's can be fused)")
    for key in others:
        if bool((sd[key] == 0).all()):
            log.info("%s: %s is all zeros (no effect); skipped", name, key)
        else:
            unmatched.append(key)
    return out


def _kohya_groups(sd: dict[str, Tensor]) -> tuple[dict[str, dict[str, Tensor]], list[str]]:
    """`{lora name: {"lora_down.weight", "lora_up.weight", "alpha"}}` in sd-scripts' underscored names;
    ComfyUI's dotted spelling (`diffusion_model.`, `text_encoders.clip_l.transformer.`) is renamed first.
    Keys of another kind (full-weight `.diff`, `.diff_b`) come back apart."""
    groups: dict[str, dict[str, Tensor]] = {}
    others = []
    for key, t in sd.items():
        k = key
        for old, new in (
            ("model.diffusion_model.", "lora_unet_"), ("diffusion_model.", "lora_unet_"),
            ("text_encoders.clip_l.transformer.", "lora_te_"), ("text_encoders.t5xxl.transformer.", "lora_te2_"),
        ):  # fmt: skip
            if k.startswith(old):
                k = new + k[len(old) :]
                break
        suffix = next((s for s in _KOHYA_SUFFIXES if k.endswith(s)), None)
        if suffix is None:
            others.append(key)
            continue
        groups.setdefault(k[: -len(suffix)].replace(".", "_"), {})[suffix[1:]] = t
    return groups, others


def _refuse_nonzero(loras: list[str], groups: dict[str, dict[str, Tensor]], name: str, what: str) -> None:
    live = [n for n in loras if any(bool((t != 0).any()) for t in groups[n].values() if t.ndim)]
    if live:
        raise LoraError(f"{name}: {len(live)} {what}, e.g. {live[0]}, are not supported")
    if loras:
        log.info("%s: %d all-zero T5 LoRA layers skipped (no effect)", name, len(loras))


def _split_scale(scale: float | Tensor) -> tuple[float | Tensor, float | Tensor]:
    """kohya's alpha/rank spread over both factors: `(down, up)` with down * up == scale, down >= up / 2."""
    down, up = scale, 1.0
    while down * 2 < up:
        down = down * 2
        up = up / 2
    return down, up


def _scaled(down: Tensor, up: Tensor, alpha: Tensor | None, *, as_tensor: bool) -> Factors:
    """Factors with kohya's alpha/rank baked in; alpha as a 0-dim tensor (its dtype) or a Python float."""
    rank = down.shape[0]
    a = alpha if alpha is not None else torch.tensor(rank, dtype=down.dtype)
    scale_down, scale_up = _split_scale(a / rank if as_tensor else a.item() / rank)
    return Factors(down * scale_down, up * scale_up)


def _kohya_layer(
    layer: Layer, down: Tensor, up: Tensor, alpha: Tensor | None, family: str
) -> dict[str, Factors]:
    """One sd-scripts layer in diffusers' layers."""
    if len(layer.parts) == 1:
        if family == "flux1" and layer.name.startswith("final_layer."):
            f = Factors(down, up)  # diffusers leaves FLUX.1's final layer unscaled (its alpha unread)
        else:
            f = _scaled(down, up, alpha, as_tensor=False)
        if layer.swap:
            f.up = swap_halves(f.up)
        return {layer.parts[0]: f}
    # merged q/k/v(/mlp): alpha stays a tensor; a block-diagonal up (one rank slice per part) is split
    # into its blocks, any other up shares the whole down
    f = _scaled(down, up, alpha, as_tensor=True)
    down, up, n, sizes = f.down, f.up, len(layer.parts), layer.sizes
    rank = down.shape[0]
    sparse = False
    if rank % n == 0:
        r = rank // n
        starts = [layer.offset(j) for j in range(n)]
        sparse = all(
            bool(torch.all(up[starts[j] : starts[j] + sizes[j], k * r : (k + 1) * r] == 0))
            for j in range(n)
            for k in range(n)
            if j != k
        )
    if not sparse:
        return {p: Factors(down, u) for p, u in zip(layer.parts, up.split(list(sizes), dim=0), strict=True)}
    downs = down.chunk(n, dim=0)
    return {
        p: Factors(
            downs[j], up[layer.offset(j) : layer.offset(j) + sizes[j], j * r : (j + 1) * r].contiguous()
        )
        for j, p in enumerate(layer.parts)
    }


_XLABS = re.compile(
    r"^(?:diffusion_model\.)?(double|single)_blocks\.(\d+)\.processor\."
    r"(proj_lora1|proj_lora2|qkv_lora1|qkv_lora2|proj_lora|qkv_lora)\.(down|up)\.weight$"
)
_XLABS_LAYERS = {
    ("double", "proj_lora1"): "img_attn.proj", ("double", "proj_lora2"): "txt_attn.proj",
    ("double", "qkv_lora1"): "img_attn.qkv", ("double", "qkv_lora2"): "txt_attn.qkv",
    ("single", "proj_lora"): "linear2", ("single", "qkv_lora"): "linear1",
}  # fmt: skip


def convert_xlabs(sd: dict[str, Tensor], table: LayerTable, unmatched: list[str]) -> LoraWeights:
    """XLabs' attention-processor LoRAs: unscaled; a qkv lora's up splits in three equal row blocks
    (a single block's covers only q, k, v of linear1)."""
    out = LoraWeights("xlabs")
    pairs: dict[tuple[str, str], dict[str, Tensor]] = {}
    for key, t in sd.items():
        m = _XLABS.match(key)
        if m is None:
            unmatched.append(key)
            continue
        kind, i, proc, which = m.groups()
        module = f"{kind}_blocks.{i}.{_XLABS_LAYERS[(kind, proc)]}"
        pairs.setdefault((module, key.rsplit(".", 2)[0]), {})[which] = t
    for (module, base), g in pairs.items():
        layer = table.layers.get(module)
        if layer is None or set(g) != {"down", "up"}:
            unmatched.append(base)
            continue
        down, up = g["down"], g["up"]
        if len(layer.parts) == 1:
            out.transformer[layer.parts[0]] = Factors(down, up)
            continue
        ups = up.split(up.shape[0] // 3, dim=0) if up.shape[0] % 3 == 0 else (up,)
        for p, u in zip(layer.parts[:3], ups, strict=False):
            out.transformer[p] = Factors(down, u)
    return out
