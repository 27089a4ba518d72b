"""The FLUX.1 ControlNet: a shallow copy of the FLUX.1 transformer whose blocks' image states, each through a
zero-initialised projection, are added to the base transformer's after its matching blocks.

One class holds every kind people use, told apart by their weights:
- InstantX / Shakker-Labs (diffusers `FluxControlNetModel`): the control image enters as VAE latents through
  `pos_embed_input` (diffusers' `controlnet_x_embedder`); double and single blocks, each with its projection;
- a union ControlNet: a learned embedding of the control mode (canny, depth, ...) is put before the text tokens;
- XLabs: the control image enters as pixels through a small convolutional encoder (`input_hint_block`), and
  its few double blocks' residuals repeat over the base model's double blocks.

Module names are XLabs' (BFL's, plus `controlnet_blocks`, `pos_embed_input`, `input_hint_block`), so an XLabs
file loads with no key map and a diffusers folder through the FLUX.1 layout table. The forward reproduces
diffusers 0.42.1 `FluxControlNetModel` op for op (`torch.equal` at the same weights and inputs), on the same
blocks as the transformer, so the fused kernels apply to it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flux_runtime.models.dit.config import DiTConfig
from flux_runtime.models.dit.flux1 import Flux1Transformer, ModulationSource
from flux_runtime.models.dit.layers import Linear, RoPE, Stream, materialize
from flux_runtime.models.dit.residuals import ControlResiduals

HINT_CHANNELS = 16  # the XLabs hint encoder's width
HINT_STRIDES = (1, 1, 2, 1, 2, 1, 2, 1)  # its eight 3x3 convolutions, SiLU between them: 8x down


@dataclass(frozen=True)
class ControlNetConfig:
    """A ControlNet's shape: its transformer part (`dit`: blocks, widths; no final layer), the number of
    control modes of a union ControlNet (None: not a union), and whether the control image enters as pixels
    through the XLabs hint encoder (`hint`) rather than as VAE latents."""

    dit: DiTConfig
    num_modes: int | None = None
    hint: bool = False

    def __post_init__(self) -> None:
        if self.num_modes is not None and self.num_modes < 1:
            raise ValueError(f"a union ControlNet needs at least one mode, got {self.num_modes}")
        if self.dit.family != "flux1":
            raise ValueError(f"ControlNets are FLUX.1 models, got a {self.dit.family} config")

    @property
    def kind(self) -> str:
        """What users call it: "xlabs", "union" or "instantx"."""
        return "xlabs" if self.hint else "union" if self.num_modes is not None else "instantx"


class HintEncoder(nn.Sequential):
    """XLabs' `input_hint_block`: eight 3x3 convolutions (RGB → 16 channels, three of them stride 2) with
    SiLU between them (diffusers' `ControlNetConditioningEmbedding` with 16-channel blocks)."""

    def __init__(self) -> None:
        layers: list[nn.Module] = []
        for i, stride in enumerate(HINT_STRIDES):
            if i:
                layers.append(nn.SiLU())
            layers.append(
                nn.Conv2d(3 if i == 0 else HINT_CHANNELS, HINT_CHANNELS, 3, stride=stride, padding=1)
            )
        super().__init__(*layers)

    def tokens(self, pixels: Tensor) -> Tensor:
        """(B, 3, H, W) pixels in [-1, 1] → (B, H/16 · W/16, 64) tokens, channels then the 2x2 patch (c, ph, pw)."""
        x = self(pixels)
        b, c, h, w = x.shape
        x = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // 2) * (w // 2), c * 4)


class Flux1ControlNet(Flux1Transformer):
    """A FLUX.1 ControlNet (see the module docstring): `model(img, cond, mode, txt, y, timesteps, guidance, pe,
    scale)` → the `ControlResiduals` the base transformer adds to its blocks' image states."""

    def __init__(self, cfg: ControlNetConfig) -> None:
        self.control = cfg
        super().__init__(cfg.dit)
        d, n_double, n_single = cfg.dit.hidden_size, cfg.dit.depth, cfg.dit.depth_single_blocks
        self.controlnet_blocks = nn.ModuleList(Linear(d, d) for _ in range(n_double))
        self.controlnet_single_blocks = nn.ModuleList(Linear(d, d) for _ in range(n_single))
        self.pos_embed_input = Linear(cfg.dit.in_channels, d)
        if cfg.num_modes is not None:
            # left uninitialized: loading fills it (Embedding's own init on meta imports torch._dynamo)
            self.controlnet_mode_embedder = nn.Embedding(
                cfg.num_modes, d, _weight=torch.empty(cfg.num_modes, d)
            )
        if cfg.hint:
            self.input_hint_block = HintEncoder()

    def add_blocks(self) -> None:
        """The double and single blocks; no final layer (a ControlNet predicts no velocity)."""
        double, single, _ = self.block_types
        cfg = self.config
        self.double_blocks = nn.ModuleList(double(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(single(cfg) for _ in range(cfg.depth_single_blocks))

    @property
    def _mod_linears(self) -> list[nn.Module]:
        lins = [m.lin for b in self.double_blocks for m in (b.img_mod, b.txt_mod)]
        return lins + [b.modulation.lin for b in self.single_blocks]

    @property
    def max_probe_blocks(self) -> int:
        return 0  # never step-cached itself

    def text_ids(self, txt_ids: Tensor) -> Tensor:
        """The position ids of its text tokens: a union ControlNet's mode token first, at the first text
        token's position."""
        return torch.cat([txt_ids[:1], txt_ids], dim=0) if self.control.num_modes is not None else txt_ids

    def forward(  # type: ignore[override]
        self,
        img: Tensor,
        cond: Tensor,
        mode: Tensor | None,
        txt: Tensor,
        y: Tensor,
        timesteps: Tensor,
        guidance: Tensor | None,
        pe: RoPE,
        scale: float,
    ) -> ControlResiduals:
        """The residuals for the base model, each times `scale` (a Python float, as diffusers multiplies).

        img (B, L, 64) packed latents; cond: the control image as packed VAE latents (B, L, 64), or (XLabs)
        as pixels (B, 3, H, W) in [-1, 1]; mode (B, 1) long for a union ControlNet, else None; txt, y,
        timesteps, guidance as the transformer reads them; pe the RoPE tables of `[text_ids(txt_ids) | img]`.
        """
        cfg = self.control
        if (mode is None) != (cfg.num_modes is None):
            raise ValueError("a union ControlNet needs a mode (B, 1); other ControlNets take none")
        self.check_inputs(img, txt, timesteps, guidance, y)
        x = self.img_in(img)
        hint = self.input_hint_block.tokens(cond) if cfg.hint else cond
        x = x + self.pos_embed_input(hint)
        source = ModulationSource(self.conditioning(timesteps, y, guidance), None, self._mod_offsets)
        t = self.txt_in(txt)
        if mode is not None:
            t = torch.cat([self.controlnet_mode_embedder(mode), t], dim=1)

        double: list[Tensor] = []
        img_s: Stream = x
        txt_s: Stream = t
        for block, out in zip(self.double_blocks, self.controlnet_blocks, strict=True):
            img_s, txt_s = block(img_s, txt_s, source, None, pe)  # no image prompt: diffusers passes none
            img_s = materialize(img_s)
            double.append(out(img_s) * scale)

        single: list[Tensor] = []
        n_txt = t.shape[1]
        joint: Stream = (
            torch.cat([materialize(txt_s), materialize(img_s)], dim=1) if self.single_blocks else x
        )
        for block, out in zip(self.single_blocks, self.controlnet_single_blocks, strict=True):
            joint = materialize(block(joint, source, pe))
            single.append(out(joint[:, n_txt:]) * scale)
        return ControlResiduals(tuple(double), tuple(single), repeat=cfg.hint)
