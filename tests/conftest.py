"""Shared pytest setup: GPU-only tests skip cleanly on CPU machines (CI); CPU GEMMs reproducible; no test
reaches the Hugging Face Hub.

Intel MKL, torch's CPU BLAS, may round a GEMM differently with the alignment of its operands (seen on an
AVX2 CPU: the same fp32 weights, loaded from two safetensors files at addresses 8 and 16 bytes past a
64-byte boundary, gave different bits). The bit-exact tests compare models whose weights come from different
files and loaders, so MKL's strict reproducible mode is on before torch loads MKL; a value already in the
environment is kept.

huggingface_hub starts in offline mode (HF_HUB_OFFLINE=1 unless the environment says otherwise), so a load
that would fetch reads the local cache instead; the tests of fetching point it at a local stand-in of the Hub
(`tests/hub_server.py`).

Fused kernels are verified in every test process (FLUX_VERIFY_CACHE=0): a pass remembered on this machine by an
earlier run (`flux_runtime.kernels.verified`) would let a test's own kernel skip the check it is testing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLUX_VERIFY_CACHE", "0")

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A stand-in for the Hugging Face Hub on 127.0.0.1 serving the tiny FLUX.1 in the real repos' layouts
    (`tests/hub_server.py`, `tests/hub_repos.py`); one per test module."""
    from tests.hub_repos import stand_in_repos
    from tests.hub_server import serve

    with serve(stand_in_repos(tmp_path_factory.mktemp("hub-repos"))) as running:
        yield running


@pytest.fixture
def online(hub: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """huggingface_hub online and pointed at the stand-in `hub` (as HF_ENDPOINT would), with an empty cache of
    this test's own and no token; the hub's log and staged failures cleared."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-token"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    hub.reset()
    return hub
