"""The FLUX.1 autoencoder (a KL-regularised VAE, 16 latent channels, 8x spatial compression).

Module names equal Black Forest Labs' `ae.safetensors` keys (`encoder.down.0.block.1.conv2`,
`decoder.up.3.upsample.conv`, `encoder.mid.attn_1.q`), so that file loads with no key map; the
diffusers `vae/` layout is mapped by `flux_runtime.weights.vae_layout`. The forward pass reproduces
diffusers 0.42.1 `AutoencoderKL` op for op: in particular the
mid-block attention stores BFL's 1x1 convs but runs them as `F.linear` on the `(B, HW, C)` token
view, as diffusers does with its `nn.Linear` projections.

Latents come in two scales: `encode`/`decode` work on the raw latent, as diffusers' `AutoencoderKL`
does; the DiT sees `scale_latents(z)` = `(z - shift_factor) * scale_factor`.

The FLUX.2 autoencoder (flux2.py) is this network with a latent 1x1 conv on each side and BatchNorm
statistics instead of the affine; it imports the shared parts from here: `VAEShape` (the architecture
fields), the blocks, and `KLAutoencoder` (encode to the posterior, plain or tiled decode).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Generic, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime.kernels.group_norm import group_norm_silu
from flux_runtime.kernels.linear import linear

EPS = 1e-6
# diffusers' tiled decode: neighbouring tiles overlap by a quarter of a tile and are blended linearly.
TILE_OVERLAP = 0.25


@dataclass(frozen=True, kw_only=True)
class VAEShape:
    """The architecture both FLUX autoencoders share, in BFL's `AutoEncoderParams` vocabulary.

    Level `i` of the encoder has `ch * ch_mult[i]` channels (diffusers' `block_out_channels`) and
    `num_res_blocks` resnets (the decoder has one more per level); every level but the last halves
    the resolution, so the spatial factor is `2 ** (len(ch_mult) - 1)`. `norm_num_groups` is fixed
    to 32 in BFL's code. Each family's config adds how its latents are normalised.
    """

    in_channels: int = 3
    out_ch: int = 3
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    norm_num_groups: int = 32

    def __post_init__(self) -> None:
        if min(self.in_channels, self.out_ch, self.ch, self.z_channels, self.norm_num_groups) <= 0:
            raise ValueError(
                f"in_channels {self.in_channels}, out_ch {self.out_ch}, ch {self.ch}, z_channels {self.z_channels} "
                f"and norm_num_groups {self.norm_num_groups} must be positive"
            )
        if not self.ch_mult or min(self.ch_mult) <= 0:
            raise ValueError(f"ch_mult {self.ch_mult} must be a non-empty tuple of positive multipliers")
        if self.num_res_blocks <= 0:
            raise ValueError(f"num_res_blocks {self.num_res_blocks} must be positive")
        for c in self.block_channels:
            if c % self.norm_num_groups:
                raise ValueError(f"block width {c} not divisible by norm_num_groups {self.norm_num_groups}")

    @property
    def block_channels(self) -> tuple[int, ...]:
        """Channels per level, diffusers' `block_out_channels`."""
        return tuple(self.ch * m for m in self.ch_mult)

    @property
    def spatial_factor(self) -> int:
        """Image pixels per latent pixel along each side."""
        return 2 ** (len(self.ch_mult) - 1)


@dataclass(frozen=True, kw_only=True)
class VAEConfig(VAEShape):
    """Shape of the FLUX.1 autoencoder: `VAEShape` plus its latent affine.

    `scale_factor`/`shift_factor` map raw latents to what the DiT sees (diffusers'
    `scaling_factor`/`shift_factor`).
    """

    family: ClassVar[Literal["flux1"]] = "flux1"
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scale_factor == 0:
            raise ValueError("scale_factor must be non-zero")


FLUX1_VAE = VAEConfig()
# Two levels of 32 channels, one resnet each: a 2x autoencoder that still gives the DiT's 16 latent
# channels (packed 2x2 into its 64 input channels). 32 groups, as BFL's code hard-wires.
TINY_VAE = replace(FLUX1_VAE, ch=32, ch_mult=(1, 1), num_res_blocks=1)
# The built-in `tiny` model's autoencoder, trained by scripts/train_tiny.py: FLUX.1's four levels (8x) at
# widths 32-64, one resnet each. Its latent shift and scale are the mean and 1 / std of its latents on the
# training scenes, as that run measured and printed them (seed 0).
TINY_TRAINED_VAE = replace(
    FLUX1_VAE, ch=32, ch_mult=(1, 2, 2, 2), num_res_blocks=1, scale_factor=0.8085, shift_factor=-0.1036
)

VAE_PRESETS: dict[str, VAEConfig] = {"flux1": FLUX1_VAE, "tiny": TINY_VAE, "tiny-trained": TINY_TRAINED_VAE}


def group_norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=groups, num_channels=channels, eps=EPS, affine=True)


