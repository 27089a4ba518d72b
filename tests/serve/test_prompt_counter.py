"""The server's prompt-length check counts with its own tokenizer: counting on the event loop must not reset
the padding the worker thread's pipeline call set on the shared one (a race that once sent unpadded ids)."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.pipeline import Pipeline
from flux_runtime.serve.app import prompt_counter
from flux_runtime.text.fast_tokenizers import FastTokenizer


def _sequence_tokenizer(pipe):
    te = pipe.text_encoder
    return te.t5_tokenizer if hasattr(te, "t5_tokenizer") else te.tokenizer


@pytest.mark.parametrize("model", ["tiny", "tiny-flux2", "tiny-flux3"])
def test_counting_leaves_the_pipelines_tokenizer_alone(model):
    pipe = Pipeline.from_pretrained(model, device="cpu", dtype=torch.float32)
    shared = _sequence_tokenizer(pipe)
    count = prompt_counter(pipe)
    prompt = "a red fox on a green hill"
    if isinstance(shared, FastTokenizer):  # ours (FLUX.1, klein): padding is set only inside a locked call
        assert shared.ids([prompt], 48).shape == (1, 48)
        assert shared.backend.padding is None and shared.backend.truncation is None
        n = count(prompt)
        te = pipe.text_encoder
        text = prompt if hasattr(te, "t5_tokenizer") else te.render([prompt])[0]  # klein counts its chat text
        assert n == len(shared.untruncated([text])[0]) and 0 < n < 48
        assert count(prompt + " and a blue sky") > n
        return
    # the worker's state mid-call: padded to a fixed length, truncated
    padded = shared(prompt, padding="max_length", max_length=48, truncation=True)["input_ids"]
    state = (shared._tokenizer.padding, shared._tokenizer.truncation)
    assert state[0] is not None and len(padded) == 48
    n = count(prompt)
    assert (shared._tokenizer.padding, shared._tokenizer.truncation) == state
    assert 0 < n < 48 and count(prompt + " and a blue sky") > n
    # the same count the pipeline's tokenizer gives unpadded
    te = pipe.text_encoder
    if hasattr(te, "t5_tokenizer"):
        text = prompt
    elif model == "tiny-flux3":
        text = te.render(prompt)
    else:
        text = te.render([prompt])[0]
    assert n == len(shared(text)["input_ids"])
