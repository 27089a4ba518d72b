"""The FLUX.2 [dev] / [klein] diffusion transformer.

Module names equal Black Forest Labs' flux2 checkpoint keys (`double_stream_modulation_img.lin`,
`double_blocks.N.img_mlp.0`, `single_blocks.N.linear1`, ...), so a BFL file loads with no key map.
The forward pass reproduces diffusers 0.42.1 `Flux2Transformer2DModel` op for op
. What differs from FLUX.1 (flux1.py):

- no biases anywhere and no pooled text vector: the conditioning vector is time (+ guidance for dev);
- modulation is shared: three projections of that vector, computed once per forward, feed every
  double block (`double_stream_modulation_img` / `_txt`) and every single block (`single_stream_modulation`);
- the feed-forward is SwiGLU over a fused `[gate | up]` projection;
- single blocks run one GEMM into `[q | k | v | gate | up]` and one out of `[attn | mlp]`, exactly as diffusers;
- RoPE has four axes (t, h, w, l) of 32 channels each, theta 2000, and the ids are integers.

Elementwise chains go through `flux_runtime.kernels`, and gated residuals are handed to the next
norm as `Pending` triples, as in flux1.py (whose stream helpers this file reuses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime import kernels
from flux_runtime.kernels.swiglu import swiglu
from flux_runtime.models.dit.config import DiTConfig
from flux_runtime.models.dit.layers import (
    EPS,
    Attend,
    Linear,
    MLPEmbedder,
    ModulationOut,
    Pending,
    QKNorm,
    RoPE,
    SelfAttention,
    Stream,
    attention,
    clip_fp16,
    double_stream,
    materialize,
    norm_modulate,
    quantizes_per_row,
    rope_tables,
    sdpa,
    shared_ids,
    timestep_embedding,
)


class Modulation(nn.Module):
    """Shared adaLN projection `lin(silu(vec))`: two triples (double blocks) or one (single blocks)."""

    def __init__(self, dim: int, double: bool) -> None:
        super().__init__()
        self.multiplier = 6 if double else 3
        self.lin = Linear(dim, self.multiplier * dim, bias=False)

    def forward(self, vec_act: Tensor) -> tuple[ModulationOut, ...]:
        # vec_act = silu(vec), (B, D); chunks in BFL/diffusers order: shift, scale, gate (x2).
        out = self.lin(vec_act).chunk(self.multiplier, dim=1)
        return tuple(ModulationOut(*out[i : i + 3]) for i in range(0, self.multiplier, 3))


class MLP(nn.Sequential):
    """`0: Linear → SwiGLU → 2: Linear`, BFL's `img_mlp` / `txt_mlp` (diffusers `ff.linear_in/out`)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.add_module("0", Linear(dim, 2 * hidden, bias=False))  # rows [gate | up]
        self.add_module("2", Linear(hidden, dim, bias=False))

    def forward(self, x: Tensor | kernels.Fp8Act) -> Tensor:
        quant = self[1].act_quant
        if quant is None:
            return self[1](swiglu(self[0](x)))
        return self[1](kernels.swiglu_fp8(self[0](x), *quant))


class DoubleStreamBlock(nn.Module):
    """Separate image and text weights, one joint attention over `[txt | img]`, modulation from outside."""

    attend: Attend = staticmethod(attention)  # full attention; replaced per block in a sequence-parallel run

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.img_attn = SelfAttention(d, cfg.num_heads, bias=False)
        self.img_mlp = MLP(d, cfg.mlp_hidden_dim)
        self.txt_attn = SelfAttention(d, cfg.num_heads, bias=False)
        self.txt_mlp = MLP(d, cfg.mlp_hidden_dim)

    def forward(
        self,
        img: Stream,
        txt: Stream,
        mod_img: tuple[ModulationOut, ...],
        mod_txt: tuple[ModulationOut, ...],
        pe: RoPE,
    ) -> tuple[Stream, Stream]:
        return double_stream(self, img, txt, mod_img, mod_txt, pe)


