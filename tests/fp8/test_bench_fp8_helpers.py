"""The FP8 bench's own model surgery, checked on the CPU so a device run does not find its bugs: per-tensor
requantization of per-channel e4m3 weights (`bench_fp8_attention.per_tensor_weights`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from flux_runtime.models.dit.layers import Fp8Linear
from flux_runtime.weights.fp8 import quantize_model
from tests.models.test_head_major import forward
from tests.parallel.workers import random_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def test_per_tensor_weights_keeps_the_model_close() -> None:
    from bench_fp8_attention import per_tensor_weights

    model = random_model("flux1", 3, torch.bfloat16)
    quantize_model(model, torch.bfloat16)
    before = forward(model, 2)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.weight_scale.ndim == 1 for m in layers)
    per_tensor_weights(model)
    assert all(m.weight_scale.ndim == 0 and m.weight.dtype == torch.float8_e4m3fn for m in layers)
    after = forward(model, 2)
    err = ((after.float() - before.float()).norm() / before.float().norm()).item()
    assert 0 < err < 0.1, err  # a second e4m3 rounding with one scale per tensor
