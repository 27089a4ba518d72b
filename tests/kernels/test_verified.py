"""Verified signatures remembered across processes: written only on a pass, read back under the same environment
only, never trusted for a signature holding an object, and never in the way when the cache cannot be written."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flux_runtime.kernels import verified
from flux_runtime.kernels.dispatch import (
    FusedOp,
    _signature,
    fused_ops_report,
    reset_fused_ops_report,
    run_op,
    use_fused,
)
from tests.kernels.test_dispatch import Counted

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The record on, in a folder of this test's own, for CPU ops (whose environment is a fixed name here)."""
    monkeypatch.setenv("FLUX_VERIFY_CACHE", "1")
    monkeypatch.setenv("FLUX_RUNTIME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(verified, "DEVICES", ("cpu",))
    monkeypatch.setattr(verified, "environment", lambda device: "env-a")
    verified.forget()
    reset_fused_ops_report(forget_signatures=True)
    yield tmp_path / "cache"
    verified.forget()
    reset_fused_ops_report(forget_signatures=True)


def _op(fused_factor: float = 2.0) -> tuple[FusedOp, Counted, Counted]:
    f, r = Counted(lambda x: x * fused_factor), Counted(lambda x: x * 2)
    return FusedOp("remembered", fused=f, reference=r, devices=("cpu",)), f, r  # type: ignore[arg-type]


def _new_process() -> None:
    """What a later process starts with: no signatures known, the record not read yet."""
    reset_fused_ops_report(forget_signatures=True)
    verified.forget()


def test_a_pass_is_taken_by_a_later_process_without_running_both_paths(cache: Path) -> None:
    op, fused, ref = _op()
    x = torch.arange(6.0)
    with use_fused("lossless"):
        assert torch.equal(run_op(op, x), x * 2)
    assert (fused.calls, ref.calls) == (1, 1)  # verified: both ran
    assert len((cache / "verified-env-a.txt").read_text().split()) == 1
    _new_process()
    with use_fused("lossless"):
        assert torch.equal(run_op(op, x), x * 2)
    assert (fused.calls, ref.calls) == (2, 1)  # the kernel alone
    report = fused_ops_report()
    assert report.verified_signatures == 1 and report.remembered_signatures == 1
    assert "1 by an earlier process" in str(report)
    # another shape is another signature: checked again
    with use_fused("lossless"):
        run_op(op, torch.arange(5.0))
    assert ref.calls == 2


def test_a_mismatch_is_never_written_and_is_found_again(cache: Path) -> None:
    op, _, ref = _op(fused_factor=3.0)
    x = torch.arange(1.0, 4.0)
    for _ in range(2):
        _new_process()
        with use_fused("lossless"):
            assert torch.equal(run_op(op, x), x * 2)  # the reference's result
        assert fused_ops_report().mismatches
    assert ref.calls == 2
    assert not (cache / "verified-env-a.txt").exists()


def test_another_environment_or_the_switch_off_verifies_again(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    op, _, ref = _op()
    x = torch.arange(4.0)
    with use_fused("lossless"):
        run_op(op, x)
    monkeypatch.setattr(verified, "environment", lambda device: "env-b")  # e.g. another torch or driver
    _new_process()
    with use_fused("lossless"):
        run_op(op, x)
    assert ref.calls == 2
    monkeypatch.setenv("FLUX_VERIFY_CACHE", "0")
    _new_process()
    with use_fused("lossless"):
        run_op(op, x)
    assert ref.calls == 3
    assert sorted(p.name for p in cache.iterdir()) == ["verified-env-a.txt", "verified-env-b.txt"]


def test_torn_lines_are_ignored_and_an_unwritable_cache_is_skipped(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    op, _, ref = _op()
    x = torch.arange(3.0)
    sig = _signature(op.name, (x,))
    line = verified.line_of(sig)
    assert line is not None and len(line) == 64
    cache.mkdir()
    (cache / "verified-env-a.txt").write_text("garbage\n" + line[:40])  # a line torn by a crash: not a match
    with use_fused("lossless"):
        run_op(op, x)
    assert ref.calls == 1
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLUX_RUNTIME_CACHE", str(blocker / "sub"))  # cannot be made: no error, no record
    _new_process()
    with use_fused("lossless"):
        assert torch.equal(run_op(op, x), x * 2)
    assert ref.calls == 2


def test_the_record_line_names_plain_signatures_only() -> None:
    x = torch.zeros(2, 3)
    a = verified.line_of(_signature("op", (x, 1e-6, "tanh", None, (1, 2))))
    assert a == verified.line_of(
        _signature("op", (torch.ones(2, 3), 1e-6, "tanh", None, (1, 2)))
    )  # not values
    assert a != verified.line_of(_signature("op", (x, 1e-5, "tanh", None, (1, 2))))
    assert a != verified.line_of(_signature("op", (x.t(), 1e-6, "tanh", None, (1, 2))))  # strides
    assert verified.line_of(_signature("op", (x, object()))) is None


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLUX_RUNTIME_CACHE", str(tmp_path / "mine"))
    assert verified.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("FLUX_RUNTIME_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert verified.cache_dir() == tmp_path / "xdg" / "flux-runtime"


@pytest.mark.gpu
def test_a_fresh_process_takes_the_kernels_an_earlier_one_verified(tmp_path: Path) -> None:
    """Two fresh processes run the same fused op on the GPU: the first verifies and writes the pass, the second
    takes it from the record, and both give the same bits."""
    code = (
        "import torch, sys\n"
        "from flux_runtime.kernels.modulate import modulate\n"
        "from flux_runtime.kernels.dispatch import fused_ops_report, use_fused\n"
        "g = torch.Generator(device='cuda').manual_seed(0)\n"
        "x = torch.randn(1, 64, 3072, device='cuda', generator=g).bfloat16()\n"
        "s = torch.randn(1, 3072, device='cuda', generator=g).bfloat16()\n"
        "with use_fused('lossless'):\n"
        "    y = modulate(x, s, s)\n"
        "r = fused_ops_report()\n"
        "torch.save(y.cpu(), sys.argv[1])\n"
        "print(r.verified_signatures, r.remembered_signatures, sum(r.fused_calls.values()))\n"
    )
    env = {"FLUX_VERIFY_CACHE": "1", "FLUX_RUNTIME_CACHE": str(tmp_path / "cache")}
    outs = []
    for k in range(2):
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / f"{k}.pt")],
            env={**os.environ, **env}, capture_output=True, text=True, check=True,
        )  # fmt: skip
        outs.append(done.stdout.split())
    assert outs[0] == ["1", "0", "1"] and outs[1] == ["1", "1", "1"], outs
    assert torch.equal(torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt"))
