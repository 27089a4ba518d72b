"""The tier switch, the per-signature verification gate and the record of every fallback."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial

import pytest
import torch
from torch import Tensor

from flux_runtime import kernels
from flux_runtime.kernels import gguf_dequant
from flux_runtime.kernels.dispatch import (
    FusedOp,
    UnsupportedInput,
    fused_ops_report,
    fused_tier,
    reset_fused_ops_report,
    run_op,
    use_fused,
)
from flux_runtime.kernels.modulate import modulate_reference, modulate_triton
from tests.kernels.helpers import gpu, interpreter, modulation, rope_tables

CPU_REASON = "inputs on cpu; the kernel runs on cuda"


@pytest.fixture(autouse=True)
def fresh_record() -> Iterator[None]:
    reset_fused_ops_report(forget_signatures=True)
    yield
    reset_fused_ops_report(forget_signatures=True)


class Counted:
    """A stand-in kernel or reference that counts its calls."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.fn(x)


def cpu_op(fused: Callable[[Tensor], Tensor], **kw: object) -> tuple[FusedOp, Counted, Counted]:
    """A fake op that runs on the CPU, so the gate can be exercised without a GPU."""
    f, r = Counted(fused), Counted(lambda x: x * 2)
    return FusedOp("fake", fused=f, reference=r, devices=("cpu",), **kw), f, r  # type: ignore[arg-type]


