"""The attention inputs' layout (`kernels.set_head_major`) moves no bits: q, k and the double blocks' joint V
stored head-major ((B, H, L, D) contiguous behind the (B, L, H, D) views) or (B, L, H, D) contiguous as before.

On the CPU the ops run their references (which store the same layouts as the kernels) and SDPA stores its
output in q's dimension order, as cuDNN and flash attention do, so every consumer of a head-major output (the
double blocks' flatten, the single blocks' `[attn | mlp]` buffer in 16 bits, static e4m3 or the per-row FP8
producer) runs here too. tiny FLUX.1, FLUX.2 and FLUX.3 models with random weights, 3 heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from flux_runtime import kernels, load_transformer
from flux_runtime.kernels import fp8, fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.kernels.qk_norm_rope import head_major_layout
from flux_runtime.models.dit import TINY, TINY_FLUX2, Flux1Transformer, Flux2Transformer, flux3
from flux_runtime.models.dit.layers import Fp8Linear, attention, write_heads
from tests.flux3_fixtures import make_inputs as flux3_inputs
from tests.flux3_fixtures import our_forward as flux3_forward
from tests.kernels.helpers import gpu, interpreter
from tests.parallel.workers import inputs, random_model

LAYOUTS: list[bool | str] = [True, False, "kv"]  # all head-major, none, q as before (the default)


def stored_head_major(t: Tensor) -> bool:
    """Whether (B, L, H, D) `t` is a view of (B, H, L, D) contiguous storage."""
    return t.permute(0, 2, 1, 3).is_contiguous()


def record_attention(model: Any) -> list[tuple[str, Tensor, Tensor, Tensor]]:
    """Install a recording `attend` in every block of `model`: ("double" | "single", q, k, v) per call."""
    seen: list[tuple[str, Tensor, Tensor, Tensor]] = []

    def attend(kind: str) -> Callable[..., Tensor]:
        def run(q: Tensor, k: Tensor, v: Tensor, out: Tensor | None = None, quant: Any = None) -> Tensor:
            seen.append((kind, q, k, v))
            return attention(q, k, v, out, quant)

        return run

    for block in model.double_blocks:
        block.attend = attend("double")
    for block in model.single_blocks:
        block.attend = attend("single")
    return seen


def set_static_scales(model: Any) -> None:
    """Give every FP8 projection a static input scale (a calibrated checkpoint's): producers write e4m3."""
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            s = torch.tensor(0.05)
            m.input_scale, m.input_scale_inv = s, s.reciprocal()


def forward(model: Any, batch: int) -> Tensor:
    args, kwargs = inputs(model, batch, 3, 4, 5)
    with torch.no_grad():
        return model(*args, **kwargs)


@pytest.mark.parametrize("family", ["flux1", "flux2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_attention_inputs_are_stored_as_set(family: str, dtype: torch.dtype) -> None:
    """Each block's attention sees q, k (and the double blocks' joint V) stored as `set_head_major` says; the
    single blocks' v stays as linear1 gives it. The forward is the same in every layout."""
    model = random_model(family, 3, dtype)
    seen = record_attention(model)
    outs = []
    for layout in LAYOUTS:
        seen.clear()
        with head_major_layout(layout):
            outs.append(forward(model, 2))
            roles = [kernels.is_head_major(r) for r in "qkv"]
        assert [kind for kind, *_ in seen] == ["double"] * 2 + ["single"] * 2
        for kind, q, k, v in seen:
            assert [stored_head_major(q), stored_head_major(k)] == roles[:2]
            assert q.is_contiguous() != roles[0] and k.is_contiguous() != roles[1]
            if kind == "double":
                assert stored_head_major(v) == roles[2] and v.is_contiguous() != roles[2]
            else:  # linear1's v as it comes (FLUX.1's own GEMM output, FLUX.2's column slice of one)
                assert not stored_head_major(v)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("family", ["flux1", "flux2"])
@pytest.mark.parametrize("quant", ["per-row", "static"])
def test_fp8_forward_is_the_same_in_every_layout(family: str, quant: str) -> None:
    """FP8 projections (`fp8=True`'s quantization): per-row scales (the single blocks' one-pass
    `attention_act_fp8`, the double blocks quantizing from the heads' view) and static ones (the heads
    written into the e4m3 `[attn | mlp]` buffer a batch row at a time when head-major), batch 2."""
    from flux_runtime.weights.fp8 import quantize_model

    model = random_model(family, 3, torch.bfloat16)
    quantize_model(model, torch.bfloat16)
    if quant == "static":
        set_static_scales(model)
    outs = []
    for layout in LAYOUTS:
        with head_major_layout(layout):
            outs.append(forward(model, 2))
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("fp8_model", [False, True], ids=["bf16", "fp8"])
def test_flux3_forward_is_the_same_in_every_layout(fp8_model: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUX.3's q and k (its fp32 QK norm + RoPE) stored as set, its v its projection's output; the same output."""
    model = load_transformer("tiny-flux3-random", dtype=torch.bfloat16, fp8=fp8_model)
    x = flux3_inputs(2, 3, 3, 6, torch.bfloat16, seed=2, refs=((2, 2),))
    seen: list[tuple[Tensor, Tensor]] = []
    library_sdpa = F.scaled_dot_product_attention

    def sdpa(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kw: Any) -> Tensor:
        seen.append((q, k))
        return library_sdpa(q, k, v, *args, **kw)

    monkeypatch.setattr(flux3.F, "scaled_dot_product_attention", sdpa)  # flux3's `F` is torch.nn.functional
    outs = []
    for layout in LAYOUTS:
        seen.clear()
        with head_major_layout(layout):
            outs.append(flux3_forward(model, x))
            roles = [kernels.is_head_major(r) for r in "qk"]
        assert seen
        for q, k in seen:  # SDPA's (B, H, L, D) arguments: contiguous where stored head-major
            assert [q.is_contiguous(), k.is_contiguous()] == roles
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_gradients_are_the_same_in_every_layout(family: str) -> None:
    """Training runs the references (inputs that require grad): the cast into head-major storage is a `copy_`
    autograd follows, so every weight's gradient is the same bits in each layout."""
    model = random_model(family, 3, torch.float32)
    grads = []
    for layout in LAYOUTS:
        model.zero_grad()
        args, kwargs = inputs(model, 2, 3, 4, 5)
        with head_major_layout(layout):
            model(*args, **kwargs).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other, strict=True))


def test_write_heads_takes_head_major_heads() -> None:
    """Heads stored head-major (SDPA's output for a head-major q) give the same rows, and the same e4m3 codes
    written into a static `[attn | mlp]` buffer slice, as the same heads stored (B, L, H, D) contiguous."""
    b, n, h, d = 2, 5, 3, 128
    o = torch.randn(b, n, h, d).to(torch.bfloat16)
    o_hm = o.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert stored_head_major(o_hm)
    assert torch.equal(write_heads(o_hm), write_heads(o))
    s = torch.tensor(0.02)
    quant = kernels.Fp8Quant(s, s.reciprocal())
    bufs = [torch.zeros(b, n, h * d + 7, dtype=torch.uint8).view(fp8.E4M3) for _ in range(2)]
    for heads, buf in zip((o, o_hm), bufs, strict=True):
        assert write_heads(heads, buf[..., : h * d], quant) is not None
    assert torch.equal(bufs[0].view(torch.uint8), bufs[1].view(torch.uint8))
    assert bufs[0].view(torch.uint8)[..., : h * d].any() and not bufs[0].view(torch.uint8)[..., h * d :].any()
    out16 = [torch.zeros(b, n, h * d, dtype=torch.bfloat16) for _ in range(2)]
    for heads, buf in zip((o, o_hm), out16, strict=True):
        write_heads(heads, buf)
    assert torch.equal(out16[0], out16[1]) and torch.equal(out16[0], o.flatten(2))


@interpreter
def test_static_quantize_kernel_reads_a_head_major_batch_row() -> None:
    """The static e4m3 quantization `write_heads` runs per batch row of head-major heads: a (L, H, D) view whose
    rows are one head of one token (strides (D, L * D, 1)), written into the buffer's (L, H, D) slice."""
    n, h, d, width = 5, 3, 128, 3 * 128 + 64
    o = (torch.randn(1, h, n, d) * 40).to(torch.bfloat16).permute(0, 2, 1, 3)[0]  # (L, H, D), head-major
    s = torch.tensor(0.05)
    got = torch.zeros(n, width, dtype=torch.uint8).view(fp8.E4M3)
    want = torch.zeros(n, width, dtype=torch.uint8).view(fp8.E4M3)
    fp8.act_quantize_triton(o, "identity", s, s.reciprocal(), got[:, : h * d].unflatten(-1, (h, d)))
    fp8.act_quantize_reference(o, "identity", s, s.reciprocal(), want[:, : h * d].unflatten(-1, (h, d)))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.view(torch.uint8).any()


def lossless_in_every_layout(family: str, fp8_model: bool, device: str) -> list[tuple[Tensor, Tensor, Any]]:
    """A model with heads of 128 (what the fused kernels take; 3 heads, 2 double and 2 single blocks) on
    `device`, batch 2, a 32x32 image and 77 text tokens: per layout of `LAYOUTS`, the `lossless` forward, the
    eager (`off`) forward and the fused-ops report of the lossless one (signatures verified afresh)."""
    from flux_runtime.weights.fp8 import quantize_model

    flux1 = family == "flux1"
    cfg = replace(
        TINY if flux1 else TINY_FLUX2,
        num_heads=3,
        hidden_size=384,
        axes_dim=(16, 56, 56) if flux1 else (32,) * 4,
    )
    model = (Flux1Transformer if flux1 else Flux2Transformer)(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    model = model.to(device, torch.bfloat16).eval()
    if fp8_model:
        quantize_model(model, torch.bfloat16)
    args, _ = inputs(model.cpu() if device == "cpu" else model, 2, 32, 32, 77)
    args = tuple(a.to(device) if isinstance(a, Tensor) else a for a in args)
    pe = model.rope(args[3], args[1])
    runs = []
    with torch.no_grad():
        for layout in LAYOUTS:
            with head_major_layout(layout):
                reset_fused_ops_report(forget_signatures=True)
                with use_fused("lossless"):
                    got = model(*args, pe=pe)
                report = fused_ops_report()
                with use_fused("off"):
                    runs.append((got, model(*args, pe=pe), report))
    return runs


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["flux1", "flux2"])
@pytest.mark.parametrize("fp8_model", [False, True], ids=["bf16", "fp8"])
def test_gpu_lossless_forward_is_the_same_in_every_layout(family: str, fp8_model: bool) -> None:
    """On the GPU, where the QK kernel writes each layout and cuDNN's output follows q's: the `lossless` forward
    (fused kernels, FP8's `attention_act_fp8` reading head-major heads) `torch.equal` to the eager one in every
    layout and across layouts, the QK kernel fused in each (no fallback, no mismatch)."""
    runs = lossless_in_every_layout(family, fp8_model, "cuda")
    for got, eager, report in runs:
        assert torch.equal(got, eager)
        assert not report.mismatches, report
        assert report.fused_calls.get("qk_norm_rope", 0) == 8, report  # q and k of 4 blocks
        assert not [key for key in report.fallbacks if key[0] in ("qk_norm_rope", "attention_act_fp8")], (
            report
        )
        if fp8_model:
            assert report.fused_calls.get("attention_act_fp8", 0) == 2, report
    assert all(torch.equal(runs[0][0], got) for got, _, _ in runs[1:])
