#!/usr/bin/env python
"""Bit-exactness and speed of the fused Triton kernels at the FLUX shapes, on one CUDA GPU.

For every op in `flux_runtime.kernels`, every FLUX site shape (hidden 3072 / 6144, 24 / 48 heads of
128; 512 text tokens and the 512², 1024², 768×1344 images as text, image and joint streams; batch 1
and 2; one odd size; FLUX.2 SwiGLU widths of [dev] and both [klein]s; the single blocks' `out=` slices;
FLUX.3 Klein's per-token ops at 480 text tokens, 512² / 1024² images, 0 or 1 reference, per-mode and
joint; GGUF dequantization at FLUX.1-dev's projections in four types) and bf16 and fp16:

1. fresh random inputs; the memory the fused outputs will land in is filled with NaN first (freed
   NaN blocks of the output sizes, which the caching allocator hands back; `out=` buffers are NaN
   filled), so an element the kernel fails to write shows up; then `torch.equal(fused, reference)`
   and no NaN in the fused output. Ops with several kernels (`VARIANT` in their module: v1, v2) are
   checked in every variant;
2. (bf16; fp16 too with `--bench-fp16`) the median time of each variant and of the eager reference
   chain (`triton.testing.do_bench`, L2 flushed before each call), and each variant's bandwidth
   against the 4.16 TB/s device-to-device copy ceiling measured on the H200
  . `*` marks the variant the op uses now (its module's `VARIANT`).

The `[attention | act]` producer's tanh-GELU site is also run without its max shortcut ("2 GELUs"), and on
inputs that all miss the shortcut ("flux1 fallback"), so the shortcut's gain and worst case show beside it.
GELU and SiLU (SwiGLU's first op) are also checked exhaustively over all 65,536 inputs of each
dtype. `--tune` adds a sweep of the v2 tile sizes at the 1024² joint shapes and of the `[attention | act]`
producer's tile and warps. Exits 1 on any
mismatch or any shape a kernel's guards reject.
Usage: `python scripts/kernel_check.py [--no-bench] [--bench-fp16] [--tune] [--op NAME]`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from flux_runtime.kernels.attention_act_fp8 import (
    attention_act_quantize_reference,
    attention_act_quantize_triton,
)
from flux_runtime.kernels.dispatch import UnsupportedInput
from flux_runtime.kernels.fp8 import (
    ACT_BLOCK_DEFAULTS,
    act_block,
    act_quantize_reference,
    act_quantize_triton,
)
from flux_runtime.kernels.gated_residual import gated_residual_reference, gated_residual_triton
from flux_runtime.kernels.gelu import all_half_values, gelu_tanh_reference, gelu_tanh_triton
from flux_runtime.kernels.gguf_dequant import BY_NAME as GGML_TYPES
from flux_runtime.kernels.gguf_dequant_triton import HALF_FIELDS, dequantize_reference, dequantize_triton
from flux_runtime.kernels.layer_norm_modulate import (
    layer_norm_modulate_reference,
    layer_norm_modulate_triton,
    residual_layer_norm_modulate_reference,
    residual_layer_norm_modulate_triton,
)
from flux_runtime.kernels.modulate import modulate_reference, modulate_triton
from flux_runtime.kernels.qk_norm_rope import qk_norm_rope_reference, qk_norm_rope_triton
from flux_runtime.kernels.qk_norm_rope_fp32 import qk_norm_rope_fp32_reference, qk_norm_rope_fp32_triton
from flux_runtime.kernels.swiglu import swiglu_reference, swiglu_triton
from flux_runtime.kernels.token_gated_residual import (
    joint_token_gated_residual_reference,
    joint_token_gated_residual_triton,
    token_gated_residual_reference,
    token_gated_residual_triton,
)
from flux_runtime.kernels.token_layer_norm_modulate import (
    token_layer_norm_modulate_reference,
    token_layer_norm_modulate_triton,
)

# the kernel modules (the package re-exports each op under its module's name)
LN = importlib.import_module("flux_runtime.kernels.layer_norm_modulate")
QK = importlib.import_module("flux_runtime.kernels.qk_norm_rope")

COPY_CEILING_GBS = 4160.0  # device-to-device copy, bytes read + written, H200
EPS = 1e-6
WIDTHS = {3072: 24, 6144: 48}  # hidden size -> heads of 128
TXT = 512
IMAGES = {"512²": 1024, "1024²": 4096, "768×1344": 4032}
BATCHES = (1, 2)
DTYPES = (torch.bfloat16, torch.float16)
FF_INNER = 12288  # FLUX.1 MLP hidden
SWIGLU = {"dev": (6144, 18432), "klein4B": (3072, 9216), "klein9B": (4096, 12288)}  # name -> (D, M)


@dataclass
class Case:
    op: str
    label: str
    dtype: torch.dtype
    make: Callable[[], tuple[Any, ...]]  # fresh random inputs (an `out=` buffer last, if any)
    variants: dict[str, Callable[..., Any]]  # name ("" for single-kernel ops) -> fused launcher
    reference: Callable[..., Any]
    nbytes: int  # minimal HBM traffic of the fused kernel
    default: str = ""  # the variant the op runs now

    @property
    def has_out(self) -> bool:
        """The last input is an `out=` buffer, written by the fused op and the reference alike."""
        return self.op.endswith("out=")


def _act(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    x = torch.randn(shape, device="cuda")
    offset = torch.randn(*shape[:-1], 1, device="cuda") * 2
    spread = torch.rand(*shape[:-1], 1, device="cuda") * 4 + 0.25
    return (x * spread + offset).to(dtype)


def _mod(b: int, d: int, dtype: torch.dtype) -> list[Tensor]:
    """shift, scale, gate as (B, D) chunk views of one (B, 6D) modulation output, as in the model."""
    return list((torch.randn(b, 6 * d, device="cuda") * 0.6).to(dtype).chunk(6, dim=1))


def _rope(length: int) -> tuple[Tensor, Tensor]:
    pos = torch.stack(
        [torch.zeros(length), torch.randint(0, 64, (length,)), torch.randint(0, 84, (length,))], dim=1
    ).double()
    cos, sin = [], []
    for axis, d in enumerate((16, 56, 56)):
        angles = torch.outer(pos[:, axis], 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)))
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, -1).cuda(), torch.cat(sin, -1).cuda()


def _nan(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def _variants(fn: Callable[..., Any], module: Any, **tile: Any) -> tuple[dict[str, Callable[..., Any]], str]:
    return {v: partial(fn, variant=v, **tile) for v in module.VARIANTS}, module.VARIANT


def _row_shapes() -> Iterator[tuple[str, int, int, int]]:
    lengths = {f"txt {TXT}": TXT}
    for name, n in IMAGES.items():
        lengths[f"img {name}"] = n
        lengths[f"joint {name}"] = TXT + n
    for d in WIDTHS:
        for name, n in lengths.items():
            for b in BATCHES:
                yield f"{name} B{b} D{d}", b, n, d
    yield "odd B2 L7 D1000", 2, 7, 1000


def _row_cases(dtype: torch.dtype, s: int) -> Iterator[Case]:
    ln_variants, ln_default = _variants(layer_norm_modulate_triton, LN)
    rln_variants, _ = _variants(residual_layer_norm_modulate_triton, LN)
    for label, b, n, d in _row_shapes():
        bld, bd = b * n * d * s, b * d * s

        def mod_in(b: int = b, n: int = n, d: int = d) -> tuple[Any, ...]:
            shift, scale = _mod(b, d, dtype)[:2]
            return _act((b, n, d), dtype), shift, scale

        def res_in(b: int = b, n: int = n, d: int = d) -> tuple[Any, ...]:
            gate = _mod(b, d, dtype)[2]
            return _act((b, n, d), dtype) * 4, gate, _act((b, n, d), dtype)

        def ln_in(b: int = b, n: int = n, d: int = d) -> tuple[Any, ...]:
            shift, scale = _mod(b, d, dtype)[:2]
            return _act((b, n, d), dtype), shift, scale, EPS

        def rln_in(b: int = b, n: int = n, d: int = d) -> tuple[Any, ...]:
            shift, scale, gate = _mod(b, d, dtype)[:3]
            return _act((b, n, d), dtype) * 4, gate, _act((b, n, d), dtype), shift, scale, EPS

        yield Case(
            "modulate", label, dtype, mod_in, {"": modulate_triton}, modulate_reference, 2 * bld + 2 * bd
        )
        yield Case(
            "gated_residual", label, dtype, res_in, {"": gated_residual_triton}, gated_residual_reference,
            3 * bld + bd,
        )  # fmt: skip
        yield Case(
            "layer_norm_modulate", label, dtype, ln_in, ln_variants, layer_norm_modulate_reference,
            2 * bld + 2 * bd, ln_default,
        )  # fmt: skip
        yield Case(
            "residual_layer_norm_modulate", label, dtype, rln_in, rln_variants,
            residual_layer_norm_modulate_reference, 4 * bld + 3 * bd, ln_default,
        )  # fmt: skip


def _qk_case(
    label: str,
    dtype: torch.dtype,
    b: int,
    n_txt: int,
    n_img: int,
    h: int,
    variants: dict[str, Any],
    default: str,
) -> Case:
    def qk_in() -> tuple[Any, ...]:
        x_img = _act((b, n_img, h, 128), dtype)
        w_img = (torch.rand(128, device="cuda") * 2).to(dtype)
        x_txt = _act((b, n_txt, h, 128), dtype) if n_txt else None
        w_txt = (torch.rand(128, device="cuda") * 2).to(dtype) if n_txt else None
        return (x_txt, x_img, w_txt, w_img, *_rope(n_txt + n_img), EPS)

    s = torch.empty((), dtype=dtype).element_size()
    nbytes = 2 * b * (n_txt + n_img) * h * 128 * s + 2 * (n_txt + n_img) * 128 * 4
    return Case("qk_norm_rope", label, dtype, qk_in, variants, qk_norm_rope_reference, nbytes, default)


def _qk_cases(dtype: torch.dtype) -> Iterator[Case]:
    variants, default = _variants(qk_norm_rope_triton, QK)
    shapes = [
        (f"double {name} B{b} H{h}", b, TXT, n, h)
        for h in WIDTHS.values()
        for name, n in IMAGES.items()
        for b in BATCHES
    ]
    shapes += [
        (f"single {name} B{b} H{h}", b, 0, TXT + n, h)
        for h in WIDTHS.values()
        for name, n in IMAGES.items()
        for b in BATCHES
    ]
    shapes.append(("odd B2 L3+5 H3", 2, 3, 5, 3))
    for label, b, n_txt, n_img, h in shapes:
        yield _qk_case(label, dtype, b, n_txt, n_img, h, variants, default)


def _activation_cases(dtype: torch.dtype, s: int) -> Iterator[Case]:
    gelu_rows = [(f"{name} B{b}", b * n) for name, n in [("txt", TXT), *IMAGES.items()] for b in BATCHES]
    gelu_rows += [(f"joint {name} B{b}", b * (TXT + n)) for name, n in IMAGES.items() for b in BATCHES]
    gelu_rows.append(("odd 3x1001", -1))
    for label, rows in gelu_rows:
        shape = (rows, FF_INNER) if rows > 0 else (3, 1001)

        def gelu_in(shape: tuple[int, int] = shape) -> tuple[Any, ...]:
            return ((torch.randn(shape, device="cuda") * 3).to(dtype),)

        numel = shape[0] * shape[1]
        yield Case(
            "gelu_tanh", label, dtype, gelu_in, {"": gelu_tanh_triton}, gelu_tanh_reference, 2 * numel * s
        )

    # FLUX.1 single block: the MLP columns of the packed linear1 output in, a fresh tensor or
    # the right column slice of the (B, L, D + M) `[attn | mlp]` buffer out
    d = 3072
    for name, n in IMAGES.items():
        tokens = TXT + n

        def packed_gelu_in(tokens: int = tokens) -> tuple[Any, ...]:
            packed = (torch.randn(1, tokens, 3 * d + FF_INNER, device="cuda") * 3).to(dtype)
            return (packed[..., 3 * d :],)

        def out_gelu_in(tokens: int = tokens) -> tuple[Any, ...]:
            return (*packed_gelu_in(tokens), _nan((1, tokens, d + FF_INNER), dtype)[..., d:])

        numel = tokens * FF_INNER
        label = f"single {name} B1"
        yield Case(
            "gelu_tanh packed",
            label,
            dtype,
            packed_gelu_in,
            {"": gelu_tanh_triton},
            gelu_tanh_reference,
            2 * numel * s,
        )
        yield Case(
            "gelu_tanh out=",
            label,
            dtype,
            out_gelu_in,
            {"": gelu_tanh_triton},
            gelu_tanh_reference,
            2 * numel * s,
        )

    # FLUX.2 SwiGLU at 1024²: double-block MLPs on contiguous (B, L, 2M) (text, image), the single
    # block's [gate | up] as a column slice of the packed (B, L, 3D + 2M) output, fresh or into h[..., D:]
    n = IMAGES["1024²"]
    for model, (d, m) in SWIGLU.items():
        for b in BATCHES:
            for site, tokens in (("txt", TXT), ("img", n)):

                def mlp_in(b: int = b, tokens: int = tokens, m: int = m) -> tuple[Any, ...]:
                    return ((torch.randn(b, tokens, 2 * m, device="cuda") * 3).to(dtype),)

                label = f"{model} {site} 1024² B{b}"
                yield Case(
                    "swiglu",
                    label,
                    dtype,
                    mlp_in,
                    {"": swiglu_triton},
                    swiglu_reference,
                    3 * b * tokens * m * s,
                )

            def packed_in(b: int = b, d: int = d, m: int = m) -> tuple[Any, ...]:
                packed = (torch.randn(b, TXT + n, 3 * d + 2 * m, device="cuda") * 3).to(dtype)
                return (packed[..., 3 * d :],)

            def out_in(b: int = b, d: int = d, m: int = m) -> tuple[Any, ...]:
                return (*packed_in(b, d, m), _nan((b, TXT + n, d + m), dtype)[..., d:])

            label, nbytes = f"{model} single 1024² B{b}", 3 * b * (TXT + n) * m * s
            yield Case(
                "swiglu packed", label, dtype, packed_in, {"": swiglu_triton}, swiglu_reference, nbytes
            )
            yield Case("swiglu out=", label, dtype, out_in, {"": swiglu_triton}, swiglu_reference, nbytes)
    yield Case(
        "swiglu", "odd 3x(2x501)", dtype, lambda: ((torch.randn(3, 1002, device="cuda") * 3).to(dtype),),
        {"": swiglu_triton}, swiglu_reference, 3 * 3 * 501 * s,
    )  # fmt: skip


def _fp8_bits(q: Any) -> tuple[Tensor, Tensor]:
    """An `Fp8Act` as (uint8 codes, fp32 row scales), comparable with `torch.equal`."""
    return q.data.view(torch.uint8), q.scale


def _three_passes(o: Tensor, x: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """The single block's dynamic FP8 input as the kernels made it before `attention_act_fp8`: the
    activation into a 16-bit `[attn | mlp]` buffer, the heads copied beside it, then one quantization."""
    b, n, h, hd = o.shape
    d = h * hd
    m = x.shape[-1] // 2 if act == "swiglu" else x.shape[-1]
    buf = torch.empty(b, n, d + m, dtype=x.dtype, device=x.device)
    (swiglu_triton if act == "swiglu" else gelu_tanh_triton)(x, out=buf[..., d:])
    buf[..., :d].unflatten(-1, (h, hd)).copy_(o)
    return _fp8_bits(act_quantize_triton(buf, "identity", None, None))


def _whole_rows(act: str) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """`act`'s per-row e4m3 producer with each row held in registers (`act_block`), the setting restored."""

    def run(x: Tensor) -> tuple[Tensor, Tensor]:
        with act_block(act, None):
            return _fp8_bits(act_quantize_triton(x, act, None, None))

    return run


