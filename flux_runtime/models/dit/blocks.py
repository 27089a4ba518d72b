"""The blocks of the FLUX.1 and FLUX.2 transformers, built the same way in both generations (FLUX.3's final layer
too): the weights under Black Forest Labs' names and the steps of their forwards. Each family adds what differs:
where the modulation comes from (per block in FLUX.1, shared in FLUX.2), the MLP activation (tanh-GELU or SwiGLU
over `[gate | up]`) and the single block's projection into it (flux1.py, flux2.py).

- `SelfAttention`, `double_stream`: a double block's streams and their joint attention over `[txt | img]`;
- `Modulation`, `MLP`, `DoubleStreamBlock`, `SingleStreamBlock`, `LastLayer`: the blocks' weights and shared steps;
- `JointTransformer`: what both transformers do around the blocks: the config check, RoPE over `[txt | img]`, the
  time (and guidance) embedding, the input checks and the run through the double and single blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn

from flux_runtime import kernels
from flux_runtime.kernels.attention_backends import record_attention
from flux_runtime.kernels.attention_quant import Fp8Heads
from flux_runtime.models.dit.config import DiTConfig
from flux_runtime.models.dit.fp8_attention import attention_choice, double_fp8, rotate_fp8, single_fp8_heads
from flux_runtime.models.dit.layers import (
    EPS,
    AnyLinear,
    Attend,
    Linear,
    ModulationOut,
    Pending,
    QKNorm,
    RoPE,
    Stream,
    attention,
    clip_fp16,
    materialize,
    norm_modulate,
    quantizes_per_row,
    rope_tables,
    sdpa,
    shared_ids,
    timestep_embedding,
    write_heads,
)
from flux_runtime.models.dit.residuals import ControlResiduals, add_image_residual, add_residual
from flux_runtime.models.dit.step_hook import StepHook


class SelfAttention(nn.Module):
    """Projection weights of one double-block stream: fused `qkv`, its QK RMSNorm and the output `proj`."""

    def __init__(self, dim: int, num_heads: int, bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv: AnyLinear = Linear(dim, 3 * dim, bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj: AnyLinear = Linear(dim, dim, bias)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as (B, L, H, Dh) from the modulated stream `x` (B, L, D).

        diffusers runs `to_q`, `to_k`, `to_v` separately; `Linear.split` gives those bits.
        """
        d = self.qkv.in_features
        return tuple(t.unflatten(-1, (self.num_heads, -1)) for t in self.qkv.split(x, (d, d, d)))


def _rows(x: Stream) -> int:
    """Tokens in a stream (B, L, D)."""
    return (x.update if isinstance(x, Pending) else x).shape[1]


