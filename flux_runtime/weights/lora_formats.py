"""LoRA files for FLUX: the layout told from the keys, and what each layout means, in one common form.

The common form (`LoraWeights`) names diffusers' layers, as diffusers 0.42.1 converts each layout, so a
file means here exactly what `load_lora_weights` makes of it; `LayerTable` then places each diffusers
layer in the rows of one of our (BFL-named) projections. Layouts, each detected from its keys:

- diffusers / PEFT: `[transformer.]<diffusers module>.lora_A.weight` / `.lora_B.weight` (`lora_B.bias`),
  optional `<module>.alpha` tensors or a `lora_adapter_metadata` header (r, lora_alpha, patterns, rsLoRA);
  scaling `alpha / r` per module, as PEFT sets it; `text_encoder.*` keys are CLIP-L's.
- kohya / sd-scripts (and ComfyUI's `diffusion_model.` spelling of it): `lora_unet_<bfl_module>.lora_down /
  .lora_up / .alpha` with "_" for "."; the alpha/rank scale is baked into the factors, split between down
  and up so neither underflows. Merged layers (qkv, linear1) read alpha as a tensor in the file's dtype, the
  others as a Python float; FLUX.1's final layer is left unscaled; `lora_te1_*` / `lora_te_*` are CLIP-L's,
  `lora_transformer_*` names diffusers' modules the same way.
- XLabs: `double_blocks.N.processor.{qkv,proj}_lora{1,2}.{down,up}.weight`, no alpha.
- BFL-named (ai-toolkit, fal, BFL's own): `[diffusion_model.|base_model.model.]<bfl module>.lora_A/B`; a
  merged layer's lora_A is shared by its parts, lora_B split by rows. BFL's FLUX.1 Depth/Canny control
  LoRAs add `lora_B.bias`, full QK-norm scales, and an `img_in` lora_A twice as wide as the model's input.

FLUX.3 (module names in both namings kept apart, q, k, v never merged): diffusers / PEFT names, and BFL names
(`diffusion_model.<bfl module>.lora_A/B`, as diffusers' FLUX.3 loader converts a `diffusion_model.` file); the
two are told apart by the module names themselves, since `txt_mode_blocks.N` starts both. diffusers renames
only the blocks' projections of a BFL file and drops its other layers with a warning; here every BFL name is
one of our modules, so they are fused where they belong (the final adaLN's halves swapped into diffusers'
order, as for FLUX.1). kohya names (`lora_unet_<bfl module>`), which diffusers does not read for FLUX.3, mean
what sd-scripts makes them mean for FLUX.2: alpha / rank baked into the factors.

Only the tensors are trusted, never the file name. Every key must land somewhere: a key that matches no
layer, a T5 or DoRA weight, an SD/SDXL or other-family LoRA is an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_layout import swap_halves
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.lora_layers import FAMILY_NAMES, Layer, LayerTable
from flux_runtime.weights.safetensors_io import read_header

log = logging.getLogger(__name__)


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


# --------------------------------------------------------------------------------------------------
# reading


def lora_file(path_or_id: str | Path) -> Path:
    """The file of a LoRA given as a .safetensors path, a folder holding one, or a Hugging Face id in the
    local cache (`pytorch_lora_weights.safetensors` where a folder holds several)."""
    try:
        path = resolve(path_or_id)
    except WeightsError as e:
        raise LoraError(f"LoRA {e}") from None
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        named = path / "pytorch_lora_weights.safetensors"
        if named.is_file():
            files = [named]
        if len(files) != 1:
            found = ", ".join(f.name for f in files) if files else "none"
            raise LoraError(f"{path_or_id}: give the LoRA file itself; this folder holds {found}")
        path = files[0]
    return path.resolve()


def check_lora_file(path_or_id: str | Path) -> Path:
    """`lora_file`, its safetensors header read and checked (no tensor data): what a command checks before it
    loads a model, so a missing or damaged LoRA fails first."""
    path = lora_file(path_or_id)
    try:
        read_header(path)
    except WeightsError as e:
        raise LoraError(f"{e}; LoRAs are read from .safetensors") from None
    return path


def open_lora(path_or_id: str | Path) -> tuple[Path, bytes, str]:
    """(the file, its bytes, their sha256) of a LoRA (`lora_file`)."""
    path = lora_file(path_or_id)
    data = path.read_bytes()
    return path, data, hashlib.sha256(data).hexdigest()


def read_lora(data: bytes, name: str) -> tuple[dict[str, Tensor], dict | None]:
    """The tensors of a safetensors LoRA (CPU, the file's dtypes, keys sorted) and its PEFT metadata."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        sd = load(data)
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
    except (SafetensorError, struct.error, ValueError) as e:
        raise LoraError(f"{name}: not a safetensors file ({e}); LoRAs are read from .safetensors") from None
    sd = {k: sd[k] for k in sorted(sd)}
    if not sd:
        raise LoraError(f"{name}: the file holds no tensors")
    for k, t in sd.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise LoraError(f"{name}: {k} holds NaN or infinite values; the file is damaged")
    raw = (header.get("__metadata__") or {}).get("lora_adapter_metadata")
    try:
        metadata = json.loads(raw) if raw else None
    except ValueError:
        raise LoraError(f"{name}: its lora_adapter_metadata header is not valid JSON") from None
    return sd, metadata if isinstance(metadata, dict) else None


# --------------------------------------------------------------------------------------------------
# detection

_SD_MARKS = (
    "lora_unet_down_blocks", "lora_unet_up_blocks", "lora_unet_mid_block", "lora_unet_input_blocks",
    "lora_unet_output_blocks", "lora_unet_middle_block", "unet.", "down_blocks.", "input_blocks.",
)  # fmt: skip
_FLUX2_MARKS = re.compile(
    r"stream_modulation|to_qkv_mlp_proj|time_guidance_embed|ff(_context)?[._]linear_(in|out)"
)
_FLUX1_MARKS = re.compile(
    r"(img|txt)_mod[._]lin|single_blocks[._]\d+[._]modulation|vector_in|time_text_embed|norm1[._](linear|context)"
    r"|proj_mlp|ff(_context)?[._]net[._]|processor\."
)
_FLUX3_MARKS = re.compile(
    r"stream_modulations[._]|mode_blocks[._]|emb_in[._]|x_embedders[._]|single_transformer_blocks[._]\d+[._]ff[._]"
    r"|blocks[._]\d+[._]([qkv]_proj|attn_out|mlp_in|mlp_out)([._]|$)"
)
_FLUX2_ONLY_MARKS = re.compile(r"stream_modulation[._]|to_qkv_mlp_proj|time_guidance_embed|ff_context")
# FLUX.1 and FLUX.2 alike (double blocks, one image embedder), none of it FLUX.3
_FLUX12_MARKS = re.compile(
    r"double_blocks|(^|\.|lora_transformer_)transformer_blocks[._]\d|x_embedder[._]|img_in[._]"
)
# the keys that tell a LoRA of another family, checked in this order (FLUX.3 first: its diffusers `ff.linear_in`
# is FLUX.2's name too)
_OTHER_FAMILIES = {
    "flux1": ((_FLUX3_MARKS, "FLUX.3"), (_FLUX2_MARKS, "FLUX.2")),
    "flux2": ((_FLUX3_MARKS, "FLUX.3"), (_FLUX1_MARKS, "FLUX.1")),
    "flux3": ((_FLUX1_MARKS, "FLUX.1"), (_FLUX2_ONLY_MARKS, "FLUX.2"), (_FLUX12_MARKS, "FLUX.1 / FLUX.2")),
}
_UNSUPPORTED = {"dora_scale": "DoRA", "lora_magnitude_vector": "DoRA", "lokr_": "LoKr", "hada_": "LoHa"}
_BFL_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.")
_BFL_HEADS = (
    "double_blocks.", "single_blocks.", "img_in.", "txt_in.", "time_in.", "vector_in.", "guidance_in.",
    "final_layer.", "double_stream_modulation_", "single_stream_modulation.",
)  # fmt: skip


def _strip(key: str, prefixes: tuple[str, ...]) -> str:
    for p in prefixes:
        if key.startswith(p):
            return key[len(p) :]
    return key


def detect(keys: list[str]) -> str:
    """`kohya`, `xlabs`, `bfl` or `diffusers`, from the keys alone (in diffusers' order of checks)."""
    if any(k.endswith((".lora_down.weight", ".lora_up.weight")) for k in keys):
        return "kohya"
    if any("processor." in k for k in keys):
        return "xlabs"
    if any(_strip(k, _BFL_PREFIXES).startswith(_BFL_HEADS) or "query_norm.scale" in k for k in keys):
        return "bfl"
    return "diffusers"


def check_family(keys: list[str], table: LayerTable, name: str) -> None:
    """Refuse an SD/SDXL LoRA, and a LoRA of another FLUX family (FLUX.1, FLUX.2, FLUX.3), naming a telling key."""
    for k in keys:
        if k.startswith(_SD_MARKS) or k.startswith("lora_te2_text_model"):
            raise LoraError(
                f"{name} is a Stable Diffusion / SDXL LoRA (keys like {k}); it does not fit a FLUX model"
            )
        for mark, what in _UNSUPPORTED.items():
            if mark in k:
                raise LoraError(f"{name} is a {what} adapter ({k}); only plain LoRAs can be fused")
    for marks, other in _OTHER_FAMILIES[table.family]:
        hit = next((k for k in keys if marks.search(k)), None)
        if hit is not None:
            mine = FAMILY_NAMES[table.family]
            raise LoraError(f"{name} is a {other} LoRA (keys like {hit}); this pipeline runs {mine}")


def _flux3_layout(keys: list[str], table: LayerTable, name: str) -> str:
    """`bfl` or `diffusers` for a FLUX.3 LoRA of lora_A / lora_B keys, by which naming its modules are in; with
    neither, diffusers' own rule (a `diffusion_model.` prefix is BFL)."""
    bfl, diffusers = [], []
    for k in keys:
        m = _PEFT_KEY.match(_strip(k, _BFL_PREFIXES))
        d = _PEFT_KEY.match(_strip(k, ("transformer.", *_BFL_PREFIXES)))
        if m is not None and m.group(1) in table.layers:
            bfl.append(k)
        elif d is not None and d.group(1) in table.parts:
            diffusers.append(k)
    if bfl and diffusers:
        raise LoraError(
            f"{name} mixes BFL module names ({bfl[0]}) and diffusers ones ({diffusers[0]}); "
            "a FLUX.3 LoRA names its layers one way"
        )
    if bfl or diffusers:
        return "bfl" if bfl else "diffusers"
    return "bfl" if any(k.startswith("diffusion_model.") for k in keys) else "diffusers"


# --------------------------------------------------------------------------------------------------
# conversion


def convert(
    sd: dict[str, Tensor], metadata: dict | None, table: LayerTable, clip: set[str] | None, name: str
) -> LoraWeights:
    """The common form of a LoRA file read by `read_lora`, for the model `table` describes.

    `clip`: the CLIP-L text encoder's Linear module names (None when the pipeline has none).
    """
    keys = list(sd)
    check_family(keys, table, name)
    kind = detect(keys)
    if table.family == "flux3" and kind in ("bfl", "diffusers"):
        kind = _flux3_layout(keys, table, name)
    unmatched: list[str] = []
    if kind == "kohya" and any(k.startswith("transformer.") for k in keys):
        # a diffusers file written with kohya's down/up names; its other keys are not read
        rest = [k for k in keys if not k.startswith("transformer.")]
        if rest:
            log.warning("%s: %d keys outside transformer.* are not read, e.g. %s", name, len(rest), rest[0])
        renamed = {
            k.replace("lora_down.weight", "lora_A.weight").replace("lora_up.weight", "lora_B.weight"): v
            for k, v in sd.items()
            if k.startswith("transformer.")
        }
        out = _diffusers(renamed, metadata, table, clip, name, unmatched)
    elif kind == "kohya":
        out = _kohya(sd, table, clip, name, unmatched)
    elif kind == "xlabs":
        out = _xlabs(sd, table, unmatched)
    elif kind == "bfl":
        out = _bfl(sd, table, name, unmatched)
    else:
        out = _diffusers(sd, metadata, table, clip, name, unmatched)
    if unmatched:
        shown = ", ".join(unmatched[:3]) + (", ..." if len(unmatched) > 3 else "")
        raise LoraError(
            f"{name}: {len(unmatched)} LoRA key{'s' if len(unmatched) > 1 else ''} match no layer of this "
            f"{table.describe()} ({out.format} layout): {shown}"
        )
    if not (out.transformer or out.norms or out.text_encoder):
        raise LoraError(f"{name}: no LoRA weights found in {len(keys)} keys")
    return out


def _pair(down: Tensor, up: Tensor, key: str, name: str) -> int:
    """The rank of a down/up pair, checked: down (r, in), up (out, r)."""
    if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
        raise LoraError(
            f"{name}: {key} has down {tuple(down.shape)} and up {tuple(up.shape)}; expected (r, in) and (out, r)"
        )
    return down.shape[0]


def _split_scale(scale: float | Tensor) -> tuple[float | Tensor, float | Tensor]:
    """kohya's alpha/rank spread over both factors: `(down, up)` with down * up == scale, down >= up / 2."""
    down, up = scale, 1.0
    while down * 2 < up:
        down = down * 2
        up = up / 2
    return down, up


# ---- kohya / sd-scripts ----------------------------------------------------------------------------

_KOHYA_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".alpha")


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


