"""The FLUX.3 Image Klein diffusion transformer (base and step-distilled "flow map").

Module names equal Black Forest Labs' FLUX.3 checkpoint keys (`emb_in.image`, `time_in.in_layer`,
`early_stream_modulations.txt.lin`, `content_mode_blocks.image.N.q_proj`, `single_blocks.N.mlp_in`,
`final_layer.image.adaLN_modulation.1`, ...), so a BFL file loads with no key map. The forward pass
reproduces diffusers 0.42.1 `Flux3Transformer2DModel` op for op. What differs from FLUX.2 (flux2.py):

- three token modes: `image` (the noisy latents), `image_cond` (reference-image latents) and `txt`;
- per-mode blocks first (5 per mode), each attending within its own mode only, then joint single blocks
  over `[txt | image | image_cond]`; every block is one shape: separate q/k/v projections, a SwiGLU MLP
  (`mlp_in` rows `[gate | up]`), parallel attention and MLP on one modulated input, `x + gate * (attn + mlp)`;
- modulation is per token: `lin(silu(temb))` on a (B, L, D) embedding, the image tokens at the flow
  timestep t, the text and reference tokens at t = 0; the joint blocks modulate text and content apart;
- a flow map adds the embedding of the timestep the step jumps to (`ref_time_in`) to every mode's;
- QK RMSNorm and RoPE run in fp32 (the norm weights are kept fp32, the heads upcast) with one cast back;
- RoPE theta 10000, position ids are floats (image rows and columns scaled by 0.5, references at l = -1, -2, ...).

The per-token chains go through `flux_runtime.kernels` (their references are the eager math above, fused
kernels run where the tier allows): `token_layer_norm_modulate` (every block's and the final layer's
modulation; the joint blocks' two streams written into one buffer), `qk_norm_rope_fp32` (q and k
together), `token_gated_residual` / `joint_token_gated_residual` (`x + gate * (attn + mlp)`, the sum
rounded first as eager stores it). In an FP8 model (`Fp8Linear` projections) the producers write e4m3:
the LayerNorm + modulate kernel quantizes the block input once for q_proj, k_proj, v_proj and mlp_in when
they quantize alike (`share_input`), and SwiGLU quantizes mlp_out's input as it forms it; each is the
16-bit value eager rounds, then quantized, so the FP8 eager reference's bits are kept.

The norm weights (`*.norm.query_norm.scale`, `*.norm.key_norm.scale`) stay fp32 whatever the model
dtype, as diffusers keeps them (`cast_to` does this for a model built here).
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime import kernels
from flux_runtime.kernels.attention_backends import record_attention
from flux_runtime.kernels.swiglu import swiglu
from flux_runtime.models.dit import blocks
from flux_runtime.models.dit.blocks import check_shape, check_tokens
from flux_runtime.models.dit.config import DiTConfig
from flux_runtime.models.dit.fp8_attention import attention_choice, flux3_fp8
from flux_runtime.models.dit.layers import (
    EPS,
    AnyLinear,
    Linear,
    MLPEmbedder,
    QKNorm,
    RoPE,
    rope_tables,
    shared_ids,
    timestep_embedding,
)
from flux_runtime.models.dit.step_hook import StepHook

MODES = ("image", "image_cond")  # the image token modes, in BFL's order; text is the third mode
FP32_SUFFIXES = ("norm.query_norm.scale", "norm.key_norm.scale")  # parameters kept in fp32


class Flux3RoPE(NamedTuple):
    """RoPE tables (cos, sin), each (L, head_dim) fp32: per mode for the per-mode blocks, joined for the rest."""

    txt: RoPE
    image: RoPE
    image_cond: RoPE | None
    joint: RoPE  # [txt | image | image_cond]


class Flux3Fixed(NamedTuple):
    """The text and reference streams of a base model after their per-mode blocks, with the modulation the
    joint blocks give them: what `Flux3Transformer.fixed_streams` returns and `forward(fixed=...)` reads.

    These tokens are embedded at t = 0 whatever the step, so for a base model (no target time) they are the
    same at every step of a generation: computing them once and passing them to each step's forward runs the
    same ops on the same inputs as recomputing them, so the result is bit-identical.
    """

    txt: Tensor  # (B, L_txt, D)
    mod_txt: Tensor  # (B, L_txt, 3D): the joint blocks' shift, scale and gate of the text tokens
    ref: Tensor | None  # (B, L_ref, D) reference tokens, or None
    mod_ref: Tensor | None  # (B, L_ref, 3D)


class Modulation(nn.Module):
    """`lin(silu(temb))` → (B, L, 3D) per-token (shift, scale, gate), BFL's `*_stream_modulations.<mode>`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = Linear(dim, 3 * dim, bias=False)

    def forward(self, temb_act: Tensor) -> Tensor:
        return self.lin(temb_act)


