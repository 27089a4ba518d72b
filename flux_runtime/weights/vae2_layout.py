"""The FLUX.2 autoencoder's diffusers layout, expressed against BFL's keys (our module names).

FLUX.1's table (`vae_layout`: same encoder, decoder, renames and 1x1 attention reshapes) plus the
parts FLUX.2 adds (as diffusers' `DIFFUSERS_VAE_TO_FLUX2_MAPPING` names them), all plain
renames: BFL keeps the quant convs inside the encoder and decoder (`encoder.quant_conv`,
`decoder.post_quant_conv`), diffusers at the top (`quant_conv`, `post_quant_conv`); the BatchNorm
statistics have the same names in both. Both directions are pure and lossless.

`bn.num_batches_tracked`, the BatchNorm's training counter, also has one name in both layouts but is
optional: a checkpoint may hold it or not (diffusers' converter drops it, `save_pretrained` writes it),
inference never reads it, and a conversion carries it only when the source has it.
"""

from __future__ import annotations

from collections.abc import Iterator

from flux_runtime.weights import vae_layout
from flux_runtime.weights.vae_layout import Rule

LATENT_RULES: list[Rule] = [
    Rule("encoder.quant_conv.weight", "quant_conv.weight"),
    Rule("encoder.quant_conv.bias", "quant_conv.bias"),
    Rule("decoder.post_quant_conv.weight", "post_quant_conv.weight"),
    Rule("decoder.post_quant_conv.bias", "post_quant_conv.bias"),
    Rule("bn.running_mean", "bn.running_mean"),
    Rule("bn.running_var", "bn.running_var"),
]
# Accepted in either layout (a 0-d integer tensor), never required, not part of the model.
OPTIONAL: tuple[str, ...] = ("bn.num_batches_tracked",)
# Keys only a FLUX.2 autoencoder has, in either layout: the latent BatchNorm.
FLUX2_MARK = "bn."


def is_flux2(keys: list[str]) -> bool:
    """True when the (prefix-stripped) keys hold the latent BatchNorm that only FLUX.2's VAE has."""
    return any(k.startswith(FLUX2_MARK) for k in keys)


def rules(ch_mult: tuple[int, ...], num_res_blocks: int) -> Iterator[Rule]:
    """All rules of a FLUX.2 autoencoder with these level multipliers and resnets per encoder level."""
    yield from vae_layout.rules(ch_mult, num_res_blocks)
    yield from LATENT_RULES
