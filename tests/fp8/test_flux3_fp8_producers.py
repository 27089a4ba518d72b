"""FLUX.3's FP8 blocks with their inputs quantized by the producers, `torch.equal` to the FP8 eager reference.

The eager reference is the block as the bf16 model runs it (itself `torch.equal` to diffusers) with every
FP8 layer quantizing its own 16-bit input (`x.float() * (1 / s)`, clamp ±448, e4m3; per token with
`s = amax * (1 / 448)` when the layer has no input scale) and running one `torch._scaled_mm`: written here,
not taken from the runtime. Ours quantizes the block's modulated input once for q_proj, k_proj, v_proj and
mlp_in where they quantize alike (in the LayerNorm kernel itself) and forms mlp_out's e4m3 input in SwiGLU.

On the CPU the dispatch runs every op's reference, so the first tests check the plan and the math at FLUX.3's
real width (3072, heads of 128). Under the Triton interpreter the block runs the fused kernels themselves
(patched in, as the GPU's lossless tier would run them) against the reference with the same 16-bit kernels:
only where the quantization happens differs. The GPU tests run the real dispatch at full size.
"""

from __future__ import annotations

import copy
import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import Tensor, nn

from flux_runtime import kernels
from flux_runtime.kernels import fp8
from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.kernels.swiglu import swiglu_triton
from flux_runtime.models.dit import FLUX3_KLEIN
from flux_runtime.models.dit.config import TINY_FLUX3
from flux_runtime.models.dit.flux3 import Block, share_input
from flux_runtime.models.dit.layers import Fp8Linear, rope_tables
from flux_runtime.weights.fp8 import quantize_weight
from flux_runtime.weights.transformer import load_transformer
from tests.flux3_fixtures import make_inputs, our_forward
from tests.kernels.helpers import gpu, interpreter

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
flux3 = importlib.import_module("flux_runtime.models.dit.flux3")
tlnm = importlib.import_module("flux_runtime.kernels.token_layer_norm_modulate")
LAYERS = ("q_proj", "k_proj", "v_proj", "attn_out", "mlp_in", "mlp_out")
# FLUX.3's width and heads, a narrow MLP (the CPU's FP8 GEMMs are slow; the MLP width is not what is tested)
WIDE = replace(FLUX3_KLEIN, mlp_ratio=0.125, depth=1, depth_single_blocks=1)

# input scale of each FP8 layer (None: per token); layers not named use `rest`
CASES: dict[str, tuple[dict[str, float | None], float | None]] = {
    "per-token": ({}, None),
    "static-equal": ({}, 0.012),  # calibrated checkpoints: one input, one scale (separate tensors)
    "static-differ": ({"k_proj": 0.02, "mlp_in": 0.03}, 0.012),  # three groups: (q, v), k, mlp_in
    "static-and-per-token": ({"mlp_in": None, "mlp_out": None}, 0.012),
}
PLANS = {
    "per-token": (0, 0, 0, 0),
    "static-equal": (0, 0, 0, 0),
    "static-differ": (0, 1, 0, 3),
    "static-and-per-token": (0, 0, 0, 3),
}


def fp8_block(cfg, case: str, seed: int = 0) -> Block:
    """A `Block` of `cfg` with random weights, its six projections FP8 (per-channel weight scales) as `case` says."""
    gen = torch.Generator().manual_seed(seed)
    block = Block(cfg)
    with torch.no_grad():
        for norm in (block.norm.query_norm, block.norm.key_norm):
            norm.scale.copy_(1 + 0.2 * torch.randn(norm.scale.shape, generator=gen))
    scales, rest = CASES[case]
    for name in LAYERS:
        old = getattr(block, name)
        w = (torch.randn(old.out_features, old.in_features, generator=gen) * old.in_features**-0.5).to(BF16)
        t = quantize_weight(w)
        s = scales.get(name, rest)
        new = Fp8Linear(old.in_features, old.out_features, bias=False, static=s is not None)
        new.weight, new.weight_scale = t.weight, t.weight_scale
        if s is not None:
            new.input_scale = torch.tensor(s)
            new.input_scale_inv = new.input_scale.reciprocal()
        setattr(block, name, new)
    return block


