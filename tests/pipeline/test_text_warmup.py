"""The throwaway encode that runs while the transformer loads: only on a CUDA device, always joined, never an
error of its own, and no change to any image."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from flux_runtime.pipeline import Pipeline, text_warmup


class FakeEncoder:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, Any, str]] = []
        self.fail = fail
        self.started = threading.Event()

    def encode(self, prompt: str, *, device: Any) -> None:
        self.calls.append((prompt, device, threading.current_thread().name))
        self.started.set()
        if self.fail:
            raise RuntimeError("out of memory")


def test_nothing_runs_on_the_cpu_without_an_encoder_or_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    enc = FakeEncoder()
    with text_warmup.warming(enc, torch.device("cpu")) as thread:
        assert thread is None
    with text_warmup.warming(None, torch.device("cuda")) as thread:
        assert thread is None
    monkeypatch.setenv("FLUX_TEXT_WARMUP", "0")
    with text_warmup.warming(enc, torch.device("cuda")) as thread:
        assert thread is None
    assert enc.calls == []


@pytest.mark.parametrize("fail", [False, True])
def test_on_a_cuda_device_one_encode_runs_beside_the_scope_and_is_joined(fail: bool) -> None:
    enc = FakeEncoder(fail=fail)
    device = torch.device("cuda", 0)
    with text_warmup.warming(enc, device) as thread:  # on a CPU machine its stream sync fails: dropped too
        assert thread is not None
        assert enc.started.wait(10)
    assert not thread.is_alive()
    assert enc.calls == [(text_warmup.WARM_PROMPT, device, "flux-text-warmup")]


def test_the_scope_raising_still_joins_the_thread() -> None:
    enc = FakeEncoder()
    with (
        pytest.raises(ValueError, match="bad checkpoint"),
        text_warmup.warming(enc, torch.device("cuda")) as thread,
    ):
        raise ValueError("bad checkpoint")
    assert thread is not None and not thread.is_alive()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny", "tiny-flux2"])
def test_a_warmed_load_gives_the_same_image(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The text encoders load first and encode the warm-up prompt while the transformer loads; the call's image is
    the one of a load without the warm-up."""
    warmed: list[str] = []
    encode = text_warmup._encode

    def counted(text_encoder: Any, device: torch.device) -> None:
        warmed.append(type(text_encoder).__name__)
        encode(text_encoder, device)

    monkeypatch.setattr(text_warmup, "_encode", counted)
    args = dict(
        prompt="a red fox in the snow", height=128, width=128, num_steps=3, seed=1, output_type="latent"
    )
    with_warmup = Pipeline.from_pretrained(model, device="cuda", cuda_graphs=False)(**args).latents
    assert len(warmed) == 1
    monkeypatch.setattr(text_warmup, "_encode", lambda text_encoder, device: None)
    without = Pipeline.from_pretrained(model, device="cuda", cuda_graphs=False)(**args).latents
    assert torch.equal(with_warmup, without)


def test_the_encoders_load_first_only_on_a_gpu_with_every_file_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Otherwise the transformer loads first, so that its own problems are reported before a missing encoder."""
    folder = tmp_path / "pipe"
    (folder / "text_encoder").mkdir(parents=True)
    (folder / "text_encoder" / "model.safetensors").write_bytes(b"")
    gpu = torch.device("cuda", 0)
    assert text_warmup.loads_first(gpu, [folder])
    assert text_warmup.loads_first(gpu, [])  # a built-in model's small encoders
    assert not text_warmup.loads_first(torch.device("cpu"), [folder])
    assert not text_warmup.loads_first(gpu, None)  # the encoder BFL pairs with the transformer: told by it
    assert not text_warmup.loads_first(gpu, [folder, "no-such-org/no-such-encoder"])  # not in the local cache
    monkeypatch.setenv("FLUX_TEXT_WARMUP", "0")
    assert not text_warmup.loads_first(gpu, [folder])
