"""Our own text encoder modules (FLUX.1's CLIP-L and T5, FLUX.2 [klein]'s Qwen3), their safetensors streamed in
by our reader.

`clip_encoder`, `t5_encoder` and `qwen3_encoder` give the same bits as transformers' `CLIPTextModel`,
`T5EncoderModel` and `Qwen3ForCausalLM` without importing transformers (seconds of a fresh process). Here a model
is built on the `meta` device from the folder's `config.json`, only the tensors it uses are read (a full CLIP or
T5 checkpoint also holds a vision tower or a decoder; of Qwen3, klein reads the embedding and the layers up to
its deepest hidden state, not the later layers, the final norm or the LM head), each is cast to the dtype
transformers would give that parameter, and the model takes them as its parameters. Onto a GPU the read goes
through the pinned ring, as the transformer's does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from flux_runtime.text import clip_encoder, qwen3_encoder, t5_encoder
from flux_runtime.weights import pinned_stream
from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.safetensors_io import TensorSource

Kind = Literal["clip", "t5", "qwen3"]


def load_native(
    kind: Kind,
    folder: Path,
    files: list[Path],
    dtype: torch.dtype,
    device: torch.device | str,
    what: str,
    depth: int | None = None,
) -> nn.Module:
    """The `kind` encoder of `folder` (its safetensors `files`) in `dtype` on `device`; a weight the model needs
    and the files lack is a WeightsError naming it (transformers would draw it at random). `depth` (Qwen3 only):
    how many decoder layers to build and read (default: all the config has)."""
    dev = torch.device(device)
    config = read_json_object(folder / "config.json")
    try:
        if kind == "qwen3":
            model = qwen3_encoder.build(config, dtype, "meta", depth)
        else:
            model = (clip_encoder.build if kind == "clip" else t5_encoder.build)(config, dtype, "meta")
    except (ValueError, TypeError) as e:
        raise WeightsError(f"{folder}/config.json: {e}") from None
    wanted = {name: t.dtype for name, t in model.state_dict().items()}
    src = TensorSource(files)
    keys = {}  # the checkpoint's name -> ours
    for key in src.keys():
        ours = key.removeprefix("text_model.") if kind == "clip" else key
        if ours in wanted:
            keys[key] = ours
    read_on = dev if dev.type == "cuda" or pinned_stream.stream_on_cpu else torch.device("cpu")
    order = src.file_order(keys)
    state = {}
    with src.streaming(order, read_on):
        for key in order:
            t = src.get(key, read_on)
            want = wanted[keys[key]]
            state[keys[key]] = t.to(want) if t.is_floating_point() and t.dtype != want else t
    model.load_state_dict(state, strict=False, assign=True)
    lacking = sorted(name for name, p in model.named_parameters() if p.is_meta)
    if lacking:
        raise WeightsError(
            f"{folder}: the {what} checkpoint lacks {len(lacking)} weights, e.g. {', '.join(lacking[:3])}"
        )
    return model.to(dev)