class OwnQuant(nn.Module):
    """An FP8 layer as the eager reference runs it: quantizes its own 16-bit input, then one scaled GEMM."""

    act_quant = None  # to the block a 16-bit layer: it is handed the 16-bit input

    def __init__(self, layer: Fp8Linear) -> None:
        super().__init__()
        self.wq, self.ws, self.s_in = layer.weight, layer.weight_scale, layer.input_scale

    def forward(self, x: Tensor) -> Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.s_in is None:
            s = x2.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) * (1.0 / 448.0)
        else:
            s = self.s_in.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        xq = x2.float() * s.reciprocal() if self.s_in is None else x2.float() * (1.0 / self.s_in)
        xq = xq.clamp(-448, 448).to(E4M3)
        y = torch._scaled_mm(xq, self.wq.t(), scale_a=s, scale_b=self.ws.reshape(1, -1), out_dtype=BF16)
        return y.reshape(*lead, -1)


def eager_reference(block: Block) -> Block:
    ref = copy.deepcopy(block)
    for name in LAYERS:
        setattr(ref, name, OwnQuant(getattr(ref, name)))
    return ref


def block_inputs(cfg, n_txt: int, n: int, seed: int = 1):
    """Streams (B, L, D), per-token modulations (B, L, 3D) and the joint RoPE tables, in bf16 / fp32."""
    gen = torch.Generator().manual_seed(seed)
    d = cfg.hidden_size

    def stream(length: int) -> Tensor:
        return (torch.randn(1, length, d, generator=gen) * 2 + 0.5).to(BF16)

    def mod(length: int) -> Tensor:
        return (torch.randn(1, length, 3 * d, generator=gen) * 0.5).to(BF16)

    ids = torch.cat([torch.zeros(n_txt + n, 3), torch.arange(n_txt + n, dtype=torch.float32)[:, None]], dim=1)
    pe = rope_tables(ids, cfg.axes_dim, cfg.theta)
    return stream(n_txt), stream(n), mod(n_txt), mod(n), pe


def run_both(block: Block, ref: Block, x) -> None:
    """The per-mode form (content alone) and the joint form over `[txt | content]`: ours equals the reference."""
    txt, content, mod_txt, mod, pe = x
    n = content.shape[1]
    pe_content = (pe[0][-n:], pe[1][-n:])
    with torch.no_grad():
        assert torch.equal(block(content, mod, pe_content), ref(content, mod, pe_content))
        got, want = block.joint(txt, content, mod_txt, mod, pe), ref.joint(txt, content, mod_txt, mod, pe)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --------------------------------------------------------------------------------------------------
# the plan


@pytest.mark.parametrize("case", list(CASES))
def test_which_readers_share_one_quantization(case):
    assert share_input(fp8_block(TINY_FLUX3, case)) == PLANS[case]


def test_a_bf16_block_quantizes_nothing():
    block = Block(TINY_FLUX3)
    assert all(r.act_quant is None for r in block.readers()) and share_input(block) == (0, 1, 2, 3)


def test_the_plan_follows_the_scales():
    """Cached per block, recomputed when a scale changes in place or a layer is replaced; meta scales count
    as equal only when they are the same tensor."""
    block = fp8_block(TINY_FLUX3, "static-equal")
    assert share_input(block) == (0, 0, 0, 0)
    with torch.no_grad():
        block.v_proj.input_scale.mul_(2)
        block.v_proj.input_scale_inv.div_(2)
    assert share_input(block) == (0, 0, 2, 0)
    block.v_proj = fp8_block(TINY_FLUX3, "per-token").v_proj
    assert share_input(block) == (0, 0, 2, 0)  # a per-token v beside static q, k, mlp_in
    block.mlp_in = fp8_block(TINY_FLUX3, "per-token").mlp_in
    assert share_input(block) == (0, 0, 2, 2)
    meta = fp8_block(TINY_FLUX3, "static-equal").to("meta")
    assert share_input(meta) == (0, 1, 2, 3)
    for name in ("k_proj", "v_proj", "mlp_in"):
        layer = getattr(meta, name)
        layer.input_scale, layer.input_scale_inv = meta.q_proj.input_scale, meta.q_proj.input_scale_inv
    assert share_input(meta) == (0, 0, 0, 0)


