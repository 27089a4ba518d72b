"""The FLUX.1 [dev] / [schnell] diffusion transformer.

Module names equal Black Forest Labs' checkpoint keys (`double_blocks.N.img_attn.qkv`, ...), so a
BFL file loads with no key map. The forward pass reproduces diffusers 0.42.1
`FluxTransformer2DModel` op for op: every elementwise chain is one
call into `flux_runtime.kernels`, whose reference is that chain, and gated residuals are handed to
the next norm as `Pending` triples so a fused kernel can materialise them in the same pass.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flux_runtime import kernels
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
    timestep_embedding,
)


class Modulation(nn.Module):
    """adaLN projection of the conditioning vector: two triples (double blocks) or one (single)."""

    def __init__(self, dim: int, double: bool) -> None:
        super().__init__()
        self.multiplier = 6 if double else 3
        self.lin = Linear(dim, self.multiplier * dim)

    def forward(self, vec_act: Tensor) -> tuple[ModulationOut, ...]:
        # vec_act = silu(vec), (B, D)
        return self.triples(self.lin(vec_act))

    def triples(self, raw: Tensor) -> tuple[ModulationOut, ...]:
        """Chunk a projection (B, k*D) in BFL/diffusers order: shift, scale, gate (x2 for double blocks)."""
        out = raw.chunk(self.multiplier, dim=1)
        return tuple(ModulationOut(*out[i : i + 3]) for i in range(0, self.multiplier, 3))


class ModulationSource:
    """Where the blocks' adaLN projections come from in one forward.

    Live (`table=None`): each block projects `silu(vec)` itself, as diffusers does. From a table: each
    block slices its projection out of `table` (B, total), which `Flux1Transformer.modulation_table`
    computed for every step of a generation at once (the `high` tier: one batched GEMM per projection
    instead of one GEMV per step; cuBLAS rounds a batched GEMM differently, so it is not lossless).
    """

    def __init__(
        self, vec_act: Tensor | None, table: Tensor | None, offsets: dict[int, tuple[int, int]]
    ) -> None:
        self.vec_act, self.table, self.offsets = vec_act, table, offsets

    def raw(self, lin: nn.Module) -> Tensor:
        if self.table is None:
            assert self.vec_act is not None
            return lin(self.vec_act)
        start, stop = self.offsets[id(lin)]
        return self.table[:, start:stop]

    def __call__(self, mod: Modulation) -> tuple[ModulationOut, ...]:
        return mod.triples(self.raw(mod.lin))


class MLP(nn.Sequential):
    """`0: Linear → GELU(tanh) → 2: Linear`, BFL's `img_mlp` / `txt_mlp`."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.add_module("0", Linear(dim, hidden))
        self.add_module("2", Linear(hidden, dim))

    def forward(self, x: Tensor | kernels.Fp8Act) -> Tensor:
        quant = self[1].act_quant
        if quant is None:
            return self[1](kernels.gelu_tanh(self[0](x)))
        return self[1](kernels.gelu_tanh_fp8(self[0](x), *quant))


class DoubleStreamBlock(nn.Module):
    """Separate image and text weights, one joint attention over `[txt | img]`."""

    attend: Attend = staticmethod(attention)  # full attention; replaced per block in a sequence-parallel run

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.img_mod = Modulation(d, double=True)
        self.img_attn = SelfAttention(d, cfg.num_heads, cfg.qkv_bias)
        self.img_mlp = MLP(d, cfg.mlp_hidden_dim)
        self.txt_mod = Modulation(d, double=True)
        self.txt_attn = SelfAttention(d, cfg.num_heads, cfg.qkv_bias)
        self.txt_mlp = MLP(d, cfg.mlp_hidden_dim)

    def forward(self, img: Stream, txt: Stream, mods: ModulationSource, pe: RoPE) -> tuple[Stream, Stream]:
        return double_stream(self, img, txt, mods(self.img_mod), mods(self.txt_mod), pe)


