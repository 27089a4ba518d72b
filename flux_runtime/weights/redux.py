"""Finding and loading FLUX.1 Redux: the image embedder's file, and where its SigLIP image encoder lives.

Redux comes in two layouts people hold:

- the diffusers folder of `black-forest-labs/FLUX.1-Redux-dev`: `image_embedder/` (the embedder,
  `diffusion_pytorch_model.safetensors` + `config.json`), `image_encoder/` (a `SiglipVisionModel`) and
  `feature_extractor/` (the `SiglipImageProcessor` settings, `preprocessor_config.json`);
- BFL's single file `flux1-redux-dev.safetensors`: the embedder alone (`redux_up.*`, `redux_down.*`). Its
  SigLIP is named separately (`image_encoder=`): a folder holding `image_encoder/` and `feature_extractor/`
  (such as the diffusers folder above), or a SigLIP model folder with its own `preprocessor_config.json`
  (`google/siglip-so400m-patch14-384`, the encoder BFL trained Redux with).

Everything here is checked from paths and safetensors headers only, so a wrong file fails in one line before
any model loads. The embedder's keys are the same in both layouts; it loads strictly (every key, every shape).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from flux_runtime.models.redux import ReduxConfig, ReduxEmbedder
from flux_runtime.weights.config_files import INT, check_fields, read_json_if_present
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import cached_snapshot, hub_id, resolve, safetensors_files
from flux_runtime.weights.safetensors_io import TensorSource

__all__ = ["ReduxFiles", "find_redux", "load_redux_embedder", "redux_config"]

KEYS = ("redux_up.weight", "redux_up.bias", "redux_down.weight", "redux_down.bias")
EMBEDDER_STEM = "diffusion_pytorch_model"
PROCESSOR_CONFIG = "preprocessor_config.json"
# what an image-encoder argument may name, for the messages
ENCODER_HINT = (
    "a FLUX.1-Redux-dev folder (image_encoder/ + feature_extractor/) or a SigLIP model folder with "
    "preprocessor_config.json, e.g. google/siglip-so400m-patch14-384"
)
# keys that tell a FLUX transformer (BFL or diffusers names) given where the Redux file was meant
_TRANSFORMER_MARKS = ("double_blocks.", "transformer_blocks.", "single_blocks.", "single_transformer_blocks.")


@dataclass(frozen=True)
class ReduxFiles:
    """Where one Redux's parts are: the embedder's safetensors file(s), the SigLIP model folder and the
    folder with its `preprocessor_config.json`; `source` and `encoder_source` are what the caller named
    (`encoder_source` None: the SigLIP inside the Redux folder)."""

    source: str
    embedder: tuple[Path, ...]
    image_encoder: Path
    feature_extractor: Path
    config: ReduxConfig
    encoder_source: str | None = None

    def weights_id(self) -> str:
        """A short fingerprint of the files: sha256 over each one's name, size and first 64 KiB (its header
        and the start of its tensors), as the transformer's `weights_id`, and the processor's settings."""
        digest = hashlib.sha256()
        encoder_files = sorted(self.image_encoder.glob("*.safetensors"))
        for f in (*self.embedder, *encoder_files, self.feature_extractor / PROCESSOR_CONFIG):
            digest.update(f.name.encode())
            digest.update(str(f.stat().st_size).encode())
            with open(f, "rb") as fh:
                digest.update(fh.read(1 << 16))
        return digest.hexdigest()[:16]


def find_redux(path_or_id: str | Path, image_encoder: str | Path | None = None) -> ReduxFiles:
    """The Redux at `path_or_id` (a diffusers folder, BFL's single file, or a cached model id), its
    SigLIP from `image_encoder` when given (needed beside a single file), all checked."""
    root = _local(path_or_id)
    if root.is_dir():
        folder = root / "image_embedder"
        if not folder.is_dir():
            raise WeightsError(
                f"{root} is not a Redux folder: it has no image_embedder/ (give the FLUX.1-Redux-dev folder, or "
                "BFL's flux1-redux-dev.safetensors with its image encoder)"
            )
        files = tuple(safetensors_files(folder, EMBEDDER_STEM))
        if not files:
            raise WeightsError(f"{folder}: no {EMBEDDER_STEM}.safetensors (the Redux image embedder)")
        config = redux_config(files)
        _check_folder_config(folder, config)
        encoder_root = root if image_encoder is None else image_encoder
    else:
        files = (root,)
        config = redux_config(files)
        if image_encoder is None:
            raise WeightsError(
                f"{root} is BFL's Redux embedder alone: name its SigLIP image encoder too (redux_image_encoder= "
                f"/ --redux-image-encoder): {ENCODER_HINT}"
            )
        encoder_root = image_encoder
    encoder, processor = _siglip_folders(encoder_root)
    named = None if image_encoder is None else _named(image_encoder)
    return ReduxFiles(_named(path_or_id), files, encoder, processor, config, named)


def _local(path_or_id: str | Path) -> Path:
    """`resolve`, with what to do about a model id missing from the cache: Redux files are not fetched."""
    name = hub_id(path_or_id)
    if name is not None and cached_snapshot(name) is None:
        raise WeightsError(
            f"{name!r} is not in the local Hugging Face cache, and Redux files are not fetched: download it "
            f"first (huggingface-cli download {name}) or give a local path"
        )
    return resolve(path_or_id)


def _named(path_or_id: str | Path) -> str:
    """What the provenance keeps of a path or id: a cached model id as given, a local path made absolute (so a
    replay from another folder finds it)."""
    return (
        str(path_or_id) if hub_id(path_or_id) is not None else str(Path(path_or_id).expanduser().absolute())
    )


def redux_config(files: tuple[Path, ...]) -> ReduxConfig:
    """The embedder's widths from the headers of `files`, which must hold exactly its four tensors."""
    where = files[0] if len(files) == 1 else files[0].parent
    if any(f.suffix != ".safetensors" for f in files):
        raise WeightsError(f"{where} is not a Redux embedder: expected a .safetensors file")
    src = TensorSource(list(files))  # a damaged header fails here, in our words
    keys = set(src.keys())
    if any(k.startswith(mark) or f".{mark}" in k for k in keys for mark in _TRANSFORMER_MARKS):
        raise WeightsError(
            f"{where} is a FLUX transformer checkpoint, not a Redux embedder (give it as the model; Redux is "
            "flux1-redux-dev.safetensors or the FLUX.1-Redux-dev folder)"
        )
    if keys != set(KEYS):
        found = ", ".join(sorted(keys)[:3]) or "no tensors"
        raise WeightsError(
            f"{where} is not a Redux embedder: it should hold exactly {', '.join(KEYS)}; found {found}"
            + (" ..." if len(keys) > 3 else "")
        )
    up, up_b = src.shape("redux_up.weight"), src.shape("redux_up.bias")
    down, down_b = src.shape("redux_down.weight"), src.shape("redux_down.bias")
    ok = (
        len(up) == 2
        and len(down) == 2
        and up[0] == 3 * down[0]
        and down[1] == up[0]
        and up_b == (up[0],)
        and down_b == (down[0],)
    )
    if not ok:
        raise WeightsError(
            f"{where}: the Redux embedder's shapes do not fit together (redux_up {up}, redux_down {down}; "
            "expected (3 T, D) and (T, 3 T))"
        )
    return ReduxConfig(redux_dim=up[1], txt_in_features=down[0])


def _check_folder_config(folder: Path, config: ReduxConfig) -> None:
    """A diffusers `image_embedder/config.json`, when present, must say the widths the tensors have."""
    data = read_json_if_present(folder / "config.json")
    if data is None:
        return
    check_fields(data, {"redux_dim": INT, "txt_in_features": INT}, folder / "config.json")
    for name in ("redux_dim", "txt_in_features"):
        if name in data and data[name] != getattr(config, name):
            raise WeightsError(
                f"{folder / 'config.json'} says {name} {data[name]}, but its weights have {getattr(config, name)}"
            )


def _siglip_folders(path_or_id: str | Path) -> tuple[Path, Path]:
    """(the SigLIP model folder, the folder with its preprocessor config) that `path_or_id` names."""
    root = _local(path_or_id)
    if not root.is_dir():
        raise WeightsError(f"{root} is not a folder; the Redux image encoder is {ENCODER_HINT}")
    if (root / "image_encoder").is_dir():
        encoder, processor = root / "image_encoder", root / "feature_extractor"
    else:
        encoder, processor = root, root
    if not (encoder / "config.json").is_file():
        raise WeightsError(f"{encoder} has no config.json: the Redux image encoder is {ENCODER_HINT}")
    if not (processor / PROCESSOR_CONFIG).is_file():
        raise WeightsError(
            f"{processor} has no {PROCESSOR_CONFIG} (SigLIP's image preprocessing): the Redux image encoder is "
            f"{ENCODER_HINT}"
        )
    return encoder, processor


def load_redux_embedder(files: ReduxFiles, device: torch.device | str, dtype: torch.dtype) -> ReduxEmbedder:
    """The embedder in `dtype` on `device` (each tensor read and cast as diffusers' `torch_dtype` load does)."""
    src = TensorSource(list(files.embedder))
    with torch.device("meta"):
        model = ReduxEmbedder(files.config)
    state = {key: src.get(key, device, dtype) for key in KEYS}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