def _kohya(
    sd: dict[str, Tensor], table: LayerTable, clip: set[str] | None, name: str, unmatched: list[str]
) -> LoraWeights:
    groups, others = _kohya_groups(sd)
    out = LoraWeights("kohya")
    clip_names = {m.replace(".", "_"): m for m in clip or ()}
    t5: list[str] = []
    for lora, g in groups.items():
        if "lora_down.weight" not in g or "lora_up.weight" not in g:
            unmatched.append(f"{lora} (a lone {next(iter(g))})")
            continue
        down, up, alpha = g["lora_down.weight"], g["lora_up.weight"], g.get("alpha")
        _pair(down, up, lora, name)
        if lora.startswith("lora_unet_") and lora[10:] in table.underscored:
            layer = table.layers[table.underscored[lora[10:]]]
            out.transformer.update(_kohya_layer(layer, down, up, alpha, table.family))
        elif lora.startswith("lora_transformer_") and lora[17:] in table.underscored_parts:
            # diffusers module names, underscored: the alpha as a tensor for every layer
            out.transformer[table.underscored_parts[lora[17:]]] = _scaled(down, up, alpha, as_tensor=True)
        elif lora.startswith(("lora_te_", "lora_te1_")):
            module = clip_names.get(lora.split("_", 2)[2] if lora.startswith("lora_te1_") else lora[8:])
            if clip is None:
                raise LoraError(
                    f"{name} holds text-encoder LoRA weights ({lora}); only FLUX.1's CLIP-L takes LoRAs and this "
                    "pipeline has none: use a LoRA of the transformer alone"
                )
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


