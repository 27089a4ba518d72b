"""Shared pytest setup: GPU-only tests skip cleanly on CPU machines (CI); CPU GEMMs reproducible.

Intel MKL, torch's CPU BLAS, may round a GEMM differently with the alignment of its operands (seen on an
AVX2 CPU: the same fp32 weights, loaded from two safetensors files at addresses 8 and 16 bytes past a
64-byte boundary, gave different bits). The bit-exact tests compare models whose weights come from different
files and loaders, so MKL's strict reproducible mode is on before torch loads MKL; a value already in the
environment is kept.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