def double_stream(
    block: nn.Module,
    img: Stream,
    txt: Stream,
    img_mods: tuple[ModulationOut, ...],
    txt_mods: tuple[ModulationOut, ...],
    pe: RoPE,
    image_prompt: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> tuple[Stream, Stream]:
    """The double-stream block of both FLUX generations: image and text weights apart, one joint attention.

    `block` holds `img_attn`, `txt_attn` (SelfAttention), `img_mlp`, `txt_mlp` and `attend`; the two
    modulation pairs come from the block (FLUX.1) or are shared by all blocks (FLUX.2). `image_prompt`
    (FLUX.1 with an IP-Adapter, `ip_adapter.ImagePrompt.attention`; None on the plain path): what the image
    stream gains from the image query (unnormed) and the query-norm weight, added after the MLP residual.
    """
    (img_mod1, img_mod2), (txt_mod1, txt_mod2) = img_mods, txt_mods

    # prepare img and txt for attention
    n_img, n_txt = _rows(img), _rows(txt)
    img, img_n = norm_modulate(img, img_mod1, block.img_attn.qkv.act_quant)
    txt, txt_n = norm_modulate(txt, txt_mod1, block.txt_attn.qkv.act_quant)
    img_q, img_k, img_v = block.img_attn.project(img_n)
    txt_q, txt_k, txt_v = block.txt_attn.project(txt_n)

    choice = attention_choice(block, img_q)
    if choice.fp8:  # the high tier's FP8 attention (`fp8_attention`)
        joint = double_fp8(block, (txt_q, txt_k, txt_v), (img_q, img_k, img_v), pe)
    else:
        record_attention(choice)
        # joint attention, text first: (B, L_txt + L_img, H, Dh), each stored head-major where
        # `kernels.is_head_major` says (SDPA then reads it contiguously)
        img_norm, txt_norm = block.img_attn.norm, block.txt_attn.norm
        major_q, major_k, major_v = (kernels.is_head_major(role) for role in "qkv")
        q = kernels.qk_norm_rope(
            txt_q, img_q, txt_norm.query_norm.scale, img_norm.query_norm.scale, *pe, EPS, major_q
        )
        k = kernels.qk_norm_rope(
            txt_k, img_k, txt_norm.key_norm.scale, img_norm.key_norm.scale, *pe, EPS, major_k
        )
        # joint V: two strided copies (the merged-QKV views) are cheaper on the GPU than torch.cat of them; they
        # write the head-major storage as directly as the token-major one
        b, _, h, dh = txt_v.shape
        v = kernels.empty_heads(
            b, n_txt + n_img, h, dh, dtype=txt_v.dtype, device=txt_v.device, head_major=major_v
        )
        v[:, :n_txt].copy_(txt_v)
        v[:, n_txt:].copy_(img_v)
        joint = block.attend(q, k, v)
    txt_attn, img_attn = joint.split_with_sizes([n_txt, n_img], dim=1)

    # diffusers' IP-Adapter processor projects the attention's views as they are, its plain one copies them
    # contiguous first (on the CPU a batch rounds differently): with an image prompt, as the former
    img_out, txt_out = (
        (block.img_attn.proj.from_view(img_attn), block.txt_attn.proj.from_view(txt_attn))
        if image_prompt is None
        else (block.img_attn.proj(img_attn), block.txt_attn.proj(txt_attn))
    )

    # image stream: attention residual, then MLP residual (both left pending)
    img = Pending(img, img_mod1.gate, img_out)
    img, img_n = norm_modulate(img, img_mod2, block.img_mlp[0].act_quant)
    img = Pending(img, img_mod2.gate, block.img_mlp(img_n))
    if image_prompt is not None:  # IP-Adapter: added last, onto the written stream, as diffusers adds it
        img = materialize(img) + image_prompt(img_q, img_norm.query_norm.scale)

    # text stream
    txt = Pending(txt, txt_mod1.gate, txt_out)
    txt, txt_n = norm_modulate(txt, txt_mod2, block.txt_mlp[0].act_quant)
    txt = clip_fp16(Pending(txt, txt_mod2.gate, block.txt_mlp(txt_n)))
    return img, txt


class Modulation(nn.Module):
    """adaLN projection `lin(silu(vec))`: two (shift, scale, gate) triples (double blocks) or one (single)."""

    def __init__(self, dim: int, double: bool, bias: bool) -> None:
        super().__init__()
        self.multiplier = 6 if double else 3
        self.lin = Linear(dim, self.multiplier * dim, bias)

    def forward(self, vec_act: Tensor) -> tuple[ModulationOut, ...]:
        # vec_act = silu(vec), (B, D)
        return self.triples(self.lin(vec_act))

    def triples(self, raw: Tensor) -> tuple[ModulationOut, ...]:
        """Chunk a projection (B, k*D) in BFL/diffusers order: shift, scale, gate (x2 for double blocks)."""
        out = raw.chunk(self.multiplier, dim=1)
        return tuple(ModulationOut(*out[i : i + 3]) for i in range(0, self.multiplier, 3))


class MLP(nn.Sequential):
    """`0: Linear → activation → 2: Linear`, BFL's `img_mlp` / `txt_mlp`; the family's `activation`."""

    def __init__(self, dim: int, hidden: int, inner: int, bias: bool) -> None:
        """`inner`: the width of `0`'s output (`hidden`, or `2 * hidden` for a gated activation)."""
        super().__init__()
        self.add_module("0", Linear(dim, inner, bias))
        self.add_module("2", Linear(hidden, dim, bias))

    def forward(self, x: Tensor | kernels.Fp8Act) -> Tensor:
        quant = self[1].act_quant
        return self[1](self.activation(self[0](x), quant))

    def activation(self, h: Tensor, quant: kernels.Fp8Quant | None) -> Tensor | kernels.Fp8Act:
        """The activation of `0`'s output; with `quant` (the FP8 `2`'s) written in e4m3 as it is formed."""
        raise NotImplementedError


class DoubleStreamBlock(nn.Module):
    """Separate image and text weights, one joint attention over `[txt | img]` (`double_stream`).

    `img_attn`, `img_mlp`, `txt_attn`, `txt_mlp`; with `own_modulation` (FLUX.1) each stream's `img_mod` /
    `txt_mod` first, else the modulation comes from outside (FLUX.2).
    """

    attend: Attend = staticmethod(attention)  # full attention; replaced per block in a sequence-parallel run

    def __init__(self, cfg: DiTConfig, mlp: Callable[[int, int], MLP], *, own_modulation: bool) -> None:
        super().__init__()
        d = cfg.hidden_size
        if own_modulation:
            self.img_mod = Modulation(d, double=True, bias=True)
        self.img_attn = SelfAttention(d, cfg.num_heads, cfg.qkv_bias)
        self.img_mlp = mlp(d, cfg.mlp_hidden_dim)
        if own_modulation:
            self.txt_mod = Modulation(d, double=True, bias=True)
        self.txt_attn = SelfAttention(d, cfg.num_heads, cfg.qkv_bias)
        self.txt_mlp = mlp(d, cfg.mlp_hidden_dim)


class SingleStreamBlock(nn.Module):
    """Parallel attention and MLP on the joint stream: `linear1` → [q|k|v|mlp input], `linear2` ← [attn|mlp].

    `mlp_in`: the width of linear1's MLP part (`mlp_hidden_dim`, or twice it for SwiGLU's `[gate | up]`).
    """

    attend: Attend = staticmethod(attention)  # full attention; replaced per block in a sequence-parallel run

    def __init__(self, cfg: DiTConfig, mlp_in: int, bias: bool) -> None:
        super().__init__()
        d, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.mlp_hidden_dim = cfg.mlp_hidden_dim
        self.linear1 = Linear(d, 3 * d + mlp_in, cfg.qkv_bias)
        self.linear2 = Linear(d + self.mlp_hidden_dim, d, bias)
        self.norm = QKNorm(cfg.head_dim)

    def heads(self, *xs: Tensor) -> tuple[Tensor, ...]:
        """Each of `xs` (B, L, D) as (B, L, H, Dh) heads (a view)."""
        return tuple(t.unflatten(-1, (self.num_heads, -1)) for t in xs)

    def rotate(self, x: Tensor, role: str, pe: RoPE) -> Tensor:
        """q or k heads (`role`) RMS-normed with this block's weight and rotated, stored head-major where
        `kernels.is_head_major(role)` says (v stays a view of linear1's output)."""
        weight = self.norm.query_norm.scale if role == "q" else self.norm.key_norm.scale
        if attention_choice(self, x).fp8:  # the high tier's FP8 attention: written in e4m3 (`fp8_attention`)
            return rotate_fp8(x, weight, role, pe)  # type: ignore[return-value]
        return kernels.qk_norm_rope(None, x, None, weight, *pe, EPS, kernels.is_head_major(role))

    def rows_fp8(self) -> bool:
        """Whether linear2 quantizes per row under full attention: its scales span `[attn | mlp]`, so the
        activation and both halves are quantized in one pass after attention (`attention_act_fp8`)."""
        return quantizes_per_row(self.linear2) and self.attend is attention

    def out_rows_fp8(
        self, x: Tensor, gate: Tensor, q: Tensor, k: Tensor, v: Tensor, mlp: Tensor, activation: str
    ) -> Stream:
        """The gated residual through linear2 from attention and the MLP input `mlp`, both quantized in one
        pass (no 16-bit buffer); `activation` as `attention_act_fp8` names it."""
        act = kernels.attention_act_fp8(self.attention_heads(q, k, v), mlp, activation)
        return clip_fp16(Pending(x, gate, self.linear2(act)))

    def out_buffer(self, x: Tensor, gate: Tensor, q: Tensor, k: Tensor, v: Tensor, h: Tensor) -> Stream:
        """The gated residual through linear2 from `h` (B, L, D + M), whose MLP half is written: attention
        goes into its first D columns in place (no concat), e4m3 when linear2 reads a static quantization."""
        out, quant = h[..., : self.linear1.in_features], self.linear2.act_quant
        if isinstance(q, Fp8Heads):
            write_heads(self.attention_heads(q, k, v), out, quant)
        else:
            record_attention(attention_choice(self, v))
            self.attend(q, k, v, out=out, quant=quant)
        return clip_fp16(Pending(x, gate, self.linear2(h)))

    def attention_heads(self, q: Tensor | Fp8Heads, k: Tensor | Fp8Heads, v: Tensor) -> Tensor:
        """Full attention's heads (B, L, H, D): FP8 when `rotate` wrote q and k in e4m3, else SDPA."""
        if isinstance(q, Fp8Heads):
            assert isinstance(k, Fp8Heads)
            return single_fp8_heads(q, k, v)
        record_attention(attention_choice(self, v))
        return sdpa(q, k, v)


class LastLayer(nn.Module):
    """Final adaLN (BFL order: shift, scale) and the projection back to latent channels."""

    def __init__(self, dim: int, out_channels: int, bias: bool = True) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), Linear(dim, 2 * dim, bias))
        self.linear = Linear(dim, out_channels, bias)

    def project(self, x: Stream, raw: Tensor) -> Tensor:
        """`linear(LayerNorm(x) * (1 + scale) + shift)` for `raw` = adaLN's projection (B, 2D) of this step."""
        shift, scale = raw.chunk(2, dim=1)
        _, x = norm_modulate(x, ModulationOut(shift, scale, gate=shift))
        return self.linear(x)