def _refuse_nonzero(loras: list[str], groups: dict[str, dict[str, Tensor]], name: str, what: str) -> None:
    live = [n for n in loras if any(bool((t != 0).any()) for t in groups[n].values() if t.ndim)]
    if live:
        raise LoraError(f"{name}: {len(live)} {what}, e.g. {live[0]}, are not supported")
    if loras:
        log.info("%s: %d all-zero T5 LoRA layers skipped (no effect)", name, len(loras))


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


# ---- XLabs -------------------------------------------------------------------------------------------

_XLABS = re.compile(
    r"^(?:diffusion_model\.)?(double|single)_blocks\.(\d+)\.processor\."
    r"(proj_lora1|proj_lora2|qkv_lora1|qkv_lora2|proj_lora|qkv_lora)\.(down|up)\.weight$"
)
_XLABS_LAYERS = {
    ("double", "proj_lora1"): "img_attn.proj", ("double", "proj_lora2"): "txt_attn.proj",
    ("double", "qkv_lora1"): "img_attn.qkv", ("double", "qkv_lora2"): "txt_attn.qkv",
    ("single", "proj_lora"): "linear2", ("single", "qkv_lora"): "linear1",
}  # fmt: skip


def _xlabs(sd: dict[str, Tensor], table: LayerTable, unmatched: list[str]) -> LoraWeights:
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


