"""The FLUX.1 autoencoder's diffusers layout, expressed against BFL's keys (our module names).

One rule per tensor: the BFL key and its diffusers key. The renames
follow diffusers' `convert_ldm_vae_checkpoint`: `down.{i}.block` ↔ `down_blocks.{i}.resnets`,
`nin_shortcut` ↔ `conv_shortcut`, `mid.block_{1,2}` ↔ `mid_block.resnets.{0,1}`, `mid.attn_1` ↔
`mid_block.attentions.0`, `norm_out` ↔ `conv_norm_out`; the decoder's `up` list is stored by
resolution in BFL and by execution order in diffusers, so `up.{i}` ↔ `up_blocks.{n-1-i}`.
The one real transform: BFL's attention projections are 1x1 convs `[C, C, 1, 1]`, diffusers'
are `nn.Linear` `[C, C]`; the values are the same, only the two unit dims come and go.
Both directions are pure and lossless.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor

# SD-style single files put the VAE under one of these.
PREFIXES = ("first_stage_model.", "vae.")


@dataclass(frozen=True)
class Rule:
    bfl: str
    diffusers: str
    conv1x1: bool = False  # BFL [C, C, 1, 1] conv weight ↔ diffusers [C, C] linear weight


def _pair(bfl: str, diffusers: str, conv1x1: bool = False) -> list[Rule]:
    return [Rule(f"{bfl}.weight", f"{diffusers}.weight", conv1x1), Rule(f"{bfl}.bias", f"{diffusers}.bias")]


def _resnet(bfl: str, diffusers: str, shortcut: bool) -> list[Rule]:
    out = [
        r
        for name in ("norm1", "conv1", "norm2", "conv2")
        for r in _pair(f"{bfl}.{name}", f"{diffusers}.{name}")
    ]
    if shortcut:
        out += _pair(f"{bfl}.nin_shortcut", f"{diffusers}.conv_shortcut")
    return out


def _mid(side: str) -> list[Rule]:
    bfl, diff = f"{side}.mid", f"{side}.mid_block"
    attn, dattn = f"{bfl}.attn_1", f"{diff}.attentions.0"
    return [
        *_resnet(f"{bfl}.block_1", f"{diff}.resnets.0", shortcut=False),
        *_pair(f"{attn}.norm", f"{dattn}.group_norm"),
        *_pair(f"{attn}.q", f"{dattn}.to_q", conv1x1=True),
        *_pair(f"{attn}.k", f"{dattn}.to_k", conv1x1=True),
        *_pair(f"{attn}.v", f"{dattn}.to_v", conv1x1=True),
        *_pair(f"{attn}.proj_out", f"{dattn}.to_out.0", conv1x1=True),
        *_resnet(f"{bfl}.block_2", f"{diff}.resnets.1", shortcut=False),
    ]


def rules(ch_mult: tuple[int, ...], num_res_blocks: int) -> Iterator[Rule]:
    """All rules of an autoencoder with these level multipliers and resnets per encoder level.

    Widths only decide where a `nin_shortcut` exists (first resnet of a level whose width changes),
    so the multipliers suffice; the decoder has `num_res_blocks + 1` resnets per level.
    """
    n = len(ch_mult)
    # encoder, in execution order
    yield from _pair("encoder.conv_in", "encoder.conv_in")
    c_in = ch_mult[0]
    for i, c in enumerate(ch_mult):
        for j in range(num_res_blocks):
            shortcut = j == 0 and c_in != c
            yield from _resnet(
                f"encoder.down.{i}.block.{j}", f"encoder.down_blocks.{i}.resnets.{j}", shortcut
            )
        if i != n - 1:
            yield from _pair(
                f"encoder.down.{i}.downsample.conv", f"encoder.down_blocks.{i}.downsamplers.0.conv"
            )
        c_in = c
    yield from _mid("encoder")
    yield from _pair("encoder.norm_out", "encoder.conv_norm_out")
    yield from _pair("encoder.conv_out", "encoder.conv_out")
    # decoder, in execution order: BFL level i is diffusers up block n-1-i
    yield from _pair("decoder.conv_in", "decoder.conv_in")
    yield from _mid("decoder")
    c_in = ch_mult[-1]
    for i in reversed(range(n)):
        k, c = n - 1 - i, ch_mult[i]
        for j in range(num_res_blocks + 1):
            shortcut = j == 0 and c_in != c
            yield from _resnet(f"decoder.up.{i}.block.{j}", f"decoder.up_blocks.{k}.resnets.{j}", shortcut)
        if i != 0:
            yield from _pair(f"decoder.up.{i}.upsample.conv", f"decoder.up_blocks.{k}.upsamplers.0.conv")
        c_in = c
    yield from _pair("decoder.norm_out", "decoder.conv_norm_out")
    yield from _pair("decoder.conv_out", "decoder.conv_out")


def diffusers_to_bfl(rule: Rule, t: Tensor) -> Tensor:
    """The BFL tensor of `rule` from its diffusers tensor (a view: linear weights gain `1, 1`)."""
    return t.reshape(*t.shape, 1, 1) if rule.conv1x1 else t


def bfl_to_diffusers(rule: Rule, t: Tensor) -> Tensor:
    """The diffusers tensor of `rule` from its BFL tensor (a view: 1x1 conv weights lose `1, 1`)."""
    return t.flatten(1) if rule.conv1x1 else t


def diffusers_shape(rule: Rule, bfl_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the diffusers tensor of `rule` must have, given the BFL shape."""
    return tuple(bfl_shape[:2]) if rule.conv1x1 else tuple(bfl_shape)
