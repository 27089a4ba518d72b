"""The FLUX.3 transformer's diffusers layout, expressed against BFL's FLUX.3 keys (our module names).

One table of `{i}` / `{m}` templates: each BFL key and the diffusers key it is. FLUX.3 has no biases and keeps
q, k, v apart in both layouts, so every rule is a rename of one `.weight` (or QK-norm `.scale`) but one:
- final adaLN: BFL stores `(shift, scale)`, diffusers `(scale, shift)`: swap the two row halves.
BFL files may also hold `repa_projectors.*` (heads used only in training): they are no part of the model and
are skipped by name. Both directions are pure and lossless.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from flux_runtime.weights.flux1_layout import Rule, block_depths
from flux_runtime.weights.flux2_layout import bfl_to_diffusers, diffusers_to_bfl, one_layout, strip_prefix

__all__ = [
    "TRAINING_ONLY",
    "bfl_depths",
    "bfl_to_diffusers",
    "detect_layout",
    "diffusers_depths",
    "diffusers_to_bfl",
    "is_flux3",
    "rules",
    "training_only",
]

MODES = ("image", "image_cond")
TRAINING_ONLY = "repa_projectors."  # BFL keys of training-only heads, skipped on load

GLOBAL_RULES: list[Rule] = [
    *(Rule(f"emb_in.{m}.weight", (f"x_embedders.{m}.weight",)) for m in MODES),
    Rule("txt_in.weight", ("context_embedder.weight",)),
    Rule("time_in.in_layer.weight", ("timestep_embedder.linear_1.weight",)),
    Rule("time_in.out_layer.weight", ("timestep_embedder.linear_2.weight",)),
    *(
        Rule(f"{kind}_stream_modulations.{m}.lin.weight", (f"{kind}_stream_modulations.{m}.linear.weight",))
        for kind in ("early", "single")
        for m in (*MODES, "txt")
    ),
    Rule("final_layer.image.linear.weight", ("proj_out.weight",)),
    Rule("final_layer.image.adaLN_modulation.1.weight", ("norm_out.linear.weight",), swap_halves=True),
]
FLOW_MAP_RULES: list[Rule] = [  # the step-distilled checkpoints' target-timestep embedder
    Rule("ref_time_in.in_layer.weight", ("target_timestep_embedder.linear_1.weight",)),
    Rule("ref_time_in.out_layer.weight", ("target_timestep_embedder.linear_2.weight",)),
]
# inside every block, per-mode or joint: BFL name → diffusers name
BLOCK_NAMES: dict[str, str] = {
    "q_proj.weight": "attn.to_q.weight",
    "k_proj.weight": "attn.to_k.weight",
    "v_proj.weight": "attn.to_v.weight",
    "attn_out.weight": "attn.to_out.0.weight",
    "norm.query_norm.scale": "attn.norm_q.weight",
    "norm.key_norm.scale": "attn.norm_k.weight",
    "mlp_in.weight": "ff.linear_in.weight",
    "mlp_out.weight": "ff.linear_out.weight",
}
# block groups: BFL prefix → diffusers prefix, `{i}` the block index
BLOCK_GROUPS: dict[str, str] = {
    **{f"content_mode_blocks.{m}.{{i}}": f"mode_blocks.{m}.{{i}}" for m in MODES},
    "txt_mode_blocks.{i}": "txt_mode_blocks.{i}",
}
SINGLE_GROUP = ("single_blocks.{i}", "single_transformer_blocks.{i}")

# Keys that exist in exactly one layout (after stripping a BFL prefix), whatever the depth.
_MARKS = ("early_stream_modulations.", "single_stream_modulations.")
_BFL_ONLY = (
    "emb_in.",
    "txt_in.",
    "time_in.",
    "ref_time_in.",
    "final_layer.",
    "content_mode_blocks.",
    "single_blocks.",
)
_DIFFUSERS_ONLY = (
    *("x_embedders.", "context_embedder.", "timestep_embedder.", "target_timestep_embedder."),
    *("norm_out.", "proj_out.", "mode_blocks.", "single_transformer_blocks."),
)


def is_flux3(keys: Iterable[str]) -> bool:
    """True when the keys hold FLUX.3's per-mode modulation (either layout); FLUX.1 and FLUX.2 have none."""
    return any(strip_prefix(k).startswith(_MARKS) for k in keys)


def training_only(key: str) -> bool:
    """A BFL key of the training-only REPA heads (prefix stripped or not)."""
    return strip_prefix(key).startswith(TRAINING_ONLY)


def detect_layout(keys: Iterable[str]) -> str:
    """'bfl' or 'diffusers' for a FLUX.3 key set, by the modulation leaf (`.lin.` vs `.linear.`) and the names
    only one layout has; a file holding names of both is refused."""
    stripped = [strip_prefix(k) for k in keys]
    bfl = [k for k in stripped if k.startswith(_BFL_ONLY) or (k.startswith(_MARKS) and ".lin." in k)]
    diffusers = [
        k for k in stripped if k.startswith(_DIFFUSERS_ONLY) or (k.startswith(_MARKS) and ".linear." in k)
    ]
    return one_layout("FLUX.3", bfl, diffusers)


def rules(depth: int, depth_single: int, flow_map: bool) -> Iterator[Rule]:
    """All rules for a model with `depth` blocks per mode and `depth_single` joint blocks."""
    yield from GLOBAL_RULES
    if flow_map:
        yield from FLOW_MAP_RULES
    groups = [(bfl, d, depth) for bfl, d in BLOCK_GROUPS.items()] + [(*SINGLE_GROUP, depth_single)]
    for bfl_group, d_group, n in groups:
        for i in range(n):
            for bfl, d in BLOCK_NAMES.items():
                yield Rule(f"{bfl_group.format(i=i)}.{bfl}", (f"{d_group.format(i=i)}.{d}",))


def diffusers_depths(keys: Iterable[str]) -> tuple[int, int, bool]:
    """(blocks per mode, joint blocks, flow map) of a diffusers-layout key set."""
    return block_depths(keys, "txt_mode_blocks", "single_transformer_blocks", "target_timestep_embedder.")


def bfl_depths(keys: Iterable[str]) -> tuple[int, int, bool]:
    """(blocks per mode, joint blocks, flow map) of a BFL-layout key set (prefix stripped)."""
    return block_depths(keys, "txt_mode_blocks", "single_blocks", "ref_time_in.")