# ---- BFL-named (ai-toolkit, fal, BFL control) ---------------------------------------------------------

_BFL_KEY = re.compile(r"^(.+)\.(lora_A\.weight|lora_B\.weight|lora_B\.bias|alpha)$")


def _bfl(sd: dict[str, Tensor], table: LayerTable, name: str, unmatched: list[str]) -> LoraWeights:
    """BFL module names with PEFT's lora_A / lora_B: a merged layer's lora_A is shared by its parts and its
    lora_B (and bias) split by rows. FLUX.1's final-adaLN lora_B is swapped into diffusers' half order
    (in a control LoRA lora_A's rows too, as diffusers does); diffusers maps FLUX.2's as it stands, and so
    does this; FLUX.3's is swapped as FLUX.1's (diffusers drops it). `alpha` tensors scale by alpha / rank."""
    out = LoraWeights("bfl")
    control = table.family == "flux1" and any("query_norm.scale" in k for k in sd)
    groups: dict[str, dict[str, Tensor]] = {}
    norm_of = {bfl: d for d, bfl in table.norms.items()}
    for key, t in sd.items():
        k = _strip(key, _BFL_PREFIXES)
        if k in norm_of:
            out.norms[norm_of[k]] = t
            continue
        m = _BFL_KEY.match(k)
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
        rank = _pair(down, up, module, name)
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


