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
norm as `Pending` triples, as in flux1.py; what both generations build alike (the double block's joint
attention, the blocks' weights and shared steps, the run through them) is in blocks.py.
"""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime import kernels
from flux_runtime.kernels.swiglu import swiglu
from flux_runtime.models.dit import blocks
from flux_runtime.models.dit.blocks import JointTransformer, Modulation
from flux_runtime.models.dit.config import DiTConfig
from flux_runtime.models.dit.layers import Linear, MLPEmbedder, ModulationOut, RoPE, Stream, norm_modulate


class MLP(blocks.MLP):
    """`0: Linear → SwiGLU → 2: Linear`, BFL's `img_mlp` / `txt_mlp` (diffusers `ff.linear_in/out`)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden, 2 * hidden, bias=False)  # `0`'s rows [gate | up]

    def activation(self, h: Tensor, quant: kernels.Fp8Quant | None) -> Tensor | kernels.Fp8Act:
        return swiglu(h) if quant is None else kernels.swiglu_fp8(h, *quant)


class DoubleStreamBlock(blocks.DoubleStreamBlock):
    """Separate image and text weights, one joint attention over `[txt | img]`, modulation from outside."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__(cfg, MLP, own_modulation=False)

    # forward(img, txt, mod_img, mod_txt, pe): the modulation pairs shared by every block
    forward = blocks.double_stream


class SingleStreamBlock(blocks.SingleStreamBlock):
    """Parallel attention and SwiGLU MLP: `linear1` → [q|k|v|gate|up], `linear2` ← [attn|mlp]."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__(cfg, 2 * cfg.mlp_hidden_dim, bias=False)

    def forward(self, x: Stream, mod: ModulationOut, pe: RoPE) -> Stream:
        x, x_n = norm_modulate(x, mod, self.linear1.act_quant)
        # one GEMM, split as diffusers splits it: (B, L, 3D) attention, (B, L, 2M) [gate | up]
        qkv, mlp = self.linear1(x_n).split([3 * self.linear1.in_features, 2 * self.mlp_hidden_dim], dim=-1)
        q, k, v = self.heads(*qkv.chunk(3, dim=-1))
        q = self.rotate(q, "q", pe)
        k = self.rotate(k, "k", pe)
        d, quant = self.linear1.in_features, self.linear2.act_quant
        if self.rows_fp8():
            return self.out_rows_fp8(x, mod.gate, q, k, v, mlp, "swiglu")
        # (B, L, D + M): SwiGLU written into its MLP half (e4m3 when linear2 reads a statically quantized input)
        h = self.linear2.input_buffer(x, d + self.mlp_hidden_dim)
        if h.dtype == kernels.fp8.E4M3:
            kernels.swiglu_fp8(mlp, *quant, out=h[..., d:])
        else:
            swiglu(mlp, out=h[..., d:])
        return self.out_buffer(x, mod.gate, q, k, v, h)


class LastLayer(blocks.LastLayer):
    """Final adaLN (BFL order: shift, scale) and the projection back to latent channels."""

    def __init__(self, dim: int, out_channels: int) -> None:
        super().__init__(dim, out_channels, bias=False)

    def forward(self, x: Stream, vec_act: Tensor) -> Tensor:
        return self.project(x, self.adaLN_modulation[1](vec_act))


class Flux2Transformer(JointTransformer):
    """FLUX.2 DiT: `model(img, img_ids, txt, txt_ids, timesteps, guidance)` → velocity (B, L_img, C).

    Same call as `Flux1Transformer` minus the pooled vector `y`: FLUX.2 conditions on time (and,
    for [dev], guidance) only. Position ids have four axes (t, h, w, l), given to `rope` as (L, 4) or
    (B, L, 4) integer positions: text `(0, 0, 0, l)`, image `(0, i, j, 0)`, reference image k
    `(10 + 10k, i, j, 0)`.
    """

    family = "flux2"
    variants = ("FLUX.2 [dev]", "FLUX.2 [klein]")
    block_types = (DoubleStreamBlock, SingleStreamBlock, LastLayer)

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        self.img_in = Linear(cfg.in_channels, d, bias=False)
        self.txt_in = Linear(cfg.context_in_dim, d, bias=False)
        self.time_in = MLPEmbedder(256, d, bias=False)
        self.guidance_in = MLPEmbedder(256, d, bias=False) if cfg.guidance_embed else nn.Identity()
        self.double_stream_modulation_img = Modulation(d, double=True, bias=False)
        self.double_stream_modulation_txt = Modulation(d, double=True, bias=False)
        self.single_stream_modulation = Modulation(d, double=False, bias=False)
        self.add_blocks()

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
        self.check_inputs(img, txt, timesteps, guidance)
        if pe is None:
            pe = self.rope(txt_ids, img_ids)

        # conditioning vector, rounded as diffusers: t*1000 (and g*1000) in the model dtype, the
        # sinusoid cast to it before each embedder, t + g
        vec_act = F.silu(self.embed_times(timesteps, guidance, img.dtype, img.dtype))

        # shared modulation: once per forward, the same tensors for every block
        mod_img = self.double_stream_modulation_img(vec_act)
        mod_txt = self.double_stream_modulation_txt(vec_act)
        (mod_single,) = self.single_stream_modulation(vec_act)

        img = self.img_in(img)
        txt = self.txt_in(txt)
        finish = partial(self.final_layer, vec_act=vec_act.to(img.dtype))
        return self.run_blocks(img, txt, (mod_img, mod_txt), (mod_single,), pe, finish)
