"""Telling a LoRA's layout and family from its keys alone, and refusing what fits no FLUX model of ours.

The layout (`detect`) is read in diffusers' order of checks; a FLUX.3 LoRA of lora_A / lora_B keys is BFL- or
diffusers-named by its module names (`flux3_layout`). `check_family` refuses SD/SDXL LoRAs, adapters other than
plain LoRAs, and LoRAs of another FLUX family, naming a telling key.
"""

from __future__ import annotations

import re

from flux_runtime.weights.keys import strip_prefix
from flux_runtime.weights.lora_common import LoraError
from flux_runtime.weights.lora_layers import FAMILY_NAMES, LayerTable
from flux_runtime.weights.lora_peft import BFL_PREFIXES, PEFT_KEY

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
_BFL_HEADS = (
    "double_blocks.", "single_blocks.", "img_in.", "txt_in.", "time_in.", "vector_in.", "guidance_in.",
    "final_layer.", "double_stream_modulation_", "single_stream_modulation.",
)  # fmt: skip


def detect(keys: list[str]) -> str:
    """`kohya`, `xlabs`, `bfl` or `diffusers`, from the keys alone (in diffusers' order of checks)."""
    if any(k.endswith((".lora_down.weight", ".lora_up.weight")) for k in keys):
        return "kohya"
    if any("processor." in k for k in keys):
        return "xlabs"
    if any(strip_prefix(k, BFL_PREFIXES).startswith(_BFL_HEADS) or "query_norm.scale" in k for k in keys):
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


def flux3_layout(keys: list[str], table: LayerTable, name: str) -> str:
    """`bfl` or `diffusers` for a FLUX.3 LoRA of lora_A / lora_B keys, by which naming its modules are in; with
    neither, diffusers' own rule (a `diffusion_model.` prefix is BFL)."""
    bfl, diffusers = [], []
    for k in keys:
        m = PEFT_KEY.match(strip_prefix(k, BFL_PREFIXES))
        d = PEFT_KEY.match(strip_prefix(k, ("transformer.", *BFL_PREFIXES)))
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
