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

This module is the entry (`convert`); the file is read by `lora_files`, the layout told by `lora_detect`, and
converted to `lora_common`'s form by the module of its factor names: `lora_kohya` (down / up: kohya, XLabs) or
`lora_peft` (lora_A / lora_B: diffusers / PEFT, BFL-named).
"""

from __future__ import annotations

import logging

from torch import Tensor

from flux_runtime.weights.lora_common import Factors, LoraError, LoraWeights
from flux_runtime.weights.lora_detect import check_family, detect, flux3_layout
from flux_runtime.weights.lora_files import check_lora_file, lora_file, open_lora, read_lora
from flux_runtime.weights.lora_kohya import convert_kohya, convert_xlabs
from flux_runtime.weights.lora_layers import LayerTable
from flux_runtime.weights.lora_peft import convert_bfl, convert_diffusers

__all__ = [
    "Factors",
    "LoraError",
    "LoraWeights",
    "check_family",
    "check_lora_file",
    "convert",
    "detect",
    "lora_file",
    "open_lora",
    "read_lora",
]

log = logging.getLogger(__name__)


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
        kind = flux3_layout(keys, table, name)
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
        out = convert_diffusers(renamed, metadata, table, clip, name, unmatched)
    elif kind == "kohya":
        out = convert_kohya(sd, table, clip, name, unmatched)
    elif kind == "xlabs":
        out = convert_xlabs(sd, table, unmatched)
    elif kind == "bfl":
        out = convert_bfl(sd, table, name, unmatched)
    else:
        out = convert_diffusers(sd, metadata, table, clip, name, unmatched)
    if unmatched:
        shown = ", ".join(unmatched[:3]) + (", ..." if len(unmatched) > 3 else "")
        raise LoraError(
            f"{name}: {len(unmatched)} LoRA key{'s' if len(unmatched) > 1 else ''} match no layer of this "
            f"{table.describe()} ({out.format} layout): {shown}"
        )
    if not (out.transformer or out.norms or out.text_encoder):
        raise LoraError(f"{name}: no LoRA weights found in {len(keys)} keys")
    return out