class Block(nn.Module):
    """Parallel attention + SwiGLU MLP from one modulated input: a per-mode block or a joint single block."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        d, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.q_proj: AnyLinear = Linear(d, d, bias=False)
        self.k_proj: AnyLinear = Linear(d, d, bias=False)
        self.v_proj: AnyLinear = Linear(d, d, bias=False)
        self.norm = QKNorm(cfg.head_dim)
        self.attn_out: AnyLinear = Linear(d, d, bias=False)
        self.mlp_in: AnyLinear = Linear(d, 2 * cfg.mlp_hidden_dim, bias=False)  # rows [gate | up]
        self.mlp_out: AnyLinear = Linear(cfg.mlp_hidden_dim, d, bias=False)

    def readers(self) -> tuple[AnyLinear, AnyLinear, AnyLinear, AnyLinear]:
        """The four projections of the modulated input, in the order `modulated` returns their inputs."""
        return self.q_proj, self.k_proj, self.v_proj, self.mlp_in

    def modulated(
        self,
        x_txt: Tensor | None,
        shift_txt: Tensor | None,
        scale_txt: Tensor | None,
        x: Tensor,
        shift: Tensor,
        scale: Tensor,
    ) -> tuple[Tensor | kernels.Fp8Act, ...]:
        """The block input `(1 + scale) * LayerNorm(x) + shift` (text stream first when given), as each of
        `readers()` reads it: one e4m3 tensor made by the LayerNorm kernel itself when all four quantize
        alike (see `share_input`), else the 16-bit value, quantized once per distinct quantization."""
        args = (x_txt, shift_txt, scale_txt, x, shift, scale, EPS)
        readers, plan = self.readers(), share_input(self)
        quant = readers[0].act_quant
        if quant is not None and plan == (0, 0, 0, 0):
            h8 = kernels.token_layer_norm_modulate_fp8(*args, *quant)
            return h8, h8, h8, h8
        h = kernels.token_layer_norm_modulate(*args)
        out: list[Tensor | kernels.Fp8Act] = []
        for i, (layer, lead) in enumerate(zip(readers, plan, strict=True)):
            q = layer.act_quant
            out.append(h if q is None else kernels.quantize(h, *q) if lead == i else out[lead])
        return tuple(out)

    def attention_mlp(self, xs: tuple[Tensor | kernels.Fp8Act, ...], pe: RoPE) -> tuple[Tensor, Tensor]:
        """`(attn(x), mlp(x))` for the modulated stream `x` (B, L, D), self-attention over all of its tokens;
        `xs` is `x` as q_proj, k_proj, v_proj and mlp_in read it (`modulated`)."""
        x_q, x_k, x_v, x_mlp = xs
        q, k, v = (
            p(t).unflatten(-1, (self.num_heads, -1))
            for p, t in ((self.q_proj, x_q), (self.k_proj, x_k), (self.v_proj, x_v))
        )
        choice = attention_choice(self, q)
        if choice.fp8:  # `high` on Hopper: e4m3 q, k, v into FA3 (`fp8_attention.flux3_fp8`)
            attn = self.attn_out(flux3_fp8(self, q, k, v, pe).flatten(2, 3))
        else:
            record_attention(choice)
            # QK norm and RoPE in fp32, one cast back to the stream dtype: (B, L, H, Dh), stored head-major where
            # `kernels.is_head_major` says (v stays v_proj's output: making it head-major would be a copy)
            q, k = kernels.qk_norm_rope_fp32(
                q, k, self.norm.query_norm.scale, self.norm.key_norm.scale, *pe, EPS,
                kernels.is_head_major("q"), kernels.is_head_major("k"),
            )  # fmt: skip
            o = F.scaled_dot_product_attention(
                q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
            )
            attn = self.attn_out(o.permute(0, 2, 1, 3).flatten(2, 3).to(q.dtype))
        # SwiGLU in e4m3 when mlp_out is FP8: its input quantized as the product is formed (no 16-bit copy)
        gate_up, quant = self.mlp_in(x_mlp), self.mlp_out.act_quant
        mlp = self.mlp_out(swiglu(gate_up) if quant is None else kernels.swiglu_fp8(gate_up, *quant))
        return attn, mlp

    def forward(
        self, x: Tensor, mod: Tensor, pe: RoPE, txt: Tensor | None = None, mod_txt: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """A per-mode block: x (B, L, D), mod (B, L, 3D) → x + gate * (attn + mlp); with the text stream `txt`
        and its `mod_txt`, a joint block (`joint`) → (txt, x). Both run through the module call, so hooks on
        the block (a memory plan's weight streaming, profilers) see every block that runs."""
        if txt is not None:
            assert mod_txt is not None
            return self.joint(txt, x, mod_txt, mod, pe)
        shift, scale, gate = mod.chunk(3, dim=-1)
        attn, mlp = self.attention_mlp(self.modulated(None, None, None, x, shift, scale), pe)
        return kernels.token_gated_residual(x, gate, attn, mlp)

    def joint(
        self, txt: Tensor, content: Tensor, mod_txt: Tensor, mod: Tensor, pe: RoPE
    ) -> tuple[Tensor, Tensor]:
        """A joint single block over `[txt | content]`, each stream with its own modulation and gate."""
        shift, scale, gate = mod.chunk(3, dim=-1)
        c_shift, c_scale, c_gate = mod_txt.chunk(3, dim=-1)
        # each stream modulated, joined text first: (B, L_txt + L_content, D)
        xs = self.modulated(txt, c_shift, c_scale, content, shift, scale)
        attn, mlp = self.attention_mlp(xs, pe)
        # (attn + mlp) split back into the streams, each added through its own gate
        return kernels.joint_token_gated_residual(txt, c_gate, content, gate, attn, mlp)


# Block -> (weak references to its readers and their static scales, the scales' versions, the plan)
_PLANS: weakref.WeakKeyDictionary[Block, tuple[tuple[weakref.ref, ...], tuple[int, ...], tuple[int, ...]]]
_PLANS = weakref.WeakKeyDictionary()


def share_input(block: Block) -> tuple[int, ...]:
    """For each of `block.readers()`, the index of the first reader whose quantized input it can reuse.

    Two FP8 layers quantize one input to the same bits exactly when they quantize alike: both per token
    (the row scales come from the same rows), or both static with equal `input_scale` (and reciprocal)
    values. A 16-bit layer reads the 16-bit value (its own index). `(0, 0, 0, 0)` for an FP8 block means
    the four share one quantization, so the LayerNorm kernel can write it. Static scales that differ are
    not merged: a shared scale would round differently from the layers' own; each group is quantized once.

    Comparing static values reads them on the host, once per block and set of scale tensors (cached); where
    that cannot happen (CUDA-graph capture, `torch.compile`, meta tensors) only identical tensors count as
    equal and nothing is cached: the plan is then more conservative, never different in its bits.
    """
    readers = block.readers()
    scales = [t for r in readers for t in r.act_quant or () if t is not None]
    cached = _PLANS.get(block)
    objects = (*readers, *scales)
    # (inference tensors keep no version counter: they are matched by identity alone)
    versions = tuple(-1 if t.is_inference() else t._version for t in scales)
    if (
        cached is not None
        and len(cached[0]) == len(objects)
        and all(ref() is o for ref, o in zip(cached[0], objects, strict=True))
        and cached[1] == versions
    ):
        return cached[2]
    can_read = not torch.compiler.is_compiling() and not any(
        t.is_meta or (t.is_cuda and torch.cuda.is_current_stream_capturing()) for t in scales
    )
    plan: list[int] = []
    for i, r in enumerate(readers):
        q = r.act_quant
        lead = i
        if q is not None:
            for j in range(i):
                if plan[j] == j and _same_quant(readers[j].act_quant, q, can_read):
                    lead = j
                    break
        plan.append(lead)
    result = tuple(plan)
    if can_read:
        _PLANS[block] = (tuple(weakref.ref(o) for o in objects), versions, result)
    return result


def _same_quant(a: kernels.Fp8Quant | None, b: kernels.Fp8Quant, can_read: bool) -> bool:
    """Whether quantizations `a` and `b` give one input the same e4m3 bits (see `share_input`)."""
    if a is None or a.static != b.static:
        return False
    if not b.static:
        return True
    pairs = ((a.scale, b.scale), (a.inv_scale, b.inv_scale))
    if all(x is y for x, y in pairs):
        return True
    return can_read and all(
        x.dtype == y.dtype and x.device == y.device and torch.equal(x.reshape(()), y.reshape(()))
        for x, y in pairs
    )


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """`(1 + scale) * LayerNorm(x) + shift` with per-token shift and scale (B, L, D)."""
    return kernels.token_layer_norm_modulate(None, None, None, x, shift, scale, EPS)


class LastLayer(blocks.LastLayer):
    """Final adaLN on the image tokens (BFL order: shift, scale) and the projection back to latent channels."""

    def __init__(self, dim: int, out_channels: int) -> None:
        super().__init__(dim, out_channels, bias=False)

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(temb).chunk(2, dim=-1)
        # LayerNorm(x) * (1 + scale) + shift: the per-token modulation of the blocks (a product commutes)
        return self.linear(modulate(x, shift, scale))


class Flux3Transformer(nn.Module):
    """FLUX.3 DiT: `model(img, img_ids, txt, txt_ids, timesteps, ref=, ref_ids=, target_timesteps=)` → velocity.

    `ref`/`ref_ids` are the optional reference-image tokens (the `image_cond` mode); `target_timesteps`
    is required by, and only by, a flow-map model (`config.flow_map`).
    """

    # a sampling branch's step cache while the pipeline runs one (`models.dit.step_hook`); None: plain forwards
    step_hook: StepHook | None = None

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        if cfg.family != "flux3":
            raise ValueError(f"Flux3Transformer needs a flux3 config, got family {cfg.family!r}")
        self.config = cfg
        d = cfg.hidden_size
        self.emb_in = nn.ModuleDict(
            {
                "image": Linear(cfg.in_channels, d, bias=False),
                "image_cond": Linear(cfg.cond_in_channels, d, bias=False),
            }
        )
        self.txt_in = Linear(cfg.context_in_dim, d, bias=False)
        self.time_in = MLPEmbedder(256, d, bias=False)
        if cfg.flow_map:
            self.ref_time_in = MLPEmbedder(256, d, bias=False)
        modes = (*MODES, "txt")
        self.early_stream_modulations = nn.ModuleDict({m: Modulation(d) for m in modes})
        self.single_stream_modulations = nn.ModuleDict({m: Modulation(d) for m in modes})
        self.content_mode_blocks = nn.ModuleDict(
            {m: nn.ModuleList(Block(cfg) for _ in range(cfg.depth)) for m in MODES}
        )
        self.txt_mode_blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth_single_blocks))
        self.final_layer = nn.ModuleDict({"image": LastLayer(d, cfg.out_channels)})

    def cast_to(self, dtype: torch.dtype) -> Flux3Transformer:
        """Cast the parameters to `dtype`, the QK-norm weights kept fp32 (as diffusers loads them)."""
        for name, p in self.named_parameters():
            p.data = p.data.to(torch.float32 if name.endswith(FP32_SUFFIXES) else dtype)
        return self

    def rope(self, txt_ids: Tensor, img_ids: Tensor, ref_ids: Tensor | None = None) -> Flux3RoPE:
        """RoPE tables of each mode and of the joint sequence; build once per image size, pass as `pe`.

        Ids are (L, 4) or (B, L, 4) positions (t, h, w, l), shared across the batch: text `(0, 0, 0, l)`,
        image `(0, i/2, j/2, 0)`, reference k `(0, i/2, j/2, -1 - k)`.
        """
        cfg = self.config
        tables = [
            rope_tables(shared_ids(ids, name, len(cfg.axes_dim)), cfg.axes_dim, cfg.theta)
            for ids, name in ((txt_ids, "txt_ids"), (img_ids, "img_ids"), (ref_ids, "ref_ids"))
            if ids is not None
        ]
        joint = (torch.cat([t[0] for t in tables], dim=0), torch.cat([t[1] for t in tables], dim=0))
        return Flux3RoPE(tables[0], tables[1], tables[2] if ref_ids is not None else None, joint)

    def forward(
        self,
        img: Tensor,
        img_ids: Tensor,
        txt: Tensor | None,
        txt_ids: Tensor,
        timesteps: Tensor,
        *,
        ref: Tensor | None = None,
        ref_ids: Tensor | None = None,
        target_timesteps: Tensor | None = None,
        pe: Flux3RoPE | None = None,
        fixed: Flux3Fixed | None = None,
    ) -> Tensor:
        """Predict the flow velocity of the image tokens.

        img (B, L_img, in_channels) packed noisy latents; txt (B, L_txt, context_in_dim) stacked text-encoder
        states, padding included (no mask); timesteps (B,) in [0, 1]; ref (B, L_ref, cond_in_channels) the
        reference-image tokens with their ids; target_timesteps (B,) the time a flow-map step jumps to;
        pe optional precomputed `rope(txt_ids, img_ids, ref_ids)`; fixed (base model only) the text and
        reference streams from `fixed_streams`, in place of `txt` and `ref` (pass None for both). Returns
        (B, L_img, out_channels) in the dtype of `img`.
        """
        self._check_inputs(img, txt, timesteps, ref, ref_ids, target_timesteps, fixed)
        if pe is None:
            pe = self.rope(txt_ids, img_ids, ref_ids)
        b, n_img = img.shape[:2]
        dtype = img.dtype

        # per-token timestep embeddings, rounded as diffusers: t*1000 in the model dtype, the sinusoid cast
        # to it; the text and reference tokens at t = 0; a flow map adds the target time's embedding to both
        temb = self._embed(self.time_in, timesteps.to(dtype) * 1000, dtype)  # (B, 1, D)
        target = None
        if target_timesteps is not None:
            target = self._embed(self.ref_time_in, target_timesteps.to(dtype) * 1000, dtype)
            temb = temb + target
        if fixed is None:
            assert txt is not None  # checked
            fixed = self._fixed(txt, ref, pe, target, dtype)
        temb = temb.expand(b, n_img, -1)  # (B, L_img, D)

        # image tokens and their per-mode blocks
        temb_act = F.silu(temb)
        mod_img = self.early_stream_modulations["image"](temb_act)
        mod_content = self.single_stream_modulations["image"](temb_act)
        x = self.emb_in["image"](img)
        hook = self.step_hook
        probe = -1 if hook is None else hook.probe_blocks
        x_in = x
        for k, block in enumerate(self.content_mode_blocks["image"]):
            x = block(x, mod_img, pe.image)
            if k + 1 == probe:  # step caching: the probe's image tokens decide whether the rest runs
                assert hook is not None
                reused = hook.at_probe(x_in, x, partial(self.final_layer["image"], temb=temb))
                if reused is not None:
                    return reused
        if fixed.ref is not None:
            assert fixed.mod_ref is not None
            # content = [image | image_cond]: (B, L_img + L_ref, D)
            x = torch.cat([x, fixed.ref], dim=1)
            mod_content = torch.cat([mod_content, fixed.mod_ref], dim=1)

        # joint single blocks over [txt | image | image_cond]
        txt_stream = fixed.txt
        for block in self.single_blocks:
            txt_stream, x = block(x, mod_content, pe.joint, txt_stream, fixed.mod_txt)

        # only the image tokens (first in the content) reach the output
        if hook is not None:
            hook.after_rest(x[:, :n_img])
        return self.final_layer["image"](x[:, :n_img], temb)

    @property
    def max_probe_blocks(self) -> int:
        """The most leading blocks a step cache may probe with: the image tokens' own blocks."""
        return len(self.content_mode_blocks["image"])

    def fixed_streams(
        self,
        txt: Tensor,
        txt_ids: Tensor,
        img_ids: Tensor,
        *,
        ref: Tensor | None = None,
        ref_ids: Tensor | None = None,
        pe: Flux3RoPE | None = None,
    ) -> Flux3Fixed:
        """A base model's text (and reference) streams through their per-mode blocks, for every step of a
        generation: `forward(img, img_ids, None, txt_ids, t, fixed=...)` then equals `forward(img, img_ids,
        txt, txt_ids, t, ref=ref, ref_ids=ref_ids)` bit for bit. A flow map embeds its target time into these
        streams, so it has none to fix."""
        if self.config.flow_map:
            raise ValueError("a flow map's text stream changes with the target time: it has no fixed streams")
        b = check_tokens(txt, "txt", self.config.context_in_dim)
        if (ref is None) != (ref_ids is None):
            raise ValueError("pass ref and ref_ids together (the reference tokens and their positions)")
        if ref is not None:
            check_tokens(ref, "ref", self.config.cond_in_channels, b)
        if pe is None:
            pe = self.rope(txt_ids, img_ids, ref_ids)
        return self._fixed(txt, ref, pe, None, txt.dtype)

    def _fixed(
        self, txt: Tensor, ref: Tensor | None, pe: Flux3RoPE, target: Tensor | None, dtype: torch.dtype
    ) -> Flux3Fixed:
        """The text and reference streams at t = 0 (plus a flow map's `target` embedding (B, 1, D)), the
        time embedding rounded to `dtype` (the model's)."""
        b = txt.shape[0]
        zero = self._embed(self.time_in, torch.zeros(b, device=txt.device, dtype=dtype), dtype)
        if target is not None:
            zero = zero + target
        zero_act = F.silu(zero)

        # text: both modulation sets, then its per-mode blocks
        txt_act = zero_act.expand(b, txt.shape[1], -1)
        mod_txt = self.early_stream_modulations["txt"](txt_act)
        mod_txt_single = self.single_stream_modulations["txt"](txt_act)
        txt = self.txt_in(txt)
        for block in self.txt_mode_blocks:
            txt = block(txt, mod_txt, pe.txt)
        if ref is None:
            return Flux3Fixed(txt, mod_txt_single, None, None)

        ref_act = zero_act.expand(b, ref.shape[1], -1)
        mod_ref = self.early_stream_modulations["image_cond"](ref_act)
        mod_ref_single = self.single_stream_modulations["image_cond"](ref_act)
        ref = self.emb_in["image_cond"](ref)
        assert pe.image_cond is not None  # built with ref_ids, checked
        for block in self.content_mode_blocks["image_cond"]:
            ref = block(ref, mod_ref, pe.image_cond)
        return Flux3Fixed(txt, mod_txt_single, ref, mod_ref_single)

    @staticmethod
    def _embed(embedder: nn.Module, t: Tensor, dtype: torch.dtype) -> Tensor:
        """(B, 1, D) embedding of times `t` (B,) already scaled by 1000."""
        return embedder(timestep_embedding(t).to(dtype))[:, None, :]

    def _check_inputs(
        self,
        img: Tensor,
        txt: Tensor | None,
        timesteps: Tensor,
        ref: Tensor | None,
        ref_ids: Tensor | None,
        target_timesteps: Tensor | None,
        fixed: Flux3Fixed | None,
    ) -> None:
        cfg = self.config
        b = check_tokens(img, "img", cfg.in_channels)
        if fixed is not None:
            if txt is not None or ref is not None:
                raise ValueError("pass fixed= in place of txt and ref (txt=None, ref=None), not beside them")
            if cfg.flow_map:
                raise ValueError("a flow map has no fixed streams: pass txt (and ref)")
            if fixed.txt.shape[0] != b:
                raise ValueError(f"fixed streams of batch {fixed.txt.shape[0]} for an image batch of {b}")
        elif txt is None:
            raise ValueError("pass txt (B, L, context_in_dim), or fixed= from fixed_streams")
        else:
            check_tokens(txt, "txt", cfg.context_in_dim, b)
        check_shape(timesteps, "timesteps", (b,))
        if fixed is None and (ref is None) != (ref_ids is None):
            raise ValueError("pass ref and ref_ids together (the reference tokens and their positions)")
        if fixed is not None and (fixed.ref is None) != (ref_ids is None):
            raise ValueError("fixed streams with references need ref_ids (their positions), and only they")
        if ref is not None:
            check_tokens(ref, "ref", cfg.cond_in_channels, b)
        if cfg.flow_map:
            if target_timesteps is None:
                raise ValueError(
                    "this model is a flow map (FLUX.3 Klein distilled): pass target_timesteps (B,)"
                )
            check_shape(target_timesteps, "target_timesteps", (b,))
        elif target_timesteps is not None:
            raise ValueError("this model is not a flow map (FLUX.3 Klein base): pass target_timesteps=None")