class SingleStreamBlock(nn.Module):
    """Parallel attention and MLP on the joint stream: `linear1` → [q|k|v|mlp], `linear2` ← [attn|mlp]."""

    attend: Attend = staticmethod(attention)

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        d, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.mlp_hidden_dim = cfg.mlp_hidden_dim
        self.linear1 = Linear(d, 3 * d + self.mlp_hidden_dim, cfg.qkv_bias)
        self.linear2 = Linear(d + self.mlp_hidden_dim, d)
        self.norm = QKNorm(cfg.head_dim)
        self.modulation = Modulation(d, double=False)

    def forward(self, x: Stream, mods: ModulationSource, pe: RoPE) -> Stream:
        (mod,) = mods(self.modulation)
        x, x_n = norm_modulate(x, mod, self.linear1.act_quant)
        d, m = self.linear1.in_features, self.mlp_hidden_dim
        quant = self.linear2.act_quant
        if quantizes_per_row(self.linear2) and self.attend is attention:
            # per-row scales span [attn | mlp]: GELU and both halves quantized in one pass after attention
            h = None
            q, k, v, mlp = self.linear1.split(x_n, (d, d, d, m))
        else:
            # (B, L, D + mlp_hidden): attention first, MLP second, each written in place (no concat);
            # e4m3 when linear2 reads a statically quantized input
            h = self.linear2.input_buffer(x, d + m)
            q, k, v, _ = self.linear1.split(
                x_n, (d, d, d, m), gelu_last=True, gelu_out=h[..., d:], gelu_quant=quant
            )
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)) for t in (q, k, v))
        # q and k stored head-major where `kernels.is_head_major` says; v stays a view of linear1's output
        major_q, major_k = kernels.is_head_major("q"), kernels.is_head_major("k")
        q = kernels.qk_norm_rope(None, q, None, self.norm.query_norm.scale, *pe, EPS, major_q)
        k = kernels.qk_norm_rope(None, k, None, self.norm.key_norm.scale, *pe, EPS, major_k)
        if h is None:
            act = kernels.attention_act_fp8(sdpa(q, k, v), mlp, "gelu_tanh")
            return clip_fp16(Pending(x, mod.gate, self.linear2(act)))
        self.attend(q, k, v, out=h[..., :d], quant=quant)
        return clip_fp16(Pending(x, mod.gate, self.linear2(h)))


class LastLayer(nn.Module):
    """Final adaLN (BFL order: shift, scale) and the projection back to latent channels."""

    def __init__(self, dim: int, out_channels: int) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), Linear(dim, 2 * dim))
        self.linear = Linear(dim, out_channels)

    def forward(self, x: Stream, mods: ModulationSource) -> Tensor:
        shift, scale = mods.raw(self.adaLN_modulation[1]).chunk(2, dim=1)
        _, x = norm_modulate(x, ModulationOut(shift, scale, gate=shift))
        return self.linear(x)


