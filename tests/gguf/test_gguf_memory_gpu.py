"""A GGUF transformer streamed on CUDA: side-stream copies of its quantized blocks into ring slots, pinned host
memory and the dequantization kernel reading rebound views give the resident latents, with a lower peak.

Skipped without a CUDA GPU; the same placement code runs on the CPU in tests/gguf/test_gguf_memory.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flux_runtime.pipeline.memory import Plan, spread
from flux_runtime.pipeline.placement import apply_plan, footprint
from tests.gguf.test_gguf_memory import KW, build_files, load

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_files(tmp_path_factory.mktemp("gguf-memory-gpu"))


@pytest.mark.gpu
def test_streamed_on_cuda_gives_the_resident_bits_with_a_lower_peak(files: dict[str, Path]) -> None:
    """Resident, then every block streamed through two slots (the text encoders offloaded): the same latents on
    each of two calls (the second replays the resident plan's graphs and wraps the ring around), the blocks in
    pinned host memory as uint8, and the streamed peak below the resident one by at least half of what streaming
    keeps off the GPU."""
    device = torch.device("cuda")
    pipe = load(files, device="cuda")
    fp = footprint(pipe)
    nd = len(fp.dit.layers)
    plans = (
        Plan("resident", 1 << 40),
        Plan(
            "stream", 1 << 40, text="offloaded", dit="streamed", streamed_dit=spread(nd, nd), together=False
        ),
    )
    latents, peaks = [], []
    for plan in plans:
        apply_plan(pipe, plan, device)
        pipe._prompts.clear()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            latents.append(pipe("a red fox", **KW).latents)
        peaks.append(torch.cuda.max_memory_allocated())
    assert all(torch.equal(x, latents[0]) for x in latents[1:])
    model = pipe.placement.models["dit"]
    assert model.host is not None and model.host.pinned
    assert any(e.dtype == torch.uint8 for unit in model.units[1:] for e in unit.entries)
    assert peaks[1] < peaks[0] - (sum(fp.dit.layers) - 2 * max(fp.dit.layers)) // 2
