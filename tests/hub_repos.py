"""The built-in tiny FLUX.1 laid out as the real repos on the Hub are, for the stand-in Hub (`tests/hub_server.py`).

`flux1_repo`: FLUX.1-dev's layout, both transformer layouts present as there (the BFL single file beside the
diffusers `transformer/` folder, `ae.safetensors` beside `vae/`), the text encoders in `text_encoder*/` with their
tokenizers in `tokenizer*/`, sharded weights (transformer and T5) behind their indexes, a README and a picture.
`bfl_repo`: a fine-tune published as a BFL file set only. `encoder_repo`: a transformers model repo (CLIP-L's or
T5's), whose weights come in the other frameworks' formats too (PyTorch, TensorFlow, Flax), as on the Hub.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from flux_runtime.registry import CLIP_L_ID, T5_XXL_ID
from flux_runtime.weights.builtin import MODELS_DIR
from flux_runtime.weights.convert import convert
from tests.hub_server import Repo

TINY = MODELS_DIR / "tiny"
CLIP_TOKENIZER = (
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
)
T5_TOKENIZER = ("special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def flux1_repo(root: Path, dit_file: str = "flux1-dev.safetensors") -> dict[str, Path]:
    """Write FLUX.1-dev's repo layout under `root`; its files, path in the repo → file."""
    root.mkdir(parents=True)
    shutil.copy(TINY / "flux1-tiny.safetensors", root / dit_file)
    shutil.copy(TINY / "ae.safetensors", root / "ae.safetensors")
    convert("transformer", TINY / "flux1-tiny.safetensors", root / "transformer", max_shard_size=4 * 10**6)
    convert("vae", TINY / "ae.safetensors", root / "vae")
    _copy(TINY / "text_encoder", root / "text_encoder", ("config.json", "model.safetensors"))
    _copy(TINY / "text_encoder", root / "tokenizer", CLIP_TOKENIZER)
    _copy(TINY / "text_encoder_2", root / "text_encoder_2", ("config.json",))
    _shard(TINY / "text_encoder_2" / "model.safetensors", root / "text_encoder_2", "model")
    _copy(TINY / "text_encoder_2", root / "tokenizer_2", T5_TOKENIZER)
    _write(root / "scheduler" / "scheduler_config.json", json.dumps(SCHEDULER))
    _write(root / "model_index.json", json.dumps(MODEL_INDEX))
    _write(root / "README.md", "---\nlicense: other\n---\n# a tiny FLUX.1\n")
    _write(root / "LICENSE.md", "a licence\n")
    (root / "dev_grid.jpg").write_bytes(bytes(range(256)) * 64)
    return _files(root)


def bfl_repo(root: Path) -> dict[str, Path]:
    """A FLUX.1 fine-tune published as a BFL file set: its transformer file and `ae.safetensors`, no text
    encoders (they come from CLIP-L's and T5's own repos)."""
    root.mkdir(parents=True)
    shutil.copy(TINY / "flux1-tiny.safetensors", root / "finetune.safetensors")
    shutil.copy(TINY / "ae.safetensors", root / "ae.safetensors")
    _write(root / "README.md", "# a fine-tune\n")
    return _files(root)


def encoder_repo(root: Path, encoder: str) -> dict[str, Path]:
    """A transformers text encoder repo at its root (`encoder` "text_encoder" for CLIP-L, "text_encoder_2" for
    T5), with the same weights in other frameworks' files beside `model.safetensors`."""
    _copy(TINY / encoder, root, tuple(p.name for p in (TINY / encoder).iterdir()))
    for name in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack"):
        (root / name).write_bytes(b"\0" * 4096)
    _write(root / "README.md", "# a text encoder\n")
    return _files(root)


def _copy(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(src / name, dst / name)


def _shard(path: Path, folder: Path, stem: str) -> None:
    """`path`'s tensors in two shards with their index, as transformers writes a large model."""
    tensors = load_file(path)
    keys = sorted(tensors)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        name = f"{stem}-{i:05d}-of-{len(halves):05d}.safetensors"
        save_file({k: tensors[k] for k in part}, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    _write(folder / f"{stem}.safetensors.index.json", json.dumps(index))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def stand_in_repos(root: Path) -> dict[str, Repo]:
    """What the stand-in Hub serves: FLUX.1 [schnell] (open) and [dev] (gated) in FLUX.1-dev's layout, a BFL-only
    fine-tune the registry does not know, and the CLIP-L and T5 repos a BFL file set pairs with."""
    schnell = flux1_repo(root / "schnell", "flux1-schnell.safetensors")
    dev = {
        ("flux1-dev.safetensors" if p == "flux1-schnell.safetensors" else p): f for p, f in schnell.items()
    }
    return {
        "black-forest-labs/FLUX.1-schnell": Repo(schnell),
        "black-forest-labs/FLUX.1-dev": Repo(dev, gated=True),
        "someone/flux1-finetune": Repo(bfl_repo(root / "finetune")),
        CLIP_L_ID: Repo(encoder_repo(root / "clip", "text_encoder")),
        T5_XXL_ID: Repo(encoder_repo(root / "t5", "text_encoder_2")),
    }
