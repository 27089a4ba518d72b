"""No wrong image: latents that turn NaN or infinite fail naming the step, and nothing is decoded or written."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from flux_runtime.cli.gen import main
from flux_runtime.models.dit import Flux1Transformer, Flux2Transformer
from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.pipeline.checks import StepWatch


def _nan_at_call(model_cls: type, k: int, monkeypatch) -> None:
    """Make `model_cls.forward` return NaN from its k-th call (0-based) on."""
    real = model_cls.forward
    calls = []

    def forward(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(None)
        return out.fill_(float("nan")) if len(calls) > k else out

    monkeypatch.setattr(model_cls, "forward", forward)


@pytest.mark.parametrize(("model", "cls"), [("tiny", Flux1Transformer), ("tiny-flux2", Flux2Transformer)])
@pytest.mark.parametrize("k", [0, 2])
def test_a_nan_step_is_an_error_naming_it(model, cls, k, monkeypatch) -> None:
    pipe = Pipeline.from_pretrained(model, device="cpu", dtype=torch.float32)
    _nan_at_call(cls, k, monkeypatch)
    decoded = []
    monkeypatch.setattr(pipe.vae, "decode", lambda *a, **kw: decoded.append(1))
    kw = dict(height=32, width=32, num_steps=4, max_sequence_length=16, guidance=1.0)
    with pytest.raises(FluxError, match=rf"NaN or infinite at denoising step {k + 1} of 4"):
        pipe("a cat", **kw)
    assert decoded == []


def test_a_non_finite_decoded_image_is_an_error(monkeypatch) -> None:
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    real = pipe.vae.decode
    monkeypatch.setattr(pipe.vae, "decode", lambda z, tile=None: real(z, tile=tile) * float("inf"))
    with pytest.raises(FluxError, match="the decoded images hold NaN or infinite values"):
        pipe("a cat", height=32, width=32, num_steps=1)


def test_off_the_cpu_the_first_bad_step_is_found_after_the_loop() -> None:
    # the device path (no host sync per step), run here on CPU tensors
    watch = StepWatch(5, torch.device("cuda"))
    x = torch.zeros(1, 4, 8)
    for i in range(5):
        watch(i, x if i < 3 else x + float("inf") if i == 3 else x * float("nan"))
    with pytest.raises(FluxError, match="step 4 of 5"):
        watch.raise_if_bad()
    fine = StepWatch(2, torch.device("cuda"))
    fine(0, x)
    fine(1, x)
    fine.raise_if_bad()


def test_the_cli_writes_nothing_for_a_nan_step(tmp_path, monkeypatch) -> None:
    _nan_at_call(Flux1Transformer, 1, monkeypatch)
    out = tmp_path / "out"
    res = CliRunner().invoke(
        main,
        [
            "--model",
            "tiny",
            "--height",
            "32",
            "--width",
            "32",
            "--steps",
            "3",
            "--prompt",
            "a",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 1 and "denoising step 2 of 3" in res.output and "Traceback" not in res.output
    assert list(out.iterdir()) == []