# ---- diffusers / PEFT -----------------------------------------------------------------------------------

_PEFT_KEY = re.compile(r"^(.+)\.(lora_A\.weight|lora_B\.weight|lora_B\.bias|alpha)$")


def _diffusers(
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
        owner, k = "transformer", _strip(key, ("transformer.", *_BFL_PREFIXES))
        if key.startswith("text_encoder."):
            owner, k = "text_encoder", key.removeprefix("text_encoder.")
        elif key.startswith("text_encoder_2."):
            raise LoraError(f"{name}: T5 text-encoder LoRA weights ({key}) are not supported; only CLIP-L's")
        m = _PEFT_KEY.match(k)
        if m is None:
            unmatched.append(key)
        elif m.group(2) == "alpha":
            alphas[owner][m.group(1)] = t
        else:
            groups[owner].setdefault(m.group(1), {})[m.group(2)] = t
    if groups["text_encoder"] and clip is None:
        first = next(iter(groups["text_encoder"]))
        raise LoraError(
            f"{name} holds text-encoder LoRA weights ({first}); only FLUX.1's CLIP-L takes LoRAs and this "
            "pipeline has none: use a LoRA of the transformer alone"
        )
    for owner, known in (("transformer", set(table.parts)), ("text_encoder", clip or set())):
        config = _adapter_config(metadata, owner, name)
        target = out.transformer if owner == "transformer" else out.text_encoder
        first_alpha = next(iter(alphas[owner].values()), None)
        for module, g in groups[owner].items():
            if module not in known or "lora_A.weight" not in g or "lora_B.weight" not in g:
                unmatched.append(f"{owner}.{module}")
                continue
            down, up = g["lora_A.weight"], g["lora_B.weight"]
            rank = _pair(down, up, module, name)
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