class Flux1Transformer(nn.Module):
    """FLUX.1 DiT: `model(img, img_ids, txt, txt_ids, timesteps, y, guidance)` → velocity (B, L_img, C)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        if cfg.family != "flux1":
            raise ValueError(f"Flux1Transformer needs a flux1 config, got family {cfg.family!r}")
        self.config = cfg
        d = cfg.hidden_size
        self.img_in = Linear(cfg.in_channels, d)
        self.time_in = MLPEmbedder(256, d)
        self.vector_in = MLPEmbedder(cfg.vec_in_dim, d)
        self.guidance_in = MLPEmbedder(256, d) if cfg.guidance_embed else nn.Identity()
        self.txt_in = Linear(cfg.context_in_dim, d)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.depth_single_blocks))
        self.final_layer = LastLayer(d, cfg.out_channels)
        self._offsets_cache: dict[int, tuple[int, int]] | None = None

    def rope(self, txt_ids: Tensor, img_ids: Tensor) -> RoPE:
        """RoPE tables for the joint sequence `[txt | img]`; build once per image size, pass as `pe`.

        Ids are (L, 3) or (B, L, 3); positions are shared across the batch, as in diffusers.
        """
        txt_ids, img_ids = _shared_ids(txt_ids, "txt_ids"), _shared_ids(img_ids, "img_ids")
        return rope_tables(torch.cat([txt_ids, img_ids], dim=0), self.config.axes_dim, self.config.theta)

    def forward(
        self,
        img: Tensor,
        img_ids: Tensor,
        txt: Tensor,
        txt_ids: Tensor,
        timesteps: Tensor,
        y: Tensor,
        guidance: Tensor | None = None,
        pe: RoPE | None = None,
        mods: Tensor | None = None,
    ) -> Tensor:
        """Predict the flow velocity.

        img (B, L_img, in_channels) packed latents; txt (B, L_txt, context_in_dim) T5 states;
        timesteps (B,) in [0, 1]; y (B, vec_in_dim) pooled CLIP; guidance (B,) for dev, None for
        schnell; pe optional precomputed `rope(txt_ids, img_ids)`; mods optional (B, total) row of
        `modulation_table` for this step (then timesteps, y and guidance are not read again).
        """
        self._check_inputs(img, txt, timesteps, y, guidance)
        if pe is None:
            pe = self.rope(txt_ids, img_ids)
        if mods is None:
            source = ModulationSource(self.conditioning(timesteps, y, guidance), None, self._mod_offsets)
        else:
            source = ModulationSource(None, mods, self._mod_offsets)

        img = self.img_in(img)
        txt = self.txt_in(txt)
        img_s: Stream = img
        txt_s: Stream = txt
        for block in self.double_blocks:
            img_s, txt_s = block(img_s, txt_s, source, pe)

        # (B, L_txt + L_img, D)
        x: Stream = torch.cat([materialize(txt_s), materialize(img_s)], dim=1)
        for block in self.single_blocks:
            x = block(x, source, pe)

        n_txt = txt.shape[1]
        img_s = (
            Pending(x.residual[:, n_txt:], x.gate, x.update[:, n_txt:])
            if isinstance(x, Pending)
            else x[:, n_txt:]
        )
        return self.final_layer(img_s, source)

    def conditioning(self, timesteps: Tensor, y: Tensor, guidance: Tensor | None) -> Tensor:
        """`silu(vec)` (B, D), rounded as diffusers: t*1000 in the model dtype, (t + g) + y."""
        dtype = self.img_in.compute_dtype
        t = timesteps.to(dtype) * 1000
        vec = self.time_in(timestep_embedding(t).to(y.dtype))
        if self.config.guidance_embed:
            g = guidance.to(dtype) * 1000
            vec = vec + self.guidance_in(timestep_embedding(g).to(y.dtype))
        vec = vec + self.vector_in(y)
        return torch.nn.functional.silu(vec).to(dtype)

    @property
    def _mod_linears(self) -> list[nn.Module]:
        """Every adaLN projection, in the order of `modulation_table`'s columns."""
        lins = [m.lin for b in self.double_blocks for m in (b.img_mod, b.txt_mod)]
        lins += [b.modulation.lin for b in self.single_blocks]
        return [*lins, self.final_layer.adaLN_modulation[1]]

    @property
    def _mod_offsets(self) -> dict[int, tuple[int, int]]:
        if self._offsets_cache is None:
            offsets, start = {}, 0
            for lin in self._mod_linears:
                offsets[id(lin)] = (start, start + lin.out_features)
                start += lin.out_features
            self._offsets_cache = offsets
        return self._offsets_cache

    def modulation_table(self, vec_act: Tensor) -> Tensor:
        """All adaLN projections of `vec_act` (M, D) side by side: (M, total), one GEMM per projection.

        With M = steps x batch this reads each modulation weight once per generation instead of once per
        step. Slicing row i gives `forward(..., mods=...)` the same values up to cuBLAS's
        rounding for that M, which is why the pipeline uses it only in the `high` tier.
        """
        return torch.cat([lin(vec_act) for lin in self._mod_linears], dim=1)

    def _check_inputs(
        self, img: Tensor, txt: Tensor, timesteps: Tensor, y: Tensor, guidance: Tensor | None
    ) -> None:
        cfg = self.config
        if img.ndim != 3 or img.shape[-1] != cfg.in_channels:
            raise ValueError(f"img must be (B, L, {cfg.in_channels}), got {tuple(img.shape)}")
        b = img.shape[0]
        if txt.ndim != 3 or txt.shape[0] != b or txt.shape[-1] != cfg.context_in_dim:
            raise ValueError(f"txt must be ({b}, L, {cfg.context_in_dim}), got {tuple(txt.shape)}")
        if y.shape != (b, cfg.vec_in_dim):
            raise ValueError(f"y must be ({b}, {cfg.vec_in_dim}), got {tuple(y.shape)}")
        if timesteps.shape != (b,):
            raise ValueError(f"timesteps must be ({b},), got {tuple(timesteps.shape)}")
        if cfg.guidance_embed:
            if guidance is None:
                raise ValueError("this model embeds guidance (FLUX.1-dev): pass guidance (B,)")
            if guidance.shape != (b,):
                raise ValueError(f"guidance must be ({b},), got {tuple(guidance.shape)}")
        elif guidance is not None:
            raise ValueError("this model has no guidance embedding (FLUX.1-schnell): pass guidance=None")


def _shared_ids(ids: Tensor, name: str) -> Tensor:
    if ids.ndim == 2:
        return ids
    if ids.ndim != 3 or (ids.shape[0] > 1 and not torch.equal(ids, ids[:1].expand_as(ids))):
        raise ValueError(f"{name} must be (L, 3) or (B, L, 3) with the same positions for every batch row")
    return ids[0]
