"""The pipeline's own checks at load and at call: device names, parts that do not fit, step and guidance bounds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flux_runtime.models.dit import TINY
from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.sampling import FLUX1_DEV_SCHEDULE
from flux_runtime.text import Flux1TextEncoder
from flux_runtime.weights import load_transformer, load_vae


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("gpu", "device 'gpu' is not one to run on: use 'cpu', 'cuda', 'cuda:N' or 'mps'"),
        ("meta", "device 'meta' is not one to run on"),
        (3, "device 3 must be a string"),
    ],
)
def test_device_names_are_checked_first(device, message) -> None:
    with pytest.raises(FluxError, match=message):
        Pipeline.from_pretrained("tiny", device=device, dtype=torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(in_channels=60),
            "tiny: the transformer's img_in has width 60, but the VAE's 16 latent channels",
        ),
        (dict(context_in_dim=48), "tiny: the transformer's txt_in has width 48, but the T5 encoder gives 32"),
        (
            dict(vec_in_dim=16),
            "tiny: the transformer's vector_in has width 16, but the CLIP encoder gives 32",
        ),
    ],
)
def test_parts_that_do_not_fit_are_refused_by_name(change, message) -> None:
    transformer = load_transformer("tiny-random", config=replace(TINY, **change), dtype=torch.float32)
    vae = load_vae("tiny-random", dtype=torch.float32)
    with pytest.raises(FluxError, match=message):
        Pipeline(transformer, vae, Flux1TextEncoder.tiny(), schedule=FLUX1_DEV_SCHEDULE, model_name="tiny")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_steps=1001), "num_steps 1001 is more than 1000"),
        (dict(guidance=float("inf")), "guidance inf must be a finite number >= 0"),
        (dict(prompt="a \ud800 fox"), "prompt is not valid UTF-8 text"),
    ],
)
def test_call_arguments_are_bounded(kwargs, message, monkeypatch) -> None:
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    monkeypatch.setattr(pipe.transformer, "forward", lambda *a, **k: pytest.fail("a model ran"))
    with pytest.raises(FluxError, match=message):
        pipe(**{"prompt": "a cat", "height": 32, "width": 32, **kwargs})


@pytest.mark.parametrize("name", ["tiny", "tiny-flux2", "tiny-flux3"])
def test_a_side_past_the_largest_is_refused_before_any_model_work(name, monkeypatch) -> None:
    pipe = Pipeline.from_pretrained(name, device="cpu", dtype=torch.float32)

    def boom(*a, **k):
        raise AssertionError("a model ran before validation")

    monkeypatch.setattr(pipe.transformer, "forward", boom)
    with pytest.raises(FluxError, match="width 16384 is more than 8192 px"):
        pipe("a red circle", height=64, width=16384, num_steps=1)
