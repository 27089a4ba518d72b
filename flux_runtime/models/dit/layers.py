"""Pieces every FLUX transformer shares unchanged: projections, embeddings, RoPE tables, QK-norm, attention.

The blocks built from them (FLUX.1's and FLUX.2's double and single blocks, their modulation) are in `blocks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_runtime import kernels
from flux_runtime.kernels import gguf_dequant


class Linear(nn.Module):
    """The one projection type of the DiTs: `F.linear` with the bias inside the GEMM.

    Parity needs the bias fused (`F.linear(x, W, b)` is not bit-equal to `x @ W.T + b` on cuBLAS).
    `split` projects through row blocks of a merged weight (BFL's fused `qkv`, `linear1`), which is
    what diffusers computes with its separate `to_q`, `to_k`, `to_v` modules.
    An FP8 checkpoint replaces this module with a subclass holding e4m3 weights and scales.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x, self.weight, self.bias)

    def split(
        self,
        x: Tensor,
        sizes: tuple[int, ...],
        *,
        gelu_last: bool = False,
        gelu_out: Tensor | None = None,
        gelu_quant: kernels.Fp8Quant | None = None,
    ) -> tuple[Tensor, ...]:
        """Project `x` through consecutive row blocks of the weight.

        One GEMM per block (diffusers' separate modules), or one merged GEMM where the fused tier has
        verified it bit-identical. `gelu_last` applies tanh-GELU to the last block (FLUX.1's single-block
        MLP input), writing it into `gelu_out` when given.
        """
        w, b = self.weight, self.bias
        if not gelu_last:
            return kernels.split_linear(x, w, b, tuple(sizes))
        n = sum(sizes[:-1])
        head = kernels.split_linear(x, w[:n], None if b is None else b[:n], tuple(sizes[:-1]))
        return (*head, _gelu_into(F.linear(x, w[n:], None if b is None else b[n:]), gelu_out, gelu_quant))

    def forward_gelu(self, x: Tensor) -> Tensor:
        """tanh-GELU of the projection (FLUX.1's MLP input)."""
        return kernels.gelu_tanh(F.linear(x, self.weight, self.bias))

    # what a producer needs to know about this layer's input: None = bf16/fp16, no quantization
    act_quant: kernels.Fp8Quant | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the activations this layer reads and writes."""
        return self.weight.dtype

    def from_view(self, x: Tensor) -> Tensor:
        """Project a strided view (a slice of the attention output): copied contiguous first, as diffusers does."""
        return self(x.contiguous())

    def input_buffer(self, like: Tensor, width: int) -> Tensor:
        """An empty input (..., width) shaped as `like`'s rows, that producers write column slices of."""
        return like.new_empty(*like.shape[:-1], width)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Fp8Linear(nn.Module):
    """A projection with an e4m3 weight: `torch._scaled_mm` on e4m3 activations, fp32 scales, bias in the GEMM.

    `weight` (out, in) e4m3 with `weight_scale` 0-dim (per tensor) or (out,) (per output channel: merged
    q/k/v shards keep their own scales, the bytes untouched). The input is quantized with the static
    `input_scale` (a calibrated checkpoint) or, when there is none, per token row at run time; producers
    that know `act_quant` hand over an `Fp8Act` directly. Output in `compute_dtype` (bf16).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        per_channel: bool = True,
        static: bool = False,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype = dtype
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=kernels.fp8.E4M3))
        self.register_buffer(
            "weight_scale", torch.empty((out_features,) if per_channel else (), dtype=torch.float32)
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        if static:
            self.register_buffer("input_scale", torch.empty((), dtype=torch.float32))
            self.register_buffer("input_scale_inv", torch.empty((), dtype=torch.float32))
        else:
            self.input_scale = self.input_scale_inv = None

    @property
    def act_quant(self) -> kernels.Fp8Quant:  # type: ignore[override]
        return kernels.Fp8Quant(self.input_scale, self.input_scale_inv)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.out_dtype

    def forward(self, x: Tensor | kernels.Fp8Act) -> Tensor:
        if isinstance(x, Tensor) and x.dtype == kernels.fp8.E4M3:
            assert self.input_scale is not None, "an e4m3 input needs a static input scale"
            x = kernels.Fp8Act(x, self.input_scale)
        elif not isinstance(x, kernels.Fp8Act):
            x = kernels.quantize(x, *self.act_quant)
        return kernels.fp8_linear(x, self.weight, self.weight_scale, self.bias, self.out_dtype)

    def split(
        self,
        x: Tensor | kernels.Fp8Act,
        sizes: tuple[int, ...],
        *,
        gelu_last: bool = False,
        gelu_out: Tensor | None = None,
        gelu_quant: kernels.Fp8Quant | None = None,
    ) -> tuple[Tensor, ...]:
        """One FP8 GEMM over the merged rows, split; `gelu_last` as in `Linear.split`.

        With `gelu_quant` (the consumer's quantization) the GELU is written in e4m3 into `gelu_out`.
        """
        parts = self(x).split(tuple(sizes), dim=-1)
        if not gelu_last:
            return parts
        return (*parts[:-1], _gelu_into(parts[-1], gelu_out, gelu_quant))

    def from_view(self, x: Tensor) -> Tensor:
        """Quantize straight from the strided view (the quantization is the copy)."""
        return self(x)

    def input_buffer(self, like: Tensor, width: int) -> Tensor:
        """e4m3 when the input scale is static (producers write quantized slices), else bf16."""
        dtype = kernels.fp8.E4M3 if self.input_scale is not None else like.dtype
        return torch.empty(*like.shape[:-1], width, dtype=dtype, device=like.device)

    def extra_repr(self) -> str:
        kind = "static" if self.input_scale is not None else "dynamic"
        per = "channel" if self.weight_scale.ndim else "tensor"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8 {kind}, per-{per} weight scale"


class GgufLinear(Linear):
    """A projection whose weight stays GGML-quantized (a GGUF checkpoint's blocks, uint8) on its device.

    `weight` is the dequantized weight, computed when read: fp16 from the blocks, then cast to the compute
    dtype, as diffusers' `GGUFLinear` does before each matmul (so the bits match it); in the `lossless` and
    `high` tiers one fused kernel does both on CUDA (`kernels.gguf_dequant_triton`, verified bit for bit on
    first use like the other lossless kernels), with tier `off` the torch reference; every `Linear`
    method (`forward`, `split`, `forward_gelu`) then runs unchanged on it. `qweight` holds the blocks,
    (out, bytes per row); `ggml_type` names their type.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        ggml_type: gguf_dequant.GgmlType,
        dtype: torch.dtype,
    ) -> None:
        nn.Module.__init__(self)  # not Linear's: `weight` is a property here, not a parameter
        self.in_features, self.out_features = in_features, out_features
        self.ggml_type, self.out_dtype = ggml_type, dtype
        shape = gguf_dequant.byte_shape(ggml_type, (out_features, in_features))
        self.register_buffer("qweight", torch.empty(shape, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    @property  # type: ignore[override]
    def weight(self) -> Tensor:
        return kernels.gguf_dequant_as(self.qweight, self.ggml_type, self.out_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.out_dtype

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gguf {self.ggml_type.name}"


def _gelu_into(x: Tensor, out: Tensor | None, quant: kernels.Fp8Quant | None) -> Tensor:
    """tanh-GELU of `x`, into `out` when given: e4m3 with `quant` (static), else in x's dtype."""
    if out is not None and out.dtype == kernels.fp8.E4M3:
        assert quant is not None and quant.static
        return kernels.gelu_tanh_fp8(x, *quant, out=out).data
    return kernels.gelu_tanh(x, out=out)


AnyLinear = Linear | Fp8Linear


def quantizes_per_row(linear: AnyLinear) -> bool:
    """Whether `linear` quantizes its input with one scale per row (an FP8 layer without a static scale):
    then the whole input row must exist before any of it can be quantized."""
    return isinstance(linear, Fp8Linear) and linear.input_scale is None


class MLPEmbedder(nn.Module):
    """`in_layer → SiLU → out_layer`: the time, guidance and pooled-text embedders."""

    def __init__(self, in_dim: int, hidden_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.in_layer = Linear(in_dim, hidden_dim, bias)
        self.out_layer = Linear(hidden_dim, hidden_dim, bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class RMSNormScale(nn.Module):
    """Holds one QK RMSNorm weight under BFL's name `scale`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))


class QKNorm(nn.Module):
    """The query and key RMSNorm weights of one attention stream (`norm.query_norm.scale`, ...)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query_norm = RMSNormScale(dim)
        self.key_norm = RMSNormScale(dim)


class ModulationOut(NamedTuple):
    """One adaLN modulation triple, each (B, D)."""

    shift: Tensor
    scale: Tensor
    gate: Tensor


class Pending(NamedTuple):
    """A gated residual `residual + gate * update` not yet written (deferred to the next norm)."""

    residual: Tensor
    gate: Tensor
    update: Tensor


EPS = 1e-6
FP16_MAX = 65504.0

Stream = Tensor | Pending  # a residual stream, possibly with its gated update deferred
RoPE = tuple[Tensor, Tensor]


def materialize(x: Stream) -> Tensor:
    """Write a pending gated residual out (identity on a plain tensor)."""
    return kernels.gated_residual(*x) if isinstance(x, Pending) else x


def norm_modulate(
    x: Stream, mod: ModulationOut, quant: kernels.Fp8Quant | None = None
) -> tuple[Tensor, Tensor | kernels.Fp8Act]:
    """Return `(x, LayerNorm(x) * (1 + scale) + shift)`, materialising a pending residual on the way.

    With `quant` (the consuming FP8 layer's `act_quant`) the modulated value comes back in e4m3.
    """
    if quant is not None:
        if isinstance(x, Pending):
            return kernels.residual_layer_norm_modulate_fp8(*x, mod.shift, mod.scale, EPS, *quant)
        return x, kernels.layer_norm_modulate_fp8(x, mod.shift, mod.scale, EPS, *quant)
    if isinstance(x, Pending):
        return kernels.residual_layer_norm_modulate(*x, mod.shift, mod.scale, EPS)
    return x, kernels.layer_norm_modulate(x, mod.shift, mod.scale, EPS)


def clip_fp16(x: Stream) -> Stream:
    """diffusers clips the text and joint streams to the fp16 range after each block."""
    dtype = x.update.dtype if isinstance(x, Pending) else x.dtype
    if dtype != torch.float16:
        return x
    return materialize(x).clip(-FP16_MAX, FP16_MAX)


def timestep_embedding(t: Tensor, dim: int = 256, max_period: float = 10_000.0) -> Tensor:
    """Sinusoidal embedding `[cos | sin]` of `t` (B,), fp32 (B, dim), rounding as diffusers' `Timesteps`."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / half)
    args = t[:, None].float() * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_tables(ids: Tensor, axes_dim: tuple[int, ...], theta: int) -> tuple[Tensor, Tensor]:
    """RoPE cos/sin tables (L, sum(axes_dim)) fp32 for position ids (L, n_axes).

    Angles in float64 as diffusers computes them, each frequency repeated for its channel pair.
    Built once per image size by the caller and reused by every block of every step.
    """
    pos = ids.float()
    # float64 except where the device has none (mps); matches diffusers' choice.
    freqs_dtype = torch.float32 if pos.device.type == "mps" else torch.float64
    cos_out, sin_out = [], []
    for axis, d in enumerate(axes_dim):
        omega = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=freqs_dtype, device=pos.device) / d))
        angles = torch.outer(pos[:, axis], omega)
        cos_out.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin_out.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos_out, dim=-1), torch.cat(sin_out, dim=-1)


def shared_ids(ids: Tensor, name: str, n_axes: int) -> Tensor:
    """(L, n_axes) positions from (L, n_axes) or (B, L, n_axes) ids that agree across the batch."""
    if ids.ndim == 3:
        if ids.shape[0] > 1 and not torch.equal(ids, ids[:1].expand_as(ids)):
            raise ValueError(f"{name} must hold the same positions for every batch row")
        ids = ids[0]
    if ids.ndim != 2 or ids.shape[-1] != n_axes:
        raise ValueError(f"{name} must be (L, {n_axes}) or (B, L, {n_axes}), got {tuple(ids.shape)}")
    return ids


def attention(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor | None = None, quant: kernels.Fp8Quant | None = None
) -> Tensor:
    """Full attention over (B, L, H, D) inputs through default-dispatch SDPA; returns (B, L, H*D).

    With `out` (B, L, H*D) (unit last stride, e.g. a column slice of the single block's `[attn | mlp]`
    buffer) the heads are written there directly: the same values as diffusers' flatten and concat.
    An e4m3 `out` (with the consumer's static `quant`) receives the heads quantized instead.
    """
    return write_heads(sdpa(q, k, v), out, quant)


def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention of every head of (B, L, H, D) inputs, (B, L, H, D) in q's dtype (a strided view).

    Any layout with a unit last stride: head-major inputs ((B, H, L, D) storage, `kernels.empty_heads`) reach
    SDPA contiguous. cuDNN's and flash attention's output (and the CPU's) is stored in q's dimension order, so a
    head-major q gives head-major heads here, the same values either way.
    """
    o = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
    return o.permute(0, 2, 1, 3).to(q.dtype)


def write_heads(o: Tensor, out: Tensor | None = None, quant: kernels.Fp8Quant | None = None) -> Tensor:
    """Attention heads (B, L, H, D) (or (B, L, groups, H/groups, D)) as (B, L, H*D): flattened, or written
    into `out` as `attention` says.

    Heads stored head-major (`sdpa` of a head-major q) are no (B, L, H*D) rows: flattening them copies (the
    double blocks' projections need rows), and a static e4m3 `out` takes them a (L, H, D) batch row at a time
    (the quantization reads them where they are; the scale is one number, so the codes are the same).
    """
    if out is None:
        return o.flatten(2)
    heads = out.unflatten(-1, o.shape[2:])
    if out.dtype == kernels.fp8.E4M3:
        assert quant is not None and quant.static
        if o.ndim == 4 and o.shape[2] > 1 and o.stride(2) != o.shape[3] * o.stride(3):
            for o_b, heads_b in zip(o.unbind(0), heads.unbind(0), strict=True):
                kernels.quantize(o_b, *quant, out=heads_b)
        else:
            kernels.quantize(o.reshape(*o.shape[:2], -1), *quant, out=out)
        return out
    heads.copy_(o)
    return out


Attend = Callable[..., Tensor]
"""`attend(q, k, v, out=None, quant=None)` with `attention`'s contract: what a block's joint attention calls.

Blocks hold it as `attend` (full attention); a sequence-parallel run sets it per block to an attention that
exchanges token shards for head shards around `sdpa` (`flux_runtime.parallel.ulysses`)."""