# --------------------------------------------------------------------------------------------------
# the math at FLUX.3's width


_WIDE: dict[str, tuple[Block, Block]] = {}


def wide_block(case: str) -> tuple[Block, Block]:
    """A FLUX.3-width FP8 block for `case` and its eager reference, built once per test session."""
    if case not in _WIDE:
        block = fp8_block(WIDE, case, seed=list(CASES).index(case))
        _WIDE[case] = (block, eager_reference(block))
    return _WIDE[case]


def test_fp8_block_equals_the_eager_reference():
    """The dispatch's reference ops (what the CPU runs), three input quantizations among the four readers:
    each group quantized once, exact. (One quantization for all four: tests/fp8/test_flux3_fp8.py, whose
    tiny models, calibrated or per token, share it and equal diffusers' FP8 reference.)"""
    block, ref = wide_block("static-differ")
    assert share_input(block) == PLANS["static-differ"]
    run_both(block, ref, block_inputs(WIDE, 3, 4))


class Calls:
    """Fused kernels patched into `flux_runtime.kernels` (the interpreter runs them), each call counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count: Counter[str] = Counter()
        self.patch(monkeypatch, kernels, "token_layer_norm_modulate", tlnm.token_layer_norm_modulate_triton)
        self.patch(
            monkeypatch, kernels, "token_layer_norm_modulate_fp8", tlnm.token_layer_norm_modulate_fp8_triton
        )
        self.patch(
            monkeypatch,
            kernels,
            "quantize",
            lambda x, s=None, i=None: fp8.act_quantize_triton(x, "identity", s, i),
        )
        self.patch(
            monkeypatch,
            kernels,
            "swiglu_fp8",
            lambda x, s=None, i=None: fp8.act_quantize_triton(x, "swiglu", s, i),
        )
        self.patch(monkeypatch, flux3, "swiglu", swiglu_triton)

    def patch(self, monkeypatch: pytest.MonkeyPatch, where: object, name: str, fn: Callable) -> None:
        def counted(*args, **kw):
            self.count[name] += 1
            return fn(*args, **kw)

        monkeypatch.setattr(where, name, counted)


# per block call: the producers that ran in the block (ours) and in the reference
RAN = {
    "per-token": {"token_layer_norm_modulate_fp8": 1, "swiglu_fp8": 1, "quantize": 1},
    "static-equal": {"token_layer_norm_modulate_fp8": 1, "swiglu_fp8": 1, "quantize": 1},
    "static-differ": {"token_layer_norm_modulate": 1, "quantize": 1 + 3, "swiglu_fp8": 1},
    "static-and-per-token": {"token_layer_norm_modulate": 1, "quantize": 1 + 2, "swiglu_fp8": 1},
}
RAN_REFERENCE = {"token_layer_norm_modulate": 1, "swiglu": 1}


@interpreter
@pytest.mark.parametrize(
    "case",
    ["per-token", *(pytest.param(c, marks=pytest.mark.slow) for c in CASES if c != "per-token")],
)
def test_fused_fp8_producers_equal_the_eager_reference(case, monkeypatch):
    """The Triton kernels (interpreter) in a joint block: the e4m3 LayerNorm output written into `[txt | content]`
    and shared by q, k, v and mlp_in, SwiGLU into e4m3, against the reference with the same 16-bit kernels and
    each layer quantizing itself."""
    block, ref = wide_block(case)
    calls = Calls(monkeypatch)
    txt, content, mod_txt, mod, pe = block_inputs(WIDE, 3, 4, seed=5)
    with torch.no_grad():
        got, want = block.joint(txt, content, mod_txt, mod, pe), ref.joint(txt, content, mod_txt, mod, pe)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert calls.count == Counter(RAN[case]) + Counter(RAN_REFERENCE)


# --------------------------------------------------------------------------------------------------
# the model: what ran is recorded


def test_the_record_names_the_fp8_producers():
    """`tiny-flux3-random` with `fp8=True` on the CPU, lossless tier: per block one e4m3 LayerNorm + modulate and
    one e4m3 SwiGLU, one quantization (attn_out's input): none left for q, k, v, mlp_in, mlp_out."""
    model = load_transformer("tiny-flux3-random", dtype=BF16, fp8=True)
    x = make_inputs(1, 3, 3, 6, BF16, seed=2, refs=((2, 2),))
    blocks = 3 * TINY_FLUX3.depth + TINY_FLUX3.depth_single_blocks
    reset_fused_ops_report()
    with use_fused("lossless"):
        got = our_forward(model, x)
    calls = Counter()
    for (op, _reason), n in fused_ops_report().fallbacks.items():  # the CPU runs each op's reference
        calls[op] += n
    assert calls["token_layer_norm_modulate_fp8"] == blocks and calls["swiglu_fp8"] == blocks
    assert calls["fp8_quantize"] == blocks and calls["swiglu"] == 0
    assert calls["token_layer_norm_modulate"] == 1  # the final layer's (bf16)
    with use_fused("off"):
        assert torch.equal(got, our_forward(model, x))


# --------------------------------------------------------------------------------------------------
# GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("n_txt", "n"), [(80, 1024), (480, 4096), (480, 8192)])
def test_gpu_fp8_block_lossless_equals_the_eager_reference(case, n_txt, n):
    """One full-width FLUX.3 block (real MLP width) at real token counts: the lossless tier's fused producers
    `torch.equal` to the same block with reference ops, and to the reference with each layer quantizing itself."""
    cfg = replace(FLUX3_KLEIN, depth=1, depth_single_blocks=1)
    block = fp8_block(cfg, case).cuda()
    ref = eager_reference(block)
    x = tuple(
        t.cuda() if isinstance(t, Tensor) else tuple(u.cuda() for u in t) for t in block_inputs(cfg, n_txt, n)
    )
    reset_fused_ops_report(forget_signatures=True)
    with use_fused("lossless"):
        run_both(block, ref, x)
        txt, content, mod_txt, mod, pe = x
        fused = block.joint(txt, content, mod_txt, mod, pe)
    report = fused_ops_report()
    with use_fused("off"):
        eager = block.joint(txt, content, mod_txt, mod, pe)
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])
    assert not report.mismatches
    shared = PLANS[case] == (0, 0, 0, 0)
    assert (report.fused_calls.get("token_layer_norm_modulate_fp8", 0) > 0) == shared
    assert report.fused_calls.get("swiglu_fp8", 0) > 0


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_gpu_full_size_fp8_producers(static):
    """Full-size FLUX.3 Klein quantized as `fp8=True` does (static: every input scale set to one calibrated-like
    value, and one joint block's mlp_in apart), one 1024² forward with 480 text tokens and a 1024² reference:
    lossless `torch.equal` to the eager reference, the fused producers recorded, none of them falling back."""
    from flux_runtime.weights.flux3_transformer import random_flux3
    from flux_runtime.weights.fp8 import quantize_model

    model = random_flux3(FLUX3_KLEIN, 0, torch.device("cuda"), BF16)
    quantize_model(model, BF16)
    if static:
        for name, m in model.named_modules():
            if isinstance(m, Fp8Linear):
                s = torch.tensor(0.05 if name == "single_blocks.3.mlp_in" else 0.02, device="cuda")
                m.input_scale, m.input_scale_inv = s, s.reciprocal()
    x = make_inputs(1, 64, 64, 480, BF16, seed=0, refs=((64, 64),), flow_map=True)
    x = type(x)(*(t.cuda() if t is not None else None for t in x))
    x = x._replace(txt=torch.randn(1, 480, 20480, device="cuda").to(BF16))
    reset_fused_ops_report(forget_signatures=True)
    with use_fused("lossless"):
        got = our_forward(model, x)
    report = fused_ops_report()
    with use_fused("off"):
        eager = our_forward(model, x)
    assert torch.equal(got, eager)
    blocks = 3 * FLUX3_KLEIN.depth + FLUX3_KLEIN.depth_single_blocks
    print(report)
    producers = {"token_layer_norm_modulate_fp8", "swiglu_fp8", "fp8_quantize"}
    assert not report.mismatches and not [key for key in report.fallbacks if key[0] in producers]
    assert report.fused_calls["token_layer_norm_modulate_fp8"] == blocks - static
    assert report.fused_calls["swiglu_fp8"] == blocks
    assert report.fused_calls["fp8_quantize"] == blocks + (2 if static else 0)  # attn_out (+ the split block)
