"""The kernels' A/B switches (`temporarily` and the four context managers built on it) restore the setting
they replaced, also when the body raises, and nest."""

from __future__ import annotations

import importlib

import pytest

from flux_runtime.kernels import triton_utils

fp8 = importlib.import_module("flux_runtime.kernels.fp8")
gelu = importlib.import_module("flux_runtime.kernels.gelu")
layout = importlib.import_module(
    "flux_runtime.kernels.qk_norm_rope"
)  # the package exports a function of that name


def _roles() -> str:
    return "".join(r for r in "qkv" if layout.is_head_major(r))


def _settings() -> tuple[object, ...]:
    return triton_utils._E4M3_HARDWARE[0], dict(fp8._ACT_BLOCK), gelu._SHORTCUT["gelu"], _roles()


def test_switches_apply_inside_and_restore_after_an_error() -> None:
    before = _settings()
    with (
        pytest.raises(RuntimeError, match="body failed"),
        triton_utils.e4m3_hardware(not before[0]),
        fp8.act_block("swiglu", 256),
        gelu.gelu_shortcut(not before[2]),
        layout.head_major_layout("q"),
    ):
        assert triton_utils._E4M3_HARDWARE[0] is (not before[0])
        assert fp8._ACT_BLOCK["swiglu"] == 256
        assert gelu._SHORTCUT["gelu"] is (not before[2])
        assert _roles() == "q"
        raise RuntimeError("body failed")
    assert _settings() == before


def test_switches_nest() -> None:
    before = _roles()
    with layout.head_major_layout(True):
        with layout.head_major_layout(False):
            assert _roles() == ""
        assert _roles() == "qkv"
    assert _roles() == before


def test_a_bad_setting_changes_nothing() -> None:
    before = _settings()
    with pytest.raises(ValueError, match="unknown activation"), fp8.act_block("relu", 256):
        pass
    with pytest.raises(ValueError, match="roles other than q, k and v"), layout.head_major_layout("qx"):
        pass
    assert _settings() == before