def all_op_calls(device: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, Callable[[], object]]:
    """One call per public op at a small FLUX-like size."""
    b, n, d, h = 1, 8, 3072, 24
    shift, scale, gate = modulation(b, d, dtype, device)[:3]
    x = torch.randn(b, n, d, device=device).to(dtype)
    u = torch.randn(b, n, d, device=device).to(dtype)
    q_txt, q_img = (torch.randn(b, k, h, 128, device=device).to(dtype) for k in (3, n))
    w = torch.rand(128, device=device).to(dtype)
    cos, sin = rope_tables(3 + n, device)
    packed = torch.randn(b, n, 3 * d + 2 * 256, device=device).to(dtype)  # [q | k | v | gate | up]
    h_gelu = torch.zeros(b, n, d + 3 * d, device=device, dtype=dtype)  # [attn | mlp] buffers
    h_swiglu = torch.zeros(b, n, d + 256, device=device, dtype=dtype)
    # FLUX.3: per-token (B, L, 3D) modulations of a 3-token text stream and the n-token content, fp32 norms
    t_shift, t_scale, t_gate = torch.randn(b, n, 3 * d, device=device).to(dtype).chunk(3, dim=-1)
    c_shift, c_scale, c_gate = torch.randn(b, 3, 3 * d, device=device).to(dtype).chunk(3, dim=-1)
    txt = torch.randn(b, 3, d, device=device).to(dtype)
    u_joint = torch.randn(b, 3 + n, d, device=device).to(dtype)
    w32 = torch.rand(128, device=device)
    q3, k3 = (torch.randn(b, n, h, 128, device=device).to(dtype) for _ in range(2))
    cos3, sin3 = rope_tables(n, device)
    q8 = gguf_dequant.BY_NAME["Q8_0"]  # (8, d) GGML Q8_0 blocks: random int8 codes, fp16 scales 1/64
    gguf = torch.randint(0, 256, (8, d // 32, 34), dtype=torch.uint8, device=device)
    gguf[..., :2] = torch.tensor([2.0**-6], dtype=torch.float16, device=device).view(torch.uint8)
    return {
        "modulate": lambda: kernels.modulate(x, shift, scale),
        "gated_residual": lambda: kernels.gated_residual(x, gate, u),
        "layer_norm_modulate": lambda: kernels.layer_norm_modulate(x, shift, scale, 1e-6),
        "residual_layer_norm_modulate": lambda: kernels.residual_layer_norm_modulate(
            x, gate, u, shift, scale
        ),
        "qk_norm_rope": lambda: kernels.qk_norm_rope(q_txt, q_img, w, w, cos, sin, 1e-6),
        "gelu_tanh": lambda: kernels.gelu_tanh(u),
        "gelu_tanh out=": lambda: kernels.gelu_tanh(packed[..., : 3 * d], h_gelu[..., d:]),
        "swiglu": lambda: kernels.swiglu(packed[..., 3 * d :]),
        "swiglu out=": lambda: kernels.swiglu(packed[..., 3 * d :], h_swiglu[..., d:]),
        "token_layer_norm_modulate": lambda: kernels.token_layer_norm_modulate(
            None, None, None, x, t_shift, t_scale, 1e-6
        ),
        "token_layer_norm_modulate joint": lambda: kernels.token_layer_norm_modulate(
            txt, c_shift, c_scale, x, t_shift, t_scale, 1e-6
        ),
        "qk_norm_rope_fp32": lambda: kernels.qk_norm_rope_fp32(q3, k3, w32, w32, cos3, sin3, 1e-6),
        "token_gated_residual": lambda: kernels.token_gated_residual(x, t_gate, u, x),
        "joint_token_gated_residual": lambda: kernels.joint_token_gated_residual(
            txt, c_gate, x, t_gate, u_joint, u_joint
        ),
        "gguf_dequant": lambda: kernels.gguf_dequant_as(gguf.reshape(8, -1), q8, dtype),
    }


def test_tier_off_runs_the_reference_and_records_nothing() -> None:
    assert fused_tier() == "off"
    for call in all_op_calls("cpu").values():
        call()
    report = fused_ops_report()
    assert report.fused_calls == {} and report.fallbacks == {} and not report.all_fused
    assert report.tier_used == "off"


def test_use_fused_sets_and_restores_the_tier() -> None:
    with use_fused("lossless"):
        assert fused_tier() == "lossless"
        with use_fused("high"):
            assert fused_tier() == "high"
        assert fused_tier() == "lossless"
    assert fused_tier() == "off"
    with pytest.raises(ValueError, match="unknown fused tier 'fast'"), use_fused("fast"):  # type: ignore[arg-type]
        pass


def test_cpu_inputs_fall_back_with_a_recorded_reason(caplog: pytest.LogCaptureFixture) -> None:
    calls = all_op_calls("cpu")
    with caplog.at_level(logging.WARNING, logger="flux_runtime.kernels.dispatch"), use_fused("lossless"):
        for _ in range(2):
            for call in calls.values():
                call()
    report = fused_ops_report()
    ops = Counter(name.split()[0] for name in calls)  # "swiglu out=" is the swiglu op
    assert report.fallbacks == {(op, CPU_REASON): 2 * n for op, n in ops.items()}
    assert report.fused_calls == {}
    assert len(caplog.records) == len(ops)  # one warning per (op, reason), not per call
    assert "not used: inputs on cpu" in caplog.records[0].getMessage()
    assert "reference gelu_tanh: 4 x inputs on cpu" in str(report)
    assert report.tier_used == "lossless, partly reference"


def test_outputs_match_the_reference_whatever_the_tier() -> None:
    for name, call in all_op_calls("cpu").items():
        off = call()
        with use_fused("lossless"):
            on = call()
        outs, refs = (on, off) if isinstance(on, tuple) else ((on,), (off,))
        assert all(torch.equal(a, b) for a, b in zip(outs, refs, strict=True)), name


def test_autograd_inputs_keep_the_reference() -> None:
    op, fused, _ = cpu_op(lambda x: x * 2)
    x = torch.randn(3, requires_grad=True)
    with use_fused("lossless"):
        out = run_op(op, x)
        with torch.no_grad():
            run_op(op, x)
    assert out.requires_grad and fused.calls == 1  # only the no_grad call ran fused
    reason = "inputs require grad; the fused kernels have no backward"
    assert fused_ops_report().fallbacks == {("fake", reason): 1}


def test_verified_signature_then_runs_fused_only() -> None:
    op, fused, ref = cpu_op(lambda x: x * 2)
    x = torch.randn(4, 8)
    with use_fused("lossless"):
        for _ in range(3):
            assert torch.equal(run_op(op, x), x * 2)
        assert (fused.calls, ref.calls) == (3, 1)  # the reference ran once, to verify
        run_op(op, torch.randn(5, 8))  # a new shape is a new signature: verified again
        assert (fused.calls, ref.calls) == (4, 2)
    report = fused_ops_report()  # read after the block: still says which tier ran
    assert report.fused_calls == {"fake": 4} and report.verified_signatures == 2 and report.all_fused
    assert report.tier_used == "lossless" and "fused tier lossless: 4 fused calls" in str(report)


def test_verification_accepts_nans_in_the_same_places() -> None:
    op, _, _ = cpu_op(lambda x: x * 2)
    with use_fused("lossless"):
        run_op(op, torch.tensor([1.0, float("nan")]))
    assert fused_ops_report().verified_signatures == 1


def test_mismatch_is_an_error_and_the_reference_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    op, fused, ref = cpu_op(lambda x: x * 2 + 1e-3)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.ERROR, logger="flux_runtime.kernels.dispatch"), use_fused("lossless"):
        assert torch.equal(run_op(op, x), x * 2)
        assert torch.equal(run_op(op, x), x * 2)
    assert fused.calls == 1 and ref.calls == 2  # never fused again for this signature
    report = fused_ops_report()
    assert len(report.mismatches) == 1 and "32 of 32 elements differ" in report.mismatches[0]
    reason = "not bit-exact against its reference; reference used for this signature"
    assert report.fallbacks == {("fake", reason): 2}
    assert caplog.records[0].levelno == logging.ERROR and "fake" in caplog.records[0].getMessage()
    assert "MISMATCH" in str(report)


def test_out_buffer_is_checked_before_the_reference_overwrites_it() -> None:
    """An `out=` op writes the same buffer in both paths: the fused result is set aside first."""
    op = FusedOp(
        "fake_out",
        fused=lambda x, out: out.copy_(x * 2 + 1),
        reference=lambda x, out: out.copy_(x * 2),
        devices=("cpu",),
    )
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    with use_fused("lossless"):
        result = run_op(op, x, out)
    assert result is out and torch.equal(out, x * 2)  # the reference's values are kept
    assert len(fused_ops_report().mismatches) == 1


def test_self_check_failure_counts_as_a_mismatch() -> None:
    op, _, _ = cpu_op(lambda x: x * 2, self_check=lambda x: "input 7 differs")
    with use_fused("lossless"):
        run_op(op, torch.randn(3))
    assert "input 7 differs" in fused_ops_report().mismatches[0]


def test_guard_rejection_is_recorded_and_remembered() -> None:
    def reject(x: Tensor) -> Tensor:
        raise UnsupportedInput("fake: width 7 is not a multiple of 4")

    op, fused, ref = cpu_op(reject)
    with use_fused("lossless"):
        run_op(op, torch.randn(7))
        run_op(op, torch.randn(7))
    assert (fused.calls, ref.calls) == (1, 2)
    assert fused_ops_report().fallbacks == {("fake", "fake: width 7 is not a multiple of 4"): 2}


def test_high_tier_kernels_need_the_high_tier() -> None:
    op, fused, ref = cpu_op(lambda x: x * 2, tier="high")
    x = torch.randn(3)
    with use_fused("lossless"):
        run_op(op, x)
    assert fused.calls == 0
    assert fused_ops_report().fallbacks == {("fake", "high-tier kernel, active tier is lossless"): 1}
    with use_fused("high"):
        run_op(op, x)
    assert (fused.calls, ref.calls) == (1, 1)  # high-tier kernels are not bit-checked


def test_compiled_callers_get_the_reference_without_graph_breaks() -> None:
    b, n, d = 1, 4, 64
    shift, scale = modulation(b, d, torch.bfloat16, "cpu")[:2]
    y = torch.randn(b, n, d).bfloat16()
    compiled = torch.compile(kernels.modulate, backend="eager", fullgraph=True)
    with use_fused("lossless"):
        out = compiled(y, shift, scale)
    assert torch.equal(out, modulate_reference(y, shift, scale))
    assert fused_ops_report().fallbacks == {}


@interpreter
def test_real_kernel_passes_the_gate_under_the_interpreter() -> None:
    op = FusedOp(
        "modulate",
        fused=partial(modulate_triton, block_l=2, block_d=256),
        reference=modulate_reference,
        devices=("cpu",),
    )
    shift, scale = modulation(2, 768, torch.bfloat16, "cpu")[:2]
    y = torch.randn(2, 3, 768).bfloat16()
    with use_fused("lossless"):
        run_op(op, y, shift, scale)
        run_op(op, y, shift, scale)
    report = fused_ops_report()
    assert report.fused_calls == {"modulate": 2} and report.verified_signatures == 1 and not report.mismatches


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_op_runs_fused_and_verified_on_cuda(dtype: torch.dtype) -> None:
    calls = all_op_calls("cuda", dtype)
    with use_fused("lossless"):
        for _ in range(2):
            for call in calls.values():
                call()
    report = fused_ops_report()
    assert not report.mismatches, report.mismatches
    assert report.fallbacks == {}, str(report)
    ops = Counter(name.split()[0] for name in calls)  # "swiglu out=" is the swiglu op
    assert report.fused_calls == {op: 2 * n for op, n in ops.items()}
    assert report.verified_signatures == len(calls)


@gpu
@pytest.mark.gpu
def test_unverified_signature_runs_the_reference_during_graph_capture() -> None:
    b, n, d = 1, 8, 3072
    shift, scale = modulation(b, d, torch.bfloat16, "cuda")[:2]
    y = torch.randn(b, n, d, device="cuda").bfloat16()
    graph = torch.cuda.CUDAGraph()
    with use_fused("lossless"):
        kernels.modulate(y[:, :4], shift, scale)  # warm-up on another signature (captures need it)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = kernels.modulate(y, shift, scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, modulate_reference(y, shift, scale))
    reason = "signature not yet verified while a CUDA graph is captured"
    assert fused_ops_report().fallbacks == {("modulate", reason): 1}