def conv3x3(c_in: int, c_out: int, stride: int = 1, padding: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=padding)


class ResnetBlock(nn.Module):
    """`x' + conv2(silu(norm2(conv1(silu(norm1(x))))))`; `x'` is a 1x1 `nin_shortcut` when widths differ."""

    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = group_norm(in_channels, groups)
        self.conv1 = conv3x3(in_channels, out_channels)
        self.norm2 = group_norm(out_channels, groups)
        self.conv2 = conv3x3(out_channels, out_channels)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(group_norm_silu(x, self.norm1))
        h = self.conv2(group_norm_silu(h, self.norm2))
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        # diffusers divides by output_scale_factor 1.0 here: exact, so left out
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the `H*W` positions, with a residual.

    Weights are BFL's 1x1 convs (`q`, `k`, `v`, `proj_out`, each `[C, C, 1, 1]`); they run as the GEMMs
    diffusers' `AttnProcessor2_0` runs with its `nn.Linear`s. The q/k/v input is a transposed view that
    cannot be flattened without a copy, so they run through `kernels.linear.linear`, the route aten takes for a
    weight that requires grad, as diffusers' do.
    """

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm = group_norm(channels, groups)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    @staticmethod
    def _linear(conv: nn.Conv2d, x: Tensor) -> Tensor:
        return linear(x, conv.weight.flatten(1), conv.bias)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        # GroupNorm on the (B, C, HW) view, then tokens (B, HW, C) (a transposed view, as in diffusers)
        tokens = group_norm_silu(x.view(b, c, h * w), self.norm, silu=False).transpose(1, 2)
        q, k, v = (self._linear(conv, tokens) for conv in (self.q, self.k, self.v))
        # one head of width C: (B, 1, HW, C)
        q, k, v = (t.view(b, -1, 1, c).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, -1, c).to(q.dtype)
        out = self._linear(self.proj_out, out)
        return out.transpose(-1, -2).reshape(b, c, h, w) + x


class Downsample(nn.Module):
    """Pad right and bottom by one, then a stride-2 3x3 conv (halves H and W)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = conv3x3(channels, channels, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Upsample(nn.Module):
    """Nearest-neighbour 2x, then a 3x3 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = conv3x3(channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class MidBlock(nn.Module):
    """`block_1 → attn_1 → block_2` at the lowest resolution (encoder and decoder alike)."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, groups)
        self.attn_1 = AttnBlock(channels, groups)
        self.block_2 = ResnetBlock(channels, channels, groups)

    def forward(self, x: Tensor) -> Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class DownLevel(nn.Module):
    """One encoder level: resnets (`block`), then a `downsample` except at the last level."""

    def __init__(self, widths: list[tuple[int, int]], groups: int, downsample: bool) -> None:
        super().__init__()
        self.block = _resnets(widths, groups)
        self.downsample = Downsample(widths[-1][1]) if downsample else None

    def forward(self, x: Tensor) -> Tensor:
        return _level(self.block, self.downsample, x)


class UpLevel(nn.Module):
    """One decoder level: resnets (`block`), then an `upsample` except at full resolution."""

    def __init__(self, widths: list[tuple[int, int]], groups: int, upsample: bool) -> None:
        super().__init__()
        self.block = _resnets(widths, groups)
        self.upsample = Upsample(widths[-1][1]) if upsample else None

    def forward(self, x: Tensor) -> Tensor:
        return _level(self.block, self.upsample, x)


def _resnets(widths: list[tuple[int, int]], groups: int) -> nn.ModuleList:
    """A level's resnets, one per (in, out) width pair."""
    return nn.ModuleList(ResnetBlock(i, o, groups) for i, o in widths)


def _level(resnets: nn.ModuleList, resample: nn.Module | None, x: Tensor) -> Tensor:
    """`x` through a level's resnets, then its resampling when it has one."""
    for block in resnets:
        x = block(x)
    return x if resample is None else resample(x)


class Encoder(nn.Module):
    """Image (B, in_channels, H, W) → posterior moments (B, 2*z_channels, H/f, W/f): mean, then logvar."""

    def __init__(self, cfg: VAEShape) -> None:
        super().__init__()
        g, widths = cfg.norm_num_groups, cfg.block_channels
        self.conv_in = conv3x3(cfg.in_channels, widths[0])
        self.down = nn.ModuleList()
        c_in = widths[0]
        for i, c in enumerate(widths):
            pairs = [(c_in if j == 0 else c, c) for j in range(cfg.num_res_blocks)]
            self.down.append(DownLevel(pairs, g, downsample=i != len(widths) - 1))
            c_in = c
        self.mid = MidBlock(widths[-1], g)
        self.norm_out = group_norm(widths[-1], g)
        self.conv_out = conv3x3(widths[-1], 2 * cfg.z_channels)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        return self.conv_out(group_norm_silu(h, self.norm_out))


class Decoder(nn.Module):
    """Raw latent (B, z_channels, h, w) → image (B, out_ch, h*f, w*f).

    `up` is indexed by resolution as in BFL (`up.0` is full resolution and runs last); diffusers'
    `up_blocks` are in execution order, so `up_blocks.k` is `up.{n-1-k}`.
    """

    def __init__(self, cfg: VAEShape) -> None:
        super().__init__()
        g, widths = cfg.norm_num_groups, cfg.block_channels
        self.conv_in = conv3x3(cfg.z_channels, widths[-1])
        self.mid = MidBlock(widths[-1], g)
        levels: list[UpLevel] = []
        c_in = widths[-1]
        for i in reversed(range(len(widths))):
            c = widths[i]
            pairs = [(c_in if j == 0 else c, c) for j in range(cfg.num_res_blocks + 1)]
            levels.insert(0, UpLevel(pairs, g, upsample=i != 0))
            c_in = c
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(widths[0], g)
        self.conv_out = conv3x3(widths[0], cfg.out_ch)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(group_norm_silu(h, self.norm_out))


ConfigT = TypeVar("ConfigT", bound=VAEShape)


class KLAutoencoder(nn.Module, Generic[ConfigT]):
    """What both FLUX autoencoders do alike: `encode` images to raw latents, `decode` raw latents to images.

    `encoder` maps an image to the posterior moments and `decoder` a raw latent to an image, whatever
    each family puts inside them (FLUX.2 adds its 1x1 quant convs there, where BFL stores them).
    Images are in [-1, 1]; raw latents are what diffusers' `encode(x).latent_dist` gives and `decode` takes.
    """

    def __init__(self, cfg: ConfigT, encoder: Encoder, decoder: Decoder) -> None:
        super().__init__()
        self.config: ConfigT = cfg
        self.encoder = encoder
        self.decoder = decoder

    def _param_dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    def encode(
        self,
        x: Tensor,
        *,
        sample: bool = False,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> Tensor:
        """Image (B, in_channels, H, W) in [-1, 1] → raw latent (B, z_channels, H/f, W/f), model dtype.

        Returns the posterior mean, diffusers' `encode(x).latent_dist.mode()`; with `sample=True`,
        `mean + std * noise` with noise drawn as `latent_dist.sample(generator)` draws it (on the
        generator's device when that is the CPU, in the model dtype), so a seed gives the same latent; a list of
        generators draws each image's noise from its own.
        """
        cfg, f = self.config, self.config.spatial_factor
        if x.ndim != 4 or x.shape[1] != cfg.in_channels:
            raise ValueError(f"image must be (B, {cfg.in_channels}, H, W), got {tuple(x.shape)}")
        if x.shape[2] % f or x.shape[3] % f:
            raise ValueError(f"image size {x.shape[2]}x{x.shape[3]} is not divisible by the VAE's factor {f}")
        self._check_dtype(x, "image")
        if generator is not None and not sample:
            raise ValueError("a generator only matters with sample=True")
        moments = self.encoder(x)
        # diffusers' DiagonalGaussianDistribution
        mean, logvar = torch.chunk(moments, 2, dim=1)
        if not sample:
            return mean.contiguous()
        std = torch.exp(0.5 * torch.clamp(logvar, -30.0, 20.0))
        gens = generator if isinstance(generator, list) else [generator]
        if isinstance(generator, list) and len(generator) != mean.shape[0]:
            raise ValueError(
                f"got {len(generator)} generators for a batch of {mean.shape[0]}; pass one per image"
            )
        # a list draws one image's noise per generator, as diffusers' randn_tensor does
        shape = (mean.shape[0] // len(gens), *mean.shape[1:])
        noise = torch.cat(
            [
                torch.randn(
                    shape, generator=g, device="cpu" if g is not None and g.device.type == "cpu" else moments.device,
                    dtype=moments.dtype,
                ).to(moments.device)
                for g in gens
            ]
        )  # fmt: skip
        return mean + std * noise

    def decode(self, z: Tensor, *, tile: int | None = None) -> Tensor:
        """Raw latent (B, z_channels, h, w) → image (B, out_ch, h*f, w*f) in about [-1, 1], model dtype.

        `tile=None` decodes in one pass (diffusers' default). `tile=T` (latent pixels, a multiple
        of 4) bounds memory for large images: a latent wider or taller than `T` is decoded in
        `T x T` tiles that overlap by `T/4` and are blended linearly, holding one row of decoded
        tiles at a time. That is diffusers' `enable_tiling()` decode, bit for bit, when `T` is its
        `tile_latent_min_size` (`sample_size // f`, 128 for FLUX.1 and FLUX.2). Tiled output is *not*
        bit-identical to untiled output: each tile's GroupNorm statistics and attention see only
        that tile, so seams are smoothed, not exact.
        """
        cfg = self.config
        if z.ndim != 4 or z.shape[1] != cfg.z_channels:
            raise ValueError(f"latent must be (B, {cfg.z_channels}, h, w), got {tuple(z.shape)}")
        self._check_dtype(z, "latent")
        if tile is not None and (tile <= 0 or tile % 4):
            raise ValueError(f"tile {tile} must be a positive multiple of 4 (tiles overlap by a quarter)")
        if tile is None or (z.shape[2] <= tile and z.shape[3] <= tile):
            return self.decoder(z)
        return self._decode_tiled(z, tile)

    def _decode_tiled(self, z: Tensor, tile: int) -> Tensor:
        f = self.config.spatial_factor
        # diffusers' arithmetic: int(T * 0.75) latent stride; int(T*f * 0.25) blended pixels
        stride = int(tile * (1 - TILE_OVERLAP))
        blend = int(tile * f * TILE_OVERLAP)
        keep = tile * f - blend
        out_rows: list[Tensor] = []
        prev: list[Tensor] = []
        for i in range(0, z.shape[2], stride):
            row = [self.decoder(z[:, :, i : i + tile, j : j + tile]) for j in range(0, z.shape[3], stride)]
            kept = []
            for j, t in enumerate(row):
                # blended in place, like diffusers: the next row blends against these modified tiles
                if i > 0:
                    _blend_v(prev[j], t, blend)
                if j > 0:
                    _blend_h(row[j - 1], t, blend)
                kept.append(t[:, :, :keep, :keep])
            out_rows.append(torch.cat(kept, dim=3))
            prev = row
        return torch.cat(out_rows, dim=2)

    def _check_dtype(self, t: Tensor, what: str) -> None:
        want = self._param_dtype()
        if t.dtype != want:
            raise ValueError(f"{what} is {t.dtype} but the VAE weights are {want}; cast it first")


class Flux1VAE(KLAutoencoder[VAEConfig]):
    """The FLUX.1 autoencoder: `encode` images to raw latents, `decode` raw latents to images.

    Images are in [-1, 1]; raw latents are what diffusers' `AutoencoderKL.encode` returns and
    `decode` takes. Use `scale_latents` / `unscale_latents` to go to and from the DiT's latents.
    """

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__(cfg, Encoder(cfg), Decoder(cfg))

    def scale_latents(self, z: Tensor) -> Tensor:
        """Raw latent → DiT latent: `(z - shift_factor) * scale_factor` (diffusers' img2img order)."""
        return (z - self.config.shift_factor) * self.config.scale_factor

    def unscale_latents(self, z: Tensor) -> Tensor:
        """DiT latent → raw latent: `z / scale_factor + shift_factor` (diffusers' order before decode)."""
        return (z / self.config.scale_factor) + self.config.shift_factor


def _blend_v(a: Tensor, b: Tensor, extent: int) -> None:
    """Fade the top rows of `b` in from the bottom rows of `a` (in place; diffusers' `blend_v`)."""
    extent = min(a.shape[2], b.shape[2], extent)
    for y in range(extent):
        b[:, :, y, :] = a[:, :, -extent + y, :] * (1 - y / extent) + b[:, :, y, :] * (y / extent)


def _blend_h(a: Tensor, b: Tensor, extent: int) -> None:
    """Fade the left columns of `b` in from the right columns of `a` (in place; diffusers' `blend_h`)."""
    extent = min(a.shape[3], b.shape[3], extent)
    for x in range(extent):
        b[:, :, :, x] = a[:, :, :, -extent + x] * (1 - x / extent) + b[:, :, :, x] * (x / extent)