def _act_fp8_cases(dtype: torch.dtype, s: int) -> Iterator[Case]:
    """The double blocks' MLP activation in e4m3 with per-row scales (the down projection's input) at 1024², B1,
    image and text rows: FLUX.1's tanh-GELU (`gelu_tanh_fp8`) and the klein models' SwiGLU (`swiglu_fp8`), each
    swept twice in 1024- or 2048-wide blocks (tanh-GELU's first sweep takes the max shortcut; also without it:
    "2 GELUs") and with each row held in registers ("whole rows"); the default is starred."""
    sites = [("gelu_tanh", "flux1", FF_INNER)] + [("swiglu", k, SWIGLU[k][1]) for k in ("klein4B", "klein9B")]
    for act, model, m in sites:
        for where, rows in (("img 1024²", IMAGES["1024²"]), ("txt", TXT)):
            k = 2 * m if act == "swiglu" else m

            def make(rows: int = rows, k: int = k) -> tuple[Any, ...]:
                return ((torch.randn(1, rows, k, device="cuda") * 3).to(dtype),)

            shortcut = (("", True), (", 2 GELUs", False)) if act == "gelu_tanh" else (("", None),)
            variants = {
                f"{blk} blocks{tag}": lambda x, blk=blk, on=on, act=act: _fp8_bits(
                    act_quantize_triton(x, act, None, None, block_n=blk, gelu_shortcut=on)
                )
                for blk in (1024, 2048)
                for tag, on in shortcut
            }
            default = ACT_BLOCK_DEFAULTS[act]
            yield Case(
                f"{act}_fp8", f"{model} double {where} B1", dtype, make,
                {**variants, "whole rows": _whole_rows(act)},
                lambda x, act=act: _fp8_bits(act_quantize_reference(x, act, None, None)),
                rows * (k * s + m + 4), default="whole rows" if default is None else f"{default} blocks",
            )  # fmt: skip


