"""The FLUX.1 transformer's diffusers layout, expressed against BFL's keys (our module names).

One table of `{i}` templates: each BFL key and the diffusers keys it is made of. Where BFL fuses
several diffusers tensors (`qkv` = to_q, to_k, to_v; `linear1` = to_q, to_k, to_v, proj_mlp) they
are concatenated along the output dim; the final adaLN stores `(shift, scale)` in BFL and
`(scale, shift)` in diffusers, so its halves are swapped. Both directions are pure and lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from flux_runtime.weights import keys as key_names

BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


@dataclass(frozen=True)
class Rule:
    bfl: str
    diffusers: tuple[str, ...]
    swap_halves: bool = False


def _linear(bfl: str, *diffusers: str, swap_halves: bool = False) -> list[Rule]:
    return [Rule(f"{bfl}.{p}", tuple(f"{d}.{p}" for d in diffusers), swap_halves) for p in ("weight", "bias")]


GLOBAL_RULES: list[Rule] = [
    *_linear("img_in", "x_embedder"),
    *_linear("txt_in", "context_embedder"),
    *_linear("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
    *_linear("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
    *_linear("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
    *_linear("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
    *_linear("final_layer.linear", "proj_out"),
    *_linear("final_layer.adaLN_modulation.1", "norm_out.linear", swap_halves=True),
]
GUIDANCE_RULES: list[Rule] = [
    *_linear("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
    *_linear("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
]
_D = "transformer_blocks.{i}"
_S = "single_transformer_blocks.{i}"
# The QK-norm scales, renamed alike in FLUX.1 and FLUX.2.
DOUBLE_NORM_RULES: list[Rule] = [
    Rule("double_blocks.{i}.img_attn.norm.query_norm.scale", (f"{_D}.attn.norm_q.weight",)),
    Rule("double_blocks.{i}.img_attn.norm.key_norm.scale", (f"{_D}.attn.norm_k.weight",)),
    Rule("double_blocks.{i}.txt_attn.norm.query_norm.scale", (f"{_D}.attn.norm_added_q.weight",)),
    Rule("double_blocks.{i}.txt_attn.norm.key_norm.scale", (f"{_D}.attn.norm_added_k.weight",)),
]
SINGLE_NORM_RULES: list[Rule] = [
    Rule("single_blocks.{i}.norm.query_norm.scale", (f"{_S}.attn.norm_q.weight",)),
    Rule("single_blocks.{i}.norm.key_norm.scale", (f"{_S}.attn.norm_k.weight",)),
]
DOUBLE_RULES: list[Rule] = [
    *_linear("double_blocks.{i}.img_mod.lin", f"{_D}.norm1.linear"),
    *_linear("double_blocks.{i}.txt_mod.lin", f"{_D}.norm1_context.linear"),
    *_linear("double_blocks.{i}.img_attn.qkv", f"{_D}.attn.to_q", f"{_D}.attn.to_k", f"{_D}.attn.to_v"),
    *_linear(
        "double_blocks.{i}.txt_attn.qkv",
        f"{_D}.attn.add_q_proj",
        f"{_D}.attn.add_k_proj",
        f"{_D}.attn.add_v_proj",
    ),
    *DOUBLE_NORM_RULES,
    *_linear("double_blocks.{i}.img_attn.proj", f"{_D}.attn.to_out.0"),
    *_linear("double_blocks.{i}.txt_attn.proj", f"{_D}.attn.to_add_out"),
    *_linear("double_blocks.{i}.img_mlp.0", f"{_D}.ff.net.0.proj"),
    *_linear("double_blocks.{i}.img_mlp.2", f"{_D}.ff.net.2"),
    *_linear("double_blocks.{i}.txt_mlp.0", f"{_D}.ff_context.net.0.proj"),
    *_linear("double_blocks.{i}.txt_mlp.2", f"{_D}.ff_context.net.2"),
]
SINGLE_RULES: list[Rule] = [
    *_linear("single_blocks.{i}.modulation.lin", f"{_S}.norm.linear"),
    *_linear(
        "single_blocks.{i}.linear1", f"{_S}.attn.to_q", f"{_S}.attn.to_k", f"{_S}.attn.to_v", f"{_S}.proj_mlp"
    ),
    *_linear("single_blocks.{i}.linear2", f"{_S}.proj_out"),
    *SINGLE_NORM_RULES,
]


def strip_prefix(key: str) -> str:
    """`key` without a ComfyUI-style `model.diffusion_model.` / `diffusion_model.` prefix."""
    return key_names.strip_prefix(key, BFL_PREFIXES)


def count_blocks(keys: Iterable[str], prefix: str) -> int:
    """Number of blocks `prefix.N.*` present (max N + 1)."""
    ids = {int(k[len(prefix) + 1 :].split(".", 1)[0]) for k in keys if k.startswith(prefix + ".")}
    return max(ids) + 1 if ids else 0


def block_depths(keys: Iterable[str], double: str, single: str, flag: str) -> tuple[int, int, bool]:
    """(blocks `double.N`, blocks `single.N`, whether any key starts with `flag`): a key set's depths and the
    presence of its optional embedder (FLUX.1 / FLUX.2 guidance, FLUX.3 flow map)."""
    keys = list(keys)
    return count_blocks(keys, double), count_blocks(keys, single), any(k.startswith(flag) for k in keys)


def rules(depth: int, depth_single: int, guidance: bool) -> Iterator[Rule]:
    """All rules for a model of this depth, with `{i}` filled in."""
    yield from expand_rules(
        [*GLOBAL_RULES, *(GUIDANCE_RULES if guidance else ())],
        ((DOUBLE_RULES, depth), (SINGLE_RULES, depth_single)),
    )


def expand_rules(fixed: list[Rule], blocks: tuple[tuple[list[Rule], int], ...]) -> Iterator[Rule]:
    """`fixed` as they are, then each `(template, n)` of `blocks` for block `{i}` = 0 .. n - 1 (FLUX.1 and
    FLUX.2 tables)."""
    yield from fixed
    for template, n in blocks:
        for i in range(n):
            for r in template:
                yield Rule(r.bfl.format(i=i), tuple(d.format(i=i) for d in r.diffusers), r.swap_halves)


def swap_halves(t: Tensor) -> Tensor:
    """The two row halves of `t` swapped (the final adaLN's (shift, scale) in BFL, (scale, shift) in diffusers).

    On the `meta` device (the loaders' shape checks) `t` itself comes back: the shape is the same, and torch's
    meta `cat` goes through its reference ops, whose first use imports `torch._dynamo` (seconds of a load)."""
    if t.is_meta:
        return t
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def diffusers_to_bfl(rule: Rule, get: Callable[[str], Tensor]) -> Tensor:
    """Build the BFL tensor of `rule` from diffusers tensors read through `get`.

    A rename returns the tensor itself (no copy); fusing ([q; k; v] rows) and swapping make a new one.
    """
    parts = [get(k) for k in rule.diffusers]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return swap_halves(t) if rule.swap_halves else t


def bfl_to_diffusers(rule: Rule, t: Tensor, hidden_size: int) -> dict[str, Tensor]:
    """Split the BFL tensor of `rule` into its diffusers tensors (q, k, v blocks are `hidden_size` rows)."""
    if rule.swap_halves:
        t = swap_halves(t)
    n = len(rule.diffusers)
    if n == 1:
        return {rule.diffusers[0]: t}
    sizes = [hidden_size] * 3 + ([t.shape[0] - 3 * hidden_size] if n == 4 else [])
    return {k: p.contiguous() for k, p in zip(rule.diffusers, t.split(sizes, dim=0), strict=True)}
