"""The FLUX.1 [dev] / [schnell] diffusion transformer.

Module names equal Black Forest Labs' checkpoint keys (`double_blocks.N.img_attn.qkv`, ...), so a
BFL file loads with no key map. The forward pass reproduces diffusers 0.42.1
`FluxTransformer2DModel` op for op: every elementwise chain is one
call into `flux_runtime.kernels`, whose reference is that chain, and gated residuals are handed to
the next norm as `Pending` triples so a fused kernel can materialise them in the same pass. The pieces FLUX.2
builds alike are in blocks.py; this file adds FLUX.1's per-block modulation (`ModulationSource`), its GELU MLP
and its single block's projection.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from flux_runtime import kernels
from flux_runtime.models.dit import blocks
from flux_runtime.models.dit.blocks import JointTransformer, Modulation
from flux_runtime.models.dit.config import DiTConfig
from flux_runtime.models.dit.ip_adapter import ImagePrompt, IPAdapter
from flux_runtime.models.dit.layers import Linear, MLPEmbedder, ModulationOut, RoPE, Stream, norm_modulate
from flux_runtime.models.dit.residuals import ControlResiduals


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


class MLP(blocks.MLP):
    """`0: Linear → GELU(tanh) → 2: Linear`, BFL's `img_mlp` / `txt_mlp`."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden, hidden, bias=True)

    def activation(self, h: Tensor, quant: kernels.Fp8Quant | None) -> Tensor | kernels.Fp8Act:
        return kernels.gelu_tanh(h) if quant is None else kernels.gelu_tanh_fp8(h, *quant)


class DoubleStreamBlock(blocks.DoubleStreamBlock):
    """Separate image and text weights, each stream with its own modulation; one joint attention over `[txt | img]`."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__(cfg, MLP, own_modulation=True)

    def forward(
        self, img: Stream, txt: Stream, mods: ModulationSource, ip: ImagePrompt | None, pe: RoPE
    ) -> tuple[Stream, Stream]:
        """`ip`: the forward's IP-Adapter image prompt, None without one."""
        term = None if ip is None else ip.attention(self)
        return blocks.double_stream(self, img, txt, mods(self.img_mod), mods(self.txt_mod), pe, term)


class SingleStreamBlock(blocks.SingleStreamBlock):
    """Parallel attention and MLP on the joint stream: `linear1` → [q|k|v|mlp], `linear2` ← [attn|mlp]."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__(cfg, cfg.mlp_hidden_dim, bias=True)
        self.modulation = Modulation(cfg.hidden_size, double=False, bias=True)

    def forward(self, x: Stream, mods: ModulationSource, pe: RoPE) -> Stream:
        (mod,) = mods(self.modulation)
        x, x_n = norm_modulate(x, mod, self.linear1.act_quant)
        d, m = self.linear1.in_features, self.mlp_hidden_dim
        quant = self.linear2.act_quant
        if self.rows_fp8():
            # GELU and both halves quantized in one pass after attention
            h = None
            q, k, v, mlp = self.linear1.split(x_n, (d, d, d, m))
        else:
            # (B, L, D + mlp_hidden): the GELU written into its MLP half by linear1 (e4m3 when linear2 reads a
            # statically quantized input)
            h = self.linear2.input_buffer(x, d + m)
            q, k, v, _ = self.linear1.split(
                x_n, (d, d, d, m), gelu_last=True, gelu_out=h[..., d:], gelu_quant=quant
            )
        q, k, v = self.heads(q, k, v)
        q = self.rotate(q, "q", pe)
        k = self.rotate(k, "k", pe)
        if h is None:
            return self.out_rows_fp8(x, mod.gate, q, k, v, mlp, "gelu_tanh")
        return self.out_buffer(x, mod.gate, q, k, v, h)


class LastLayer(blocks.LastLayer):
    """Final adaLN (BFL order: shift, scale) and the projection back to latent channels."""

    def forward(self, x: Stream, mods: ModulationSource) -> Tensor:
        return self.project(x, mods.raw(self.adaLN_modulation[1]))


class Flux1Transformer(JointTransformer):
    """FLUX.1 DiT: `model(img, img_ids, txt, txt_ids, timesteps, y, guidance)` → velocity (B, L_img, C).

    Position ids have three axes; `rope` takes them as (L, 3) or (B, L, 3).
    """

    family = "flux1"
    variants = ("FLUX.1-dev", "FLUX.1-schnell")
    block_types = (DoubleStreamBlock, SingleStreamBlock, LastLayer)

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        self.img_in = Linear(cfg.in_channels, d)
        self.time_in = MLPEmbedder(256, d)
        self.vector_in = MLPEmbedder(cfg.vec_in_dim, d)
        self.guidance_in = MLPEmbedder(256, d) if cfg.guidance_embed else nn.Identity()
        self.txt_in = Linear(cfg.context_in_dim, d)
        self.add_blocks()
        # the IP-Adapter on this transformer (`set_ip_adapter`); None: plain forwards
        self.ip_adapter: IPAdapter | None = None
        self._offsets_cache: dict[int, tuple[int, int]] | None = None

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
        control: ControlResiduals | None = None,
        ip: Tensor | None = None,
    ) -> Tensor:
        """Predict the flow velocity.

        img (B, L_img, in_channels) packed latents; txt (B, L_txt, context_in_dim) T5 states;
        timesteps (B,) in [0, 1]; y (B, vec_in_dim) pooled CLIP; guidance (B,) for dev, None for
        schnell; pe optional precomputed `rope(txt_ids, img_ids)`; mods optional (B, total) row of
        `modulation_table` for this step (then timesteps, y and guidance are not read again); control
        optional ControlNet residuals for the blocks' image states (`Flux1ControlNet`).
        `modulation_table` for this step (then timesteps, y and guidance are not read again); ip optional
        image tokens (B, 1, T, width) of the loaded IP-Adapter (`ip_adapter`), projected by `project_image`.
        """
        self.check_inputs(img, txt, timesteps, guidance, y)
        if pe is None:
            pe = self.rope(txt_ids, img_ids)
        if mods is None:
            source = ModulationSource(self.conditioning(timesteps, y, guidance), None, self._mod_offsets)
        else:
            source = ModulationSource(None, mods, self._mod_offsets)

        img = self.img_in(img)
        txt = self.txt_in(txt)
        prompt = None if ip is None else self._ip_adapter().prompt(ip)
        return self.run_blocks(
            img, txt, (source, prompt), (source,), pe, partial(self.final_layer, mods=source), control
        )

    def set_ip_adapter(self, adapter: IPAdapter | None) -> None:
        """Put an IP-Adapter on (its blocks paired with the double blocks) or take it off (None)."""
        if adapter is not None:
            adapter.attach(self.double_blocks)
        self.ip_adapter = adapter

    def _ip_adapter(self) -> IPAdapter:
        if self.ip_adapter is None:
            raise ValueError(
                "ip (image-prompt tokens) needs an IP-Adapter on the transformer: set_ip_adapter"
            )
        return self.ip_adapter

    def project_image(self, embeds: Tensor) -> Tensor:
        """CLIP image embeddings (B, 1, E) → the IP-Adapter's image tokens `forward` takes as `ip`."""
        return self._ip_adapter().project(embeds)

    def conditioning(self, timesteps: Tensor, y: Tensor, guidance: Tensor | None) -> Tensor:
        """`silu(vec)` (B, D), rounded as diffusers: t*1000 in the model dtype, (t + g) + y."""
        dtype = self.img_in.compute_dtype
        vec = self.embed_times(timesteps, guidance, dtype, y.dtype)
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