# (tile, warps) `--tune` tries beside the default (1024 or 2048 values by the row's width, 4 warps) for the
# `[attention | act]` producer
ATTENTION_ACT_TILES = ((1024, 2), (1024, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (8192, 16))


def _attention_act_cases(
    dtype: torch.dtype, s: int, tiles: tuple[tuple[int, int], ...] = ()
) -> Iterator[Case]:
    """The single block's `[attention | activation]` e4m3 input with per-row scales at 1024², B1: the one
    kernel (its default tile and warps, and each (tile, warps) of `tiles`) against the three it replaces and
    the eager chain. At the tanh-GELU site also the kernel without its max shortcut ("2 GELUs": GELU in both
    sweeps), beside the default that has it, each checked bit-exact on its own; and that site again with
    every input negative ("flux1 fallback"), where no row can take the shortcut: its worst case."""
    tokens = TXT + IMAGES["1024²"]
    sites = [("flux1 single", 3072, FF_INNER, "gelu_tanh"), ("flux1 fallback", 3072, FF_INNER, "gelu_tanh")]
    sites += [(f"{k} single", d, m, "swiglu") for k, (d, m) in SWIGLU.items()]
    for model, d, m, act in sites:

        def make(
            d: int = d, m: int = m, act: str = act, fallback: bool = "fallback" in model
        ) -> tuple[Any, ...]:
            o = (torch.randn(1, d // 128, tokens, 128, device="cuda") * 2).to(dtype).permute(0, 2, 1, 3)
            k = 2 * m if act == "swiglu" else m
            packed = torch.randn(1, tokens, 3 * d + k, device="cuda") * 3
            if fallback:  # each row's largest GELU in magnitude is a negative input's
                packed = -packed.abs() - 2**-6
            return o, packed.to(dtype)[..., 3 * d :], act

        k = 2 * m if act == "swiglu" else m
        two_gelus = {
            "2 GELUs": lambda o, x, a: _fp8_bits(attention_act_quantize_triton(o, x, a, gelu_shortcut=False))
        }
        yield Case(
            "attention_act_fp8", f"{model} 1024² B1", dtype, make,
            {
                "one pass": lambda o, x, a: _fp8_bits(attention_act_quantize_triton(o, x, a)),
                **(two_gelus if act == "gelu_tanh" else {}),
                **{
                    f"{blk}/{w}w": lambda o, x, a, blk=blk, w=w: _fp8_bits(
                        attention_act_quantize_triton(o, x, a, block=blk, num_warps=w)
                    )
                    for blk, w in tiles
                },
                "three": _three_passes,
            },
            lambda o, x, a: _fp8_bits(attention_act_quantize_reference(o, x, a)),
            tokens * ((d + k) * s + d + m + 4), default="one pass",
        )  # fmt: skip


# FLUX.3 Klein: hidden 3072, 24 heads; 480 text tokens; (name, image tokens, reference tokens)
FLUX3_D, FLUX3_H, FLUX3_TXT = 3072, 24, 480
FLUX3_IMAGES = [("512²", 1024, 0), ("1024²", 4096, 0), ("1024²+ref", 4096, 4096)]


def _flux3_row_in(dtype: torch.dtype, b: int, n_txt: int, n: int, with_update: bool) -> tuple[Any, ...]:
    """FLUX.3 inputs: per-token (B, L, 3D) modulation chunks of the content (and the text when n_txt)."""
    d = FLUX3_D
    shift, scale, gate = (torch.randn(b, n, 3 * d, device="cuda") * 0.6).to(dtype).chunk(3, dim=-1)
    x = _act((b, n, d), dtype)
    txt: tuple[Any, ...] = ()
    if n_txt:
        t_shift, t_scale, t_gate = (
            (torch.randn(b, n_txt, 3 * d, device="cuda") * 0.6).to(dtype).chunk(3, dim=-1)
        )
        txt = (
            (_act((b, n_txt, d), dtype), t_gate)
            if with_update
            else (_act((b, n_txt, d), dtype), t_shift, t_scale)
        )
    if with_update:  # gated residual: [txt,] x, gate, attn, mlp over the joint sequence
        a, u = (_act((b, n_txt + n, d), dtype) for _ in range(2))
        return (*txt, x * 4, gate, a, u)
    return (*(txt or (None, None, None)), x, shift, scale, EPS)


def _flux3_qk_case(label: str, dtype: torch.dtype, b: int, n: int, variants: dict[str, Any]) -> Case:
    def qk_in() -> tuple[Any, ...]:
        # separate q/k/v GEMM outputs (B, L, D) viewed as heads; the norm weights fp32
        q, k = (_act((b, n, FLUX3_D), dtype).unflatten(-1, (FLUX3_H, 128)) for _ in range(2))
        w_q, w_k = (torch.rand(128, device="cuda") * 2 for _ in range(2))
        return (q, k, w_q, w_k, *_rope(n), EPS)

    s = torch.empty((), dtype=dtype).element_size()
    nbytes = 4 * b * n * FLUX3_D * s + 2 * n * 128 * 4
    return Case("qk_norm_rope_fp32", label, dtype, qk_in, variants, qk_norm_rope_fp32_reference, nbytes)


def _flux3_cases(dtype: torch.dtype, s: int) -> Iterator[Case]:
    per_mode = [(f"txt {FLUX3_TXT}", FLUX3_TXT)] + [(f"img {name}", n) for name, n, _ in FLUX3_IMAGES[:2]]
    joint = [(f"joint {name}", n + r) for name, n, r in FLUX3_IMAGES]
    for b in BATCHES:
        for label, n in per_mode:
            bld = b * n * FLUX3_D * s
            yield Case(
                "token_layer_norm_modulate", f"F3 {label} B{b}", dtype,
                partial(_flux3_row_in, dtype, b, 0, n, False), {"": token_layer_norm_modulate_triton},
                token_layer_norm_modulate_reference, 4 * bld,
            )  # fmt: skip
            yield Case(
                "token_gated_residual", f"F3 {label} B{b}", dtype,
                partial(_flux3_row_in, dtype, b, 0, n, True), {"": token_gated_residual_triton},
                token_gated_residual_reference, 5 * bld,
            )  # fmt: skip
            yield _flux3_qk_case(f"F3 {label} B{b}", dtype, b, n, {"": qk_norm_rope_fp32_triton})
        for label, n in joint:
            bld = b * (FLUX3_TXT + n) * FLUX3_D * s
            yield Case(
                "token_layer_norm_modulate joint", f"F3 {label} B{b}", dtype,
                partial(_flux3_row_in, dtype, b, FLUX3_TXT, n, False), {"": token_layer_norm_modulate_triton},
                token_layer_norm_modulate_reference, 4 * bld,
            )  # fmt: skip
            yield Case(
                "joint_token_gated_residual", f"F3 {label} B{b}", dtype,
                partial(_flux3_row_in, dtype, b, FLUX3_TXT, n, True), {"": joint_token_gated_residual_triton},
                joint_token_gated_residual_reference, 5 * bld,
            )  # fmt: skip
            yield _flux3_qk_case(f"F3 {label} B{b}", dtype, b, FLUX3_TXT + n, {"": qk_norm_rope_fp32_triton})


# GGUF projections of FLUX.1-dev (out, in) and the types timed at them (the kernel's tests cover all types)
GGUF_SHAPES = ((3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (21504, 3072), (3072, 15360))
GGUF_TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _gguf_blocks(name: str, rows: int, cols: int) -> tuple[Tensor]:
    """(rows, bytes) uint8 blocks of GGML type `name`: random codes, fp16 scales from N(0, 0.02)."""
    qtype = GGML_TYPES[name]
    n = rows * cols // qtype.block
    raw = torch.randint(0, 256, (n, qtype.type_size), device="cuda").to(torch.uint8)
    for off in HALF_FIELDS[name]:
        raw[:, off : off + 2] = (torch.randn(n, 1, device="cuda") * 0.02).half().view(torch.uint8)
    return (raw.reshape(rows, -1),)


def _gguf_cases(dtype: torch.dtype, s: int) -> Iterator[Case]:
    """GGUF dequantization, blocks to `dtype`, at FLUX.1-dev's projection shapes."""
    for name in GGUF_TYPES:
        qtype = GGML_TYPES[name]
        for rows, cols in GGUF_SHAPES:
            nbytes = rows * cols // qtype.block * qtype.type_size + rows * cols * s
            yield Case(
                "gguf_dequant", f"{name} {rows}x{cols}", dtype, partial(_gguf_blocks, name, rows, cols),
                {"": partial(dequantize_triton, qtype=qtype, dtype=dtype)},
                partial(dequantize_reference, qtype=qtype, dtype=dtype), nbytes,
            )  # fmt: skip


def cases(dtype: torch.dtype) -> Iterator[Case]:
    s = torch.empty((), dtype=dtype).element_size()
    yield from _row_cases(dtype, s)
    yield from _qk_cases(dtype)
    yield from _activation_cases(dtype, s)
    yield from _attention_act_cases(dtype, s)
    yield from _act_fp8_cases(dtype, s)
    yield from _flux3_cases(dtype, s)
    yield from _gguf_cases(dtype, s)


def tune_cases() -> Iterator[Case]:
    """v2 tile sizes at the 1024² joint shapes (bf16, batch 1), and the `[attention | act]` producer's
    `ATTENTION_ACT_TILES`: `--tune`."""
    dtype, s, n = torch.bfloat16, 2, TXT + IMAGES["1024²"]
    yield from _attention_act_cases(dtype, s, ATTENTION_ACT_TILES)
    for d in WIDTHS:

        def ln_in(d: int = d) -> tuple[Any, ...]:
            shift, scale = _mod(1, d, dtype)[:2]
            return _act((1, n, d), dtype), shift, scale, EPS

        def rln_in(d: int = d) -> tuple[Any, ...]:
            shift, scale, gate = _mod(1, d, dtype)[:3]
            return _act((1, n, d), dtype) * 4, gate, _act((1, n, d), dtype), shift, scale, EPS

        rows = {f"v2 rows {r}": r for r in (1, 2, 4)}
        bld = n * d * s
        yield Case(
            "layer_norm_modulate", f"joint 1024² B1 D{d}", dtype, ln_in,
            {k: partial(layer_norm_modulate_triton, variant="v2", rows_per_program=r) for k, r in rows.items()},
            layer_norm_modulate_reference, 2 * bld,
        )  # fmt: skip
        yield Case(
            "residual_layer_norm_modulate", f"joint 1024² B1 D{d}", dtype, rln_in,
            {k: partial(residual_layer_norm_modulate_triton, variant="v2", rows_per_program=r) for k, r in rows.items()},
            residual_layer_norm_modulate_reference, 4 * bld,
        )  # fmt: skip
    for h in WIDTHS.values():
        tiles = {f"v2 {t}x{hb}": (t, hb) for t in (4, 8, 16) for hb in (8, 16)}
        variants = {
            k: partial(qk_norm_rope_triton, variant="v2", tokens_per_program=t, heads_per_program=hb)
            for k, (t, hb) in tiles.items()
        }
        yield _qk_case(f"single 1024² B1 H{h}", dtype, 1, 0, n, h, variants, "")
    # FLUX.3 at 1024² + one reference, joint: rows per program, q/k tiles, residual blocks
    n3 = FLUX3_TXT + 2 * 4096
    bld3 = n3 * FLUX3_D * s
    yield Case(
        "token_layer_norm_modulate joint", "F3 joint 1024²+ref B1", dtype,
        partial(_flux3_row_in, dtype, 1, FLUX3_TXT, 2 * 4096, False),
        {f"rows {r}": partial(token_layer_norm_modulate_triton, rows_per_program=r) for r in (1, 2, 4)},
        token_layer_norm_modulate_reference, 4 * bld3,
    )  # fmt: skip
    yield Case(
        "joint_token_gated_residual", "F3 joint 1024²+ref B1", dtype,
        partial(_flux3_row_in, dtype, 1, FLUX3_TXT, 2 * 4096, True),
        {
            f"{bl}x{bd}": partial(joint_token_gated_residual_triton, block_l=bl, block_d=bd)
            for bl in (1, 4, 8) for bd in (512, 1024, 2048)
        },
        joint_token_gated_residual_reference, 5 * bld3,
    )  # fmt: skip
    qk_tiles = {
        f"{t}x{hb}": partial(qk_norm_rope_fp32_triton, tokens_per_program=t, heads_per_program=hb)
        for t in (4, 8, 16)
        for hb in (4, 8, 16)
    }
    yield _flux3_qk_case("F3 joint 1024²+ref B1", dtype, 1, n3, qk_tiles)
    for model, (d, m) in SWIGLU.items():

        def packed_in(d: int = d, m: int = m) -> tuple[Any, ...]:
            packed = (torch.randn(1, n, 3 * d + 2 * m, device="cuda") * 3).to(dtype)
            return (packed[..., 3 * d :],)

        blocks = {f"{bl}x{bm}": (bl, bm) for bl in (1, 4, 8) for bm in (512, 1024, 2048)}
        variants = {k: partial(swiglu_triton, block_l=bl, block_m=bm) for k, (bl, bm) in blocks.items()}
        yield Case(
            "swiglu packed",
            f"{model} single 1024² B1",
            dtype,
            packed_in,
            variants,
            swiglu_reference,
            3 * n * m * s,
        )


def _outputs(x: Any) -> tuple[Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _poison_allocator(like: tuple[Tensor, ...]) -> None:
    """Leave NaN-filled free blocks of the output sizes in the caching allocator for the kernel's outputs."""
    # e4m3 codes (uint8) get 0xFF, e4m3's NaN: an unwritten code then differs from the reference's
    blocks = [torch.full_like(t, float("nan") if t.is_floating_point() else 255) for t in like]
    torch.cuda.synchronize()
    del blocks


def check(case: Case, fused: Callable[..., Any]) -> str | None:
    """None if `fused` equals the reference on fresh inputs, else what went wrong."""
    args = case.make()
    ref = tuple(t.clone() for t in _outputs(case.reference(*args)))
    if case.has_out:
        args[-1].fill_(float("nan"))  # the reference wrote the `out=` buffer: poison it again
    _poison_allocator(ref)
    try:
        out = _outputs(fused(*args))
    except UnsupportedInput as e:
        return f"rejected by the kernel's guards: {e}"
    torch.cuda.synchronize()
    for i, (o, r) in enumerate(zip(out, ref, strict=True)):
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"output {i}: {tuple(o.shape)}/{o.dtype} vs reference {tuple(r.shape)}/{r.dtype}"
        if bool(o.isnan().any()):
            return f"output {i}: {int(o.isnan().sum())} elements never written (NaN poison left)"
        if not torch.equal(o, r):
            bad = int((o != r).sum())
            diff = (o.float() - r.float()).abs().max().item()
            return f"output {i}: {bad} of {o.numel()} elements differ, max |diff| {diff:.3g}"
    return None


def check_exhaustive(name: str, fused: Tensor, ref: Tensor, values: Tensor) -> str | None:
    same = (fused == ref) | (fused.isnan() & ref.isnan())
    if bool(same.all()):
        return None
    return f"{name}: {int((~same).sum())} of 65536 inputs differ, e.g. {values[~same][:6].float().tolist()}"


def bench_ms(fn: Callable[[], Any], rep_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 1), rep=rep_ms, return_mode="median"))


def run_cases(
    all_cases: Iterator[Case], opts: argparse.Namespace, bench_dtypes: tuple[torch.dtype, ...]
) -> list[str]:
    failures: list[str] = []
    print(
        f"{'op':<29} {'shape':<26} {'dtype':<8} {'variant':<11} {'exact':<5}"
        + (
            ""
            if opts.no_bench
            else f" {'fused us':>9} {'eager us':>9} {'speedup':>7} {'GB/s':>7} {'% copy':>6}"
        )
    )
    for case in all_cases:
        if opts.op and case.op.split()[0] not in opts.op:
            continue
        bench = not opts.no_bench and case.dtype in bench_dtypes
        args = case.make() if bench else ()
        ref_ms = bench_ms(lambda: case.reference(*args), opts.rep_ms) if bench else 0.0  # noqa: B023
        for name, fused in case.variants.items():
            problem = check(case, fused)
            mark = "*" if name and name == case.default else ""
            line = (
                f"{case.op:<29} {case.label:<26} {str(case.dtype)[6:]:<8} {name + mark:<11} "
                f"{'yes' if problem is None else 'NO':<5}"
            )
            if problem is not None:
                failures.append(f"{case.op} {case.label} {case.dtype} {name}: {problem}")
            elif bench:
                fused_ms = bench_ms(lambda: fused(*args), opts.rep_ms)  # noqa: B023
                gbs = case.nbytes / fused_ms / 1e6
                line += (
                    f" {fused_ms * 1e3:9.1f} {ref_ms * 1e3:9.1f} {ref_ms / fused_ms:6.2f}x"
                    f" {gbs:7.0f} {100 * gbs / COPY_CEILING_GBS:5.0f}%"
                )
            print(line, flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true", help="check bit-exactness only")
    parser.add_argument("--bench-fp16", action="store_true", help="time fp16 too (bf16 only by default)")
    parser.add_argument(
        "--tune", action="store_true", help="also sweep the tile sizes at the 1024² joint shapes"
    )
    parser.add_argument("--op", action="append", help="only these ops (repeatable)")
    parser.add_argument("--rep-ms", type=int, default=20, help="do_bench time per measurement (ms)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    start = time.monotonic()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"defaults: layer_norm_modulate {LN.VARIANT}, qk_norm_rope {QK.VARIANT}")
    failures: list[str] = []

    for dtype in DTYPES:
        values = all_half_values(dtype, "cuda")
        checks = {
            "gelu_tanh": lambda v=values: check_exhaustive(
                "gelu_tanh", gelu_tanh_triton(v), gelu_tanh_reference(v), v
            ),
            "swiglu": lambda v=values: check_exhaustive(
                "silu", swiglu_triton(torch.cat([v, torch.ones_like(v)])), torch.nn.functional.silu(v), v
            ),
        }
        for op, run in checks.items():
            if opts.op and op not in opts.op:
                continue
            problem = run()
            print(f"{op} all 65536 {str(dtype)[6:]} inputs: {'bit-exact' if problem is None else problem}")
            if problem is not None:
                failures.append(f"{op} exhaustive {dtype}: {problem}")

    bench_dtypes = DTYPES if opts.bench_fp16 else (torch.bfloat16,)
    for dtype in DTYPES:
        failures += run_cases(cases(dtype), opts, bench_dtypes)
    if opts.tune:
        print("\ntile sweep, bf16:")
        failures += run_cases(tune_cases(), opts, (torch.bfloat16,))

    print(f"\n{time.monotonic() - start:.0f} s")
    if failures:
        print(f"\n{len(failures)} FAILURES:")
        for f in failures:
            print(f"  {f}")
        return 1
    print("\nall fused kernels bit-exact against their references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
