"""The tiny FLUX.1 [dev] pipeline folder (saved by diffusers), CLIP vision encoder and XLabs IP-Adapter file
every IP-Adapter test reads, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ip_adapter.ip_fixtures import save_adapter, save_clip_vision
from tests.pipeline.test_flux1_pipeline import _save_pipeline


@pytest.fixture(scope="session")
def ip_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ip")
    return {
        "pipe": _save_pipeline(root / "FLUX.1-tiny", guidance=True),
        "clip": save_clip_vision(root / "clip-vision"),
        "adapter": save_adapter(root / "adapter"),
    }
