"""The FLUX.2 transformer's diffusers layout, expressed against BFL's flux2 keys (our module names).

One table of `{i}` templates: each BFL key and the diffusers keys it is made of. FLUX.2 has no biases, so every rule is one `.weight` (or QK-norm `.scale`). Only two
rules change a tensor; every other rule is a rename:
- double blocks: BFL fuses `qkv` per stream, diffusers keeps `to_q/to_k/to_v` (image) and
  `add_q_proj/add_k_proj/add_v_proj` (text) apart: concatenate along the output dim (rows [q; k; v]);
- final adaLN: BFL stores `(shift, scale)`, diffusers `(scale, shift)`: swap the two row halves.
Single blocks are fused in both layouts (`linear1` = `to_qkv_mlp_proj`, rows [q; k; v; gate; up];
`linear2` = `to_out`, columns [attn; mlp]), and the SwiGLU `[gate | up]` order is the same in both.
Both directions are pure and lossless.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor

from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.flux1_layout import (
    DOUBLE_NORM_RULES,
    SINGLE_NORM_RULES,
    Rule,
    block_depths,
    expand_rules,
    swap_halves,
)
from flux_runtime.weights.flux1_layout import diffusers_to_bfl as diffusers_to_bfl  # the same fuse and swap
from flux_runtime.weights.flux1_layout import strip_prefix as strip_prefix  # the same BFL prefixes

GLOBAL_RULES: list[Rule] = [
    Rule("img_in.weight", ("x_embedder.weight",)),
    Rule("txt_in.weight", ("context_embedder.weight",)),
    Rule("time_in.in_layer.weight", ("time_guidance_embed.timestep_embedder.linear_1.weight",)),
    Rule("time_in.out_layer.weight", ("time_guidance_embed.timestep_embedder.linear_2.weight",)),
    Rule("double_stream_modulation_img.lin.weight", ("double_stream_modulation_img.linear.weight",)),
    Rule("double_stream_modulation_txt.lin.weight", ("double_stream_modulation_txt.linear.weight",)),
    Rule("single_stream_modulation.lin.weight", ("single_stream_modulation.linear.weight",)),
    Rule("final_layer.linear.weight", ("proj_out.weight",)),
    Rule("final_layer.adaLN_modulation.1.weight", ("norm_out.linear.weight",), swap_halves=True),
]
GUIDANCE_RULES: list[Rule] = [  # [dev] only; [klein] has no guidance embedder
    Rule("guidance_in.in_layer.weight", ("time_guidance_embed.guidance_embedder.linear_1.weight",)),
    Rule("guidance_in.out_layer.weight", ("time_guidance_embed.guidance_embedder.linear_2.weight",)),
]
_D = "transformer_blocks.{i}"
DOUBLE_RULES: list[Rule] = [
    Rule(
        "double_blocks.{i}.img_attn.qkv.weight",
        (f"{_D}.attn.to_q.weight", f"{_D}.attn.to_k.weight", f"{_D}.attn.to_v.weight"),
    ),
    Rule(
        "double_blocks.{i}.txt_attn.qkv.weight",
        (f"{_D}.attn.add_q_proj.weight", f"{_D}.attn.add_k_proj.weight", f"{_D}.attn.add_v_proj.weight"),
    ),
    *DOUBLE_NORM_RULES,
    Rule("double_blocks.{i}.img_attn.proj.weight", (f"{_D}.attn.to_out.0.weight",)),
    Rule("double_blocks.{i}.txt_attn.proj.weight", (f"{_D}.attn.to_add_out.weight",)),
    Rule("double_blocks.{i}.img_mlp.0.weight", (f"{_D}.ff.linear_in.weight",)),
    Rule("double_blocks.{i}.img_mlp.2.weight", (f"{_D}.ff.linear_out.weight",)),
    Rule("double_blocks.{i}.txt_mlp.0.weight", (f"{_D}.ff_context.linear_in.weight",)),
    Rule("double_blocks.{i}.txt_mlp.2.weight", (f"{_D}.ff_context.linear_out.weight",)),
]
_S = "single_transformer_blocks.{i}"
SINGLE_RULES: list[Rule] = [
    Rule("single_blocks.{i}.linear1.weight", (f"{_S}.attn.to_qkv_mlp_proj.weight",)),
    Rule("single_blocks.{i}.linear2.weight", (f"{_S}.attn.to_out.weight",)),
    *SINGLE_NORM_RULES,
]

# Keys that exist in exactly one layout (after stripping a BFL prefix), whatever the depth.
_FLUX2_MARKS = ("double_stream_modulation_img.", "double_stream_modulation_txt.", "single_stream_modulation.")
_BFL_ONLY = (
    *(f"{m}lin." for m in _FLUX2_MARKS),
    *("img_in.", "txt_in.", "time_in.", "guidance_in.", "final_layer.", "double_blocks.", "single_blocks."),
)
_DIFFUSERS_ONLY = (
    *(f"{m}linear." for m in _FLUX2_MARKS),
    *("x_embedder.", "context_embedder.", "time_guidance_embed.", "norm_out.", "proj_out."),
    *("transformer_blocks.", "single_transformer_blocks."),
)


def is_flux2(keys: Iterable[str]) -> bool:
    """True when the keys hold FLUX.2's shared modulation (either layout); FLUX.1 has none."""
    return any(strip_prefix(k).startswith(_FLUX2_MARKS) for k in keys)


