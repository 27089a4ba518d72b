"""Where a load puts the text encoders under a memory budget: straight onto the GPU when the plan will keep
them there, so they stream at the pinned ring's speed; host memory otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flux_runtime.pipeline import placement

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A pipeline root: 100 + 300 bytes of text encoder weights, and a transformer that does not count."""
    for folder, size in (("text_encoder", 100), ("text_encoder_2", 300), ("transformer", 10_000)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "model.safetensors").write_bytes(b"\0" * size)
    return tmp_path


def test_files_bytes_counts_the_text_encoders_of_a_root(root: Path) -> None:
    assert placement.files_bytes([root]) == 400
    assert placement.files_bytes([root / "text_encoder_2", root / "text_encoder"]) == 400
    assert placement.files_bytes([root / "text_encoder" / "model.safetensors"]) == 100
    assert placement.files_bytes([root / "missing"]) is None


@pytest.mark.parametrize(
    ("budget", "on_device", "offload", "want"),
    [
        (None, 10**9, False, GPU),  # no plan: the device
        (1000, 300, False, GPU),  # 300 + 400 <= 800
        (1000, 401, False, CPU),  # 401 + 400 > 800: the plan may not keep them
        (1000, 0, True, CPU),  # offload asked
    ],
)
def test_text_device(root: Path, monkeypatch: pytest.MonkeyPatch, budget, on_device, offload, want) -> None:
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: on_device)
    assert placement.text_device(budget, GPU, offload, [root]) == want


def test_unknown_sources_or_a_cpu_device_load_to_host_memory(root: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    assert placement.text_device(1000, GPU, False, None) == CPU
    assert placement.text_device(1000, GPU, False, [root / "missing"]) == CPU
    assert placement.text_device(1000, CPU, False, [root]) == CPU
    assert placement.text_device(1000, GPU, False, []) == GPU  # a built-in model's small encoders