class SingleStreamBlock(nn.Module):
    """Parallel attention and SwiGLU MLP: `linear1` → [q|k|v|gate|up], `linear2` ← [attn|mlp]."""

    attend: Attend = staticmethod(attention)

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        d, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.mlp_hidden_dim = cfg.mlp_hidden_dim
        self.linear1 = Linear(d, 3 * d + 2 * self.mlp_hidden_dim, bias=False)
        self.linear2 = Linear(d + self.mlp_hidden_dim, d, bias=False)
        self.norm = QKNorm(cfg.head_dim)

    def forward(self, x: Stream, mod: ModulationOut, pe: RoPE) -> Stream:
        x, x_n = norm_modulate(x, mod, self.linear1.act_quant)
        # one GEMM, split as diffusers splits it: (B, L, 3D) attention, (B, L, 2M) [gate | up]
        qkv, mlp = self.linear1(x_n).split([3 * self.linear1.in_features, 2 * self.mlp_hidden_dim], dim=-1)
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)) for t in qkv.chunk(3, dim=-1))
        # q and k stored head-major where `kernels.is_head_major` says; v stays a view of linear1's output
        major_q, major_k = kernels.is_head_major("q"), kernels.is_head_major("k")
        q = kernels.qk_norm_rope(None, q, None, self.norm.query_norm.scale, *pe, EPS, major_q)
        k = kernels.qk_norm_rope(None, k, None, self.norm.key_norm.scale, *pe, EPS, major_k)
        d, quant = self.linear1.in_features, self.linear2.act_quant
        if quantizes_per_row(self.linear2) and self.attend is attention:
            # per-row scales span [attn | mlp]: both halves quantized in one pass, no 16-bit buffer
            act = kernels.attention_act_fp8(sdpa(q, k, v), mlp, "swiglu")
            return clip_fp16(Pending(x, mod.gate, self.linear2(act)))
        # (B, L, D + M): attention first, MLP second, each written in place (no concat); e4m3 when
        # linear2 reads a statically quantized input
        h = self.linear2.input_buffer(x, d + self.mlp_hidden_dim)
        if h.dtype == kernels.fp8.E4M3:
            kernels.swiglu_fp8(mlp, *quant, out=h[..., d:])
        else:
            swiglu(mlp, out=h[..., d:])
        self.attend(q, k, v, out=h[..., :d], quant=quant)
        return clip_fp16(Pending(x, mod.gate, self.linear2(h)))


