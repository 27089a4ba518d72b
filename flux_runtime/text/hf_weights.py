"""Opening a `transformers` text model with its weights streamed by our reader instead of its own.

`from_pretrained(folder)` on the CPU followed by `.to("cuda")` reads each tensor into pageable memory and
copies it with a blocking call, a few GB/s; a FLUX text encoder is 8 to 48 GB. Here, for a GPU, the folder's
safetensors go through `read_state_dict` (several readers, a bounded pinned ring, side-stream copies), and
`transformers` builds the model around those GPU tensors with `from_pretrained(None, config=..., state_dict=...)`.
That is the same loading code as from the folder (key renames, tied weights, kept-fp32 modules, the cast to
`dtype`), so the parameters are the same bits; a tensor already in `dtype` is taken as it is, not copied.
Onto the CPU the folder is read by `transformers` as before (its memory map keeps host memory at the model's
size).

Around it, the checks every encoder's loading makes, failing in our words before `transformers` reads anything
large: a diffusers pipeline folder has the sub-folders asked for (`pipeline_root`), a model folder a readable
config.json of the right model type and weights (`check_model_folder`), and the checkpoint every weight
(`load_checked`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flux_runtime.text.quiet import no_progress_bars
from flux_runtime.weights import pinned_stream
from flux_runtime.weights.config_files import read_json_object
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve, safetensors_files
from flux_runtime.weights.safetensors_io import check_safetensors_folder, read_state_dict

if TYPE_CHECKING:  # transformers is imported where it is used: loading it takes seconds
    from transformers import GenerationConfig, PreTrainedModel

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def pipeline_root(path_or_id: str | Path, folders: tuple[str, ...], model: str, alternative: str) -> Path:
    """The diffusers `model` folder `path_or_id` resolves to, failing in our words unless it has each of
    `folders`; `alternative` (for the message) says how to open the parts from their own folders."""
    root = resolve(path_or_id)
    missing = [f"{name}/" for name in folders if not (root / name).is_dir()]
    if missing:
        holds = ", ".join(f"{name}/" for name in folders[:-1]) + f" and {folders[-1]}/"
        raise WeightsError(
            f"{root} has no {', '.join(missing)}: a diffusers {model} folder holds {holds} ({alternative})"
        )
    return root


def check_model_folder(folder: Path, what: str, model_type: str | None = None, reader: str = "") -> None:
    """Fail in our words unless `folder` holds the `what` model: a readable config.json (of `model_type`, when
    given: `reader` names who reads that type) and weights whose safetensors files are sound."""
    config = folder / "config.json"
    if not config.is_file():
        raise WeightsError(f"{folder}: no config.json; expected the {what} (config.json and its weights)")
    found = read_json_object(config).get("model_type")  # a damaged config fails here, not inside transformers
    if model_type is not None and found != model_type:
        raise WeightsError(f"{folder} holds a {found!r} model; {reader} (model_type {model_type!r})")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise WeightsError(f"{folder}: no weights for the {what} (expected one of {', '.join(WEIGHT_FILES)})")
    check_safetensors_folder(folder)  # a damaged file fails here in our words, not inside transformers


def load_checked(
    cls: type[PreTrainedModel], folder: Path, dtype: torch.dtype, device: torch.device | str, what: str
) -> PreTrainedModel:
    """`load_pretrained`; a checkpoint missing weights (`what`'s, for the message) is an error."""
    # transformers random-initializes weights missing from the checkpoint; for us that is an error.
    model, info = load_pretrained(cls, folder, dtype, device)
    missing = sorted(info["missing_keys"])
    if missing:
        raise WeightsError(
            f"{folder}: the {what} checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}"
        )
    return model


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