def detect_layout(keys: Iterable[str]) -> str:
    """'bfl' or 'diffusers' for a FLUX.2 key set; a file holding names of both is refused."""
    stripped = [strip_prefix(k) for k in keys]
    bfl = [k for k in stripped if k.startswith(_BFL_ONLY)]
    return one_layout("FLUX.2", bfl, [k for k in stripped if k.startswith(_DIFFUSERS_ONLY)])


def one_layout(family: str, bfl: list[str], diffusers: list[str]) -> str:
    """'bfl' or 'diffusers', by which of the two layouts' own keys a `family` checkpoint has; both is an error
    naming the first of each."""
    if bfl and diffusers:
        raise WeightsError(
            f"{family} checkpoint mixes BFL keys ({min(bfl)}, ...) and diffusers keys ({min(diffusers)}, ...)"
        )
    return "bfl" if bfl else "diffusers"


def rules(depth: int, depth_single: int, guidance: bool) -> Iterator[Rule]:
    """All rules for a model of this depth, with `{i}` filled in."""
    yield from expand_rules(
        [*GLOBAL_RULES, *(GUIDANCE_RULES if guidance else ())],
        ((DOUBLE_RULES, depth), (SINGLE_RULES, depth_single)),
    )


def bfl_to_diffusers(rule: Rule, t: Tensor) -> dict[str, Tensor]:
    """Split the BFL tensor of `rule` into its diffusers tensors (q, k, v are equal row blocks)."""
    if rule.swap_halves:
        t = swap_halves(t)
    if len(rule.diffusers) == 1:
        return {rule.diffusers[0]: t}
    parts = t.chunk(len(rule.diffusers), dim=0)
    return {k: p.contiguous() for k, p in zip(rule.diffusers, parts, strict=True)}


def diffusers_depths(keys: Iterable[str]) -> tuple[int, int, bool]:
    """(double blocks, single blocks, guidance embedder present) of a diffusers-layout key set."""
    return block_depths(
        keys, "transformer_blocks", "single_transformer_blocks", "time_guidance_embed.guidance_embedder."
    )


def bfl_depths(keys: Iterable[str]) -> tuple[int, int, bool]:
    """(double blocks, single blocks, guidance embedder present) of a BFL-layout key set (prefix stripped)."""
    return block_depths(keys, "double_blocks", "single_blocks", "guidance_in.")