class LastLayer(nn.Module):
    """Final adaLN (BFL order: shift, scale) and the projection back to latent channels."""

    def __init__(self, dim: int, out_channels: int) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), Linear(dim, 2 * dim, bias=False))
        self.linear = Linear(dim, out_channels, bias=False)

    def forward(self, x: Stream, vec_act: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation[1](vec_act).chunk(2, dim=1)
        _, x = norm_modulate(x, ModulationOut(shift, scale, gate=shift))
        return self.linear(x)


class Flux2Transformer(nn.Module):
    """FLUX.2 DiT: `model(img, img_ids, txt, txt_ids, timesteps, guidance)` → velocity (B, L_img, C).

    Same call as `Flux1Transformer` minus the pooled vector `y`: FLUX.2 conditions on time (and,
    for [dev], guidance) only. Position ids have four axes (t, h, w, l).
    """

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        if cfg.family != "flux2":
            raise ValueError(f"Flux2Transformer needs a flux2 config, got family {cfg.family!r}")
        self.config = cfg
        d = cfg.hidden_size
        self.img_in = Linear(cfg.in_channels, d, bias=False)
        self.txt_in = Linear(cfg.context_in_dim, d, bias=False)
        self.time_in = MLPEmbedder(256, d, bias=False)
        self.guidance_in = MLPEmbedder(256, d, bias=False) if cfg.guidance_embed else nn.Identity()
        self.double_stream_modulation_img = Modulation(d, double=True)
        self.double_stream_modulation_txt = Modulation(d, double=True)
        self.single_stream_modulation = Modulation(d, double=False)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.depth_single_blocks))
        self.final_layer = LastLayer(d, cfg.out_channels)

    def rope(self, txt_ids: Tensor, img_ids: Tensor) -> RoPE:
        """RoPE tables for the joint sequence `[txt | img]`; build once per image size, pass as `pe`.

        Ids are (L, 4) or (B, L, 4) integer positions (t, h, w, l): text `(0, 0, 0, l)`, image
        `(0, i, j, 0)`, reference image k `(10 + 10k, i, j, 0)`. Shared across the batch, as in diffusers.
        """
        n = len(self.config.axes_dim)
        txt_ids, img_ids = shared_ids(txt_ids, "txt_ids", n), shared_ids(img_ids, "img_ids", n)
        return rope_tables(torch.cat([txt_ids, img_ids], dim=0), self.config.axes_dim, self.config.theta)

    def forward(
        self,
        img: Tensor,
        img_ids: Tensor,
        txt: Tensor,
        txt_ids: Tensor,
        timesteps: Tensor,
        guidance: Tensor | None = None,
        pe: RoPE | None = None,
    ) -> Tensor:
        """Predict the flow velocity.

        img (B, L_img, in_channels) packed latents (noise tokens, then any reference tokens);
        txt (B, L_txt, context_in_dim) stacked text-encoder states, padding included; timesteps (B,)
        in [0, 1]; guidance (B,) for [dev], None for [klein]; pe optional precomputed
        `rope(txt_ids, img_ids)`. Returns (B, L_img, out_channels) in the dtype of `img`.
        """
        self._check_inputs(img, txt, timesteps, guidance)
        if pe is None:
            pe = self.rope(txt_ids, img_ids)

        # conditioning vector, rounded as diffusers: t*1000 (and g*1000) in the model dtype, the
        # sinusoid cast to it before each embedder, t + g
        t = timesteps.to(img.dtype) * 1000
        vec = self.time_in(timestep_embedding(t).to(t.dtype))
        if self.config.guidance_embed:
            assert guidance is not None  # checked above
            g = guidance.to(img.dtype) * 1000
            vec = vec + self.guidance_in(timestep_embedding(g).to(g.dtype))
        vec_act = F.silu(vec)

        # shared modulation: once per forward, the same tensors for every block
        mod_img = self.double_stream_modulation_img(vec_act)
        mod_txt = self.double_stream_modulation_txt(vec_act)
        (mod_single,) = self.single_stream_modulation(vec_act)

        img = self.img_in(img)
        txt = self.txt_in(txt)
        img_s: Stream = img
        txt_s: Stream = txt
        for block in self.double_blocks:
            img_s, txt_s = block(img_s, txt_s, mod_img, mod_txt, pe)

        # (B, L_txt + L_img, D)
        x: Stream = torch.cat([materialize(txt_s), materialize(img_s)], dim=1)
        for block in self.single_blocks:
            x = block(x, mod_single, pe)

        n_txt = txt.shape[1]
        img_s = (
            Pending(x.residual[:, n_txt:], x.gate, x.update[:, n_txt:])
            if isinstance(x, Pending)
            else x[:, n_txt:]
        )
        return self.final_layer(img_s, vec_act.to(img.dtype))

    def _check_inputs(self, img: Tensor, txt: Tensor, timesteps: Tensor, guidance: Tensor | None) -> None:
        cfg = self.config
        if img.ndim != 3 or img.shape[-1] != cfg.in_channels:
            raise ValueError(f"img must be (B, L, {cfg.in_channels}), got {tuple(img.shape)}")
        b = img.shape[0]
        if txt.ndim != 3 or txt.shape[0] != b or txt.shape[-1] != cfg.context_in_dim:
            raise ValueError(f"txt must be ({b}, L, {cfg.context_in_dim}), got {tuple(txt.shape)}")
        if timesteps.shape != (b,):
            raise ValueError(f"timesteps must be ({b},), got {tuple(timesteps.shape)}")
        if cfg.guidance_embed:
            if guidance is None:
                raise ValueError("this model embeds guidance (FLUX.2 [dev]): pass guidance (B,)")
            if guidance.shape != (b,):
                raise ValueError(f"guidance must be ({b},), got {tuple(guidance.shape)}")
        elif guidance is not None:
            raise ValueError("this model has no guidance embedding (FLUX.2 [klein]): pass guidance=None")