class JointTransformer(nn.Module):
    """What the FLUX.1 and FLUX.2 transformers do around their blocks; the family builds the modules.

    `family` is the config family it takes; `variants` names its models with and without a guidance
    embedding (for messages). Subclasses build `time_in`, `guidance_in` and their other inputs, then
    `add_blocks`.
    """

    family: ClassVar[str]
    variants: ClassVar[tuple[str, str]]
    # the family's double block, single block (each built from the config) and final layer (dim, out_channels)
    block_types: ClassVar[
        tuple[Callable[[DiTConfig], nn.Module], Callable[[DiTConfig], nn.Module], Callable[..., nn.Module]]
    ]
    time_in: nn.Module
    guidance_in: nn.Module

    # a sampling branch's step cache while the pipeline runs one (`models.dit.step_hook`); None: plain forwards
    step_hook: StepHook | None = None

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        if cfg.family != self.family:
            raise ValueError(f"{type(self).__name__} needs a {self.family} config, got family {cfg.family!r}")
        self.config = cfg

    def add_blocks(self) -> None:
        """`double_blocks`, `single_blocks` (the config's depths of `block_types`) and `final_layer`."""
        double, single, last = self.block_types
        cfg = self.config
        self.double_blocks = nn.ModuleList(double(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(single(cfg) for _ in range(cfg.depth_single_blocks))
        self.final_layer = last(cfg.hidden_size, cfg.out_channels)

    def rope(self, txt_ids: Tensor, img_ids: Tensor) -> RoPE:
        """RoPE tables for the joint sequence `[txt | img]`; build once per image size, pass as `pe`.

        Ids are (L, n_axes) or (B, L, n_axes) (n_axes = len(config.axes_dim)); positions are shared across
        the batch, as in diffusers.
        """
        n = len(self.config.axes_dim)
        txt_ids, img_ids = shared_ids(txt_ids, "txt_ids", n), shared_ids(img_ids, "img_ids", n)
        return rope_tables(torch.cat([txt_ids, img_ids], dim=0), self.config.axes_dim, self.config.theta)

    def embed_times(
        self, timesteps: Tensor, guidance: Tensor | None, dtype: torch.dtype, embed_dtype: torch.dtype
    ) -> Tensor:
        """`time_in(t)` (+ `guidance_in(g)` when the model embeds guidance), rounded as diffusers: t*1000 (and
        g*1000) in `dtype`, each sinusoid cast to `embed_dtype` before its embedder."""
        t = timesteps.to(dtype) * 1000
        vec = self.time_in(timestep_embedding(t).to(embed_dtype))
        if self.config.guidance_embed:
            assert guidance is not None  # checked
            g = guidance.to(dtype) * 1000
            vec = vec + self.guidance_in(timestep_embedding(g).to(embed_dtype))
        return vec

    def run_blocks(
        self, img: Tensor, txt: Tensor, double: tuple, single: tuple, pe: RoPE,
        finish: Callable[[Stream], Tensor], control: ControlResiduals | None = None,
    ) -> Tensor:  # fmt: skip
        """The embedded streams through the double blocks (`block(img, txt, *double, pe)`), then joined
        `[txt | img]` through the single blocks (`block(x, *single, pe)`), and `finish` (the final layer) on the
        image rows of the result, a pending residual left pending. `control`: ControlNet residuals added to the
        image states after each block."""
        hook = self.step_hook
        probe = -1 if hook is None else hook.probe_blocks
        img_s: Stream = img
        txt_s: Stream = txt
        n_double, n_single = len(self.double_blocks), len(self.single_blocks)
        for k, block in enumerate(self.double_blocks):
            img_s, txt_s = block(img_s, txt_s, *double, pe)
            if control is not None:
                img_s = add_residual(img_s, control.after_double(k, n_double))
            if k + 1 == probe:  # step caching: the probe's image tokens decide whether the rest runs
                assert hook is not None
                reused = hook.at_probe(img, materialize(img_s), finish)
                if reused is not None:
                    return reused

        # (B, L_txt + L_img, D)
        x: Stream = torch.cat([materialize(txt_s), materialize(img_s)], dim=1)
        n_txt = txt.shape[1]
        for k, block in enumerate(self.single_blocks):
            x = block(x, *single, pe)
            if control is not None:
                x = add_image_residual(x, n_txt, control.after_single(k, n_single))

        out: Stream = (
            Pending(x.residual[:, n_txt:], x.gate, x.update[:, n_txt:])
            if isinstance(x, Pending)
            else x[:, n_txt:]
        )
        if hook is not None:
            hook.after_rest(materialize(out))
        return finish(out)

    @property
    def max_probe_blocks(self) -> int:
        """The most leading blocks a step cache may probe with: the double blocks (the rest must hold a block)."""
        return len(self.double_blocks)

    def check_inputs(
        self, img: Tensor, txt: Tensor, timesteps: Tensor, guidance: Tensor | None, y: Tensor | None = None
    ) -> None:
        """A ValueError naming the first input of the wrong shape (`y`, the pooled vector, where the model
        reads one), or a guidance passed to a model without its embedding or missing from one with it."""
        cfg = self.config
        b = check_tokens(img, "img", cfg.in_channels)
        check_tokens(txt, "txt", cfg.context_in_dim, b)
        if cfg.vec_in_dim:
            check_shape(y, "y", (b, cfg.vec_in_dim))
        check_shape(timesteps, "timesteps", (b,))
        guided, unguided = self.variants
        if cfg.guidance_embed:
            if guidance is None:
                raise ValueError(f"this model embeds guidance ({guided}): pass guidance (B,)")
            check_shape(guidance, "guidance", (b,))
        elif guidance is not None:
            raise ValueError(f"this model has no guidance embedding ({unguided}): pass guidance=None")


def check_tokens(x: Tensor, name: str, width: int, batch: int | None = None) -> int:
    """A ValueError unless `x` is (batch, L, width) (any batch when None); returns the batch."""
    if x.ndim != 3 or x.shape[-1] != width or batch not in (None, x.shape[0]):
        raise ValueError(
            f"{name} must be ({'B' if batch is None else batch}, L, {width}), got {tuple(x.shape)}"
        )
    return x.shape[0]


def check_shape(x: Tensor | None, name: str, shape: tuple[int, ...]) -> None:
    """A ValueError unless `x` has `shape`."""
    if x is None or x.shape != shape:
        raise ValueError(f"{name} must be {shape}, got {None if x is None else tuple(x.shape)}")
