"""A CPU call that cannot fit the machine's free memory is refused in one line before any model runs, instead
of being killed part way by the kernel's OOM killer, which leaves no error at all."""

from __future__ import annotations

import pytest

from flux_runtime.pipeline import Pipeline, placement
from flux_runtime.pipeline.memory import GiB, MemoryBudgetError


@pytest.fixture(scope="module", params=["tiny", "tiny-flux2", "tiny-flux3-random"])
def pipe(request):
    return Pipeline.from_pretrained(request.param, device="cpu")


def _no_model_may_run(pipe, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model ran before the memory check")

    monkeypatch.setattr(pipe.text_encoder, "encode", refuse)
    monkeypatch.setattr(pipe.transformer, "forward", refuse)


def test_a_batch_no_machine_holds_is_refused_before_any_model_runs(pipe, monkeypatch):
    _no_model_may_run(pipe, monkeypatch)
    with pytest.raises(MemoryBudgetError, match=r"64x64 x 1000000 image\(s\) in one call need at least") as e:
        pipe("a red circle", num_images_per_prompt=1_000_000, height=64, width=64, num_steps=1)
    assert "make fewer images per call" in str(e.value) and "\n" not in str(e.value)


def test_the_bound_is_the_figure_the_error_names(pipe, monkeypatch):
    """Refused a little below the working memory the message names, run a little above it."""
    monkeypatch.setattr(placement, "free_memory", lambda device: 1)
    with pytest.raises(MemoryBudgetError) as e:
        pipe("a red circle", height=64, width=64, num_steps=1)
    need = float(str(e.value).split("need at least ")[1].split(" GB")[0]) * GiB
    assert need > 0
    monkeypatch.setattr(placement, "free_memory", lambda device: int(need * 0.9))
    with pytest.raises(MemoryBudgetError):
        pipe("a red circle", height=64, width=64, num_steps=1)
    monkeypatch.setattr(placement, "free_memory", lambda device: int(need * 1.1))
    out = pipe("a red circle", height=64, width=64, num_steps=1, output_type="pt")
    assert out.images.shape[0] == 1


def test_no_reading_means_no_refusal(pipe, monkeypatch):
    """Where free memory cannot be read (not Linux) nothing is refused."""
    monkeypatch.setattr(placement, "free_memory", lambda device: None)
    out = pipe("a red circle", height=64, width=64, num_steps=1, output_type="pt")
    assert out.images.shape[0] == 1


def test_only_the_cpu_is_guarded():
    """On a GPU an out-of-memory is caught and named after the fact; only the CPU has no such net."""
    import torch

    assert placement.free_memory(torch.device("cuda")) is None
    assert placement.free_memory(torch.device("meta")) is None
    free = placement.free_memory(torch.device("cpu"))
    assert free is None or free > 0
