"""Opening a `transformers` text model with its weights streamed by our reader instead of its own.

`from_pretrained(folder)` on the CPU followed by `.to("cuda")` reads each tensor into pageable memory and
copies it with a blocking call, a few GB/s; a FLUX text encoder is 8 to 48 GB. Here, for a GPU, the folder's
safetensors go through `read_state_dict` (several readers, a bounded pinned ring, side-stream copies), and
`transformers` builds the model around those GPU tensors with `from_pretrained(None, config=..., state_dict=...)`.
That is the same loading code as from the folder (key renames, tied weights, kept-fp32 modules, the cast to
`dtype`), so the parameters are the same bits; a tensor already in `dtype` is taken as it is, not copied.
Onto the CPU the folder is read by `transformers` as before (its memory map keeps host memory at the model's
size).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flux_runtime.text.quiet import no_progress_bars
from flux_runtime.weights import pinned_stream
from flux_runtime.weights.hub import safetensors_files
from flux_runtime.weights.safetensors_io import read_state_dict

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds
    from transformers import GenerationConfig, PreTrainedModel


def load_pretrained(
    cls: type[PreTrainedModel], folder: Path, dtype: torch.dtype, device: torch.device | str
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """`cls` from `folder` in `dtype` on `device`, offline, with `transformers`' loading info."""
    dev = torch.device(device)
    files = safetensors_files(folder, "model")
    streamed = files and (dev.type == "cuda" or (dev.type == "cpu" and pinned_stream.stream_on_cpu))
    with no_progress_bars():
        if not streamed:
            model, info = cls.from_pretrained(
                folder, dtype=dtype, local_files_only=True, output_loading_info=True
            )
            return model, info
        config = cls.config_class.from_pretrained(folder, local_files_only=True)
        state = read_state_dict(files, dev)
        # device_map: transformers materializes each parameter where the map says (the CPU without one,
        # which would copy every streamed GPU tensor back to host memory); a tensor already there in `dtype`
        # is taken as it is
        model, info = cls.from_pretrained(
            None, config=config, state_dict=state, dtype=dtype, output_loading_info=True, device_map={"": dev}
        )
    del state
    if model.can_generate():  # what a load from the folder also reads: its generation settings
        model.generation_config = _generation_config(folder)
    return model.to(dev), info  # buffers made at build time (RoPE frequencies, position ids) join it


def _generation_config(folder: Path) -> GenerationConfig:
    """The folder's `generation_config.json`, else the generation settings of its `config.json`."""
    from transformers import GenerationConfig

    if (folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder, local_files_only=True)
    return GenerationConfig.from_pretrained(
        folder, config_file_name="config.json", _from_model_config=True, local_files_only=True
    )
