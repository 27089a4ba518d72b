"""A throwaway prompt encoded while the transformer streams in, so that the first call's encode is quick.

In a fresh process the first prompt encode on a GPU paid 0.52 s on the H200 (FLUX.1-dev's CLIP-L and T5-XXL)
where a later one takes a few tens of milliseconds: what it pays is the process's first use of things, not
the encoders' arithmetic: cuBLAS's start-up, each kernel's first load, the tokenizers' first call. When
`loads_first` says so, a recipe loads its text encoders before the transformer and encodes one fixed prompt with
them on a daemon thread for as long as the transformer's load runs (mostly file reads and copies that hold no
lock, so the two overlap), then joins the thread before anything else touches the encoders. The embeddings are
dropped: no call's result depends on the warm-up, only its time does.

On the CPU, or with the encoders in host memory (a memory plan moves them in when it encodes), nothing runs;
nor with `FLUX_TEXT_WARMUP=0` (the A/B switch of the cold-start bench). A warm-up that fails is dropped too: the
call's own encode meets the same problem and reports it in its words.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from flux_runtime.pipeline.placement import files_bytes

log = logging.getLogger(__name__)

WARM_PROMPT = "a photograph of a lighthouse on a cliff at dusk"


def loads_first(text_device: torch.device, sources: Sequence[str | Path] | None) -> bool:
    """Whether the text encoders load before the transformer: where they will be warmed (on a CUDA device) and
    every file they read is found locally (`sources`, as `placement.files_bytes` counts them; None: they depend on
    the transformer). Otherwise they load after it, so that a damaged or unsuitable transformer is reported before
    a missing encoder, as the CPU always does."""
    if text_device.type != "cuda" or sources is None or os.environ.get("FLUX_TEXT_WARMUP") == "0":
        return False
    return files_bytes(sources) is not None


@contextmanager
def warming(text_encoder: Any, device: torch.device) -> Iterator[threading.Thread | None]:
    """Within the scope, `text_encoder` encodes `WARM_PROMPT` on a side thread when it sits on a CUDA `device`;
    the scope's end waits for it (also when the scope raises). Yields the thread, or None when none runs."""
    if text_encoder is None or device.type != "cuda" or os.environ.get("FLUX_TEXT_WARMUP") == "0":
        yield None
        return
    thread = threading.Thread(
        target=_encode, args=(text_encoder, device), name="flux-text-warmup", daemon=True
    )
    thread.start()
    try:
        yield thread
    finally:
        thread.join()


def _encode(text_encoder: Any, device: torch.device) -> None:
    try:
        with torch.no_grad():
            text_encoder.encode(WARM_PROMPT, device=device)
        torch.cuda.current_stream(
            device
        ).synchronize()  # its kernels run now, beside the load, not in the call
    except Exception as e:  # the call's own encode reports any real problem
        log.debug("text encoder warm-up dropped: %s", e)
