"""What ControlNets add to a FLUX.1 transformer's blocks: `ControlResiduals`, and the two ways they join a
stream. Plain tensors only, so the transformer's block loop and the ControlNet share it without importing
each other."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from flux_runtime.models.dit.layers import Pending, Stream, materialize


@dataclass(frozen=True)
class ControlResiduals:
    """What the ControlNets add to the base transformer's image states: one tensor (B, L_img, D) per
    ControlNet double block and per single block. Double block k of the base model takes `double[k // every]`,
    where `every` = ceil(its blocks / len(double)), or with `repeat` (XLabs) `double[k % len(double)]`;
    single blocks take `single` the first way."""

    double: tuple[Tensor, ...] = ()
    single: tuple[Tensor, ...] = ()
    repeat: bool = False

    def after_double(self, k: int, blocks: int) -> Tensor | None:
        return _pick(self.double, k, blocks, self.repeat)

    def after_single(self, k: int, blocks: int) -> Tensor | None:
        return _pick(self.single, k, blocks, False)

    def plus(self, other: ControlResiduals) -> ControlResiduals:
        """The sum, residual by residual, as diffusers sums several ControlNets' (`other` added after `self`):
        a kind of block `self` has none for stays without, one `other` has none for keeps `self`'s, and the
        shorter list of the two decides the length."""
        return ControlResiduals(_add(self.double, other.double), _add(self.single, other.single), self.repeat)


def _add(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    if not a or not b:
        return a
    return tuple(x + y for x, y in zip(a, b, strict=False))


def _pick(samples: tuple[Tensor, ...], k: int, blocks: int, repeat: bool) -> Tensor | None:
    if not samples:
        return None
    if repeat:
        return samples[k % len(samples)]
    every = -(-blocks // len(samples))  # ceil
    return samples[k // every]


def add_residual(x: Stream, residual: Tensor | None) -> Stream:
    """`x + residual` (x materialised first), or `x` when there is none."""
    return x if residual is None else materialize(x) + residual


def add_image_residual(x: Stream, n_txt: int, residual: Tensor | None) -> Stream:
    """The joint stream `[txt | img]` with `residual` added to its image rows (diffusers adds it to the image
    states it keeps apart from the text's between single blocks: the same sums)."""
    if residual is None:
        return x
    x = materialize(x) if isinstance(x, Pending) else x.clone()
    x[:, n_txt:] += residual
    return x
