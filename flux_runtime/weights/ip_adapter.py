"""Reading a FLUX.1 IP-Adapter file: XLabs' layout (as `XLabs-AI/flux-ip-adapter` ships it) or diffusers'.

The layout is read from the keys, as diffusers' loader reads it:

- the image projection under `ip_adapter_proj_model.` (XLabs) or `image_proj.` (diffusers): `proj` (a linear
  from CLIP's image embedding to tokens x width features) and `norm` (a LayerNorm over each token);
- each double block's key and value projections under `double_blocks.N.processor.ip_adapter_double_stream_
  {k,v}_proj.` (XLabs) or `ip_adapter.N.to_{k,v}_ip.` (diffusers).

The number of image tokens follows diffusers' rule: 16 when `proj` has 65536 output rows (XLabs' 16 x 4096),
else 4. `read_ip_adapter` checks every shape against the transformer before anything is built, so a file
that is not an IP-Adapter, or one made for another model, fails as one line naming the file.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.safetensors_io import read_header

FILE_NAME = "ip_adapter.safetensors"  # XLabs' file name, what a folder is searched for first
_PROJ_PREFIXES = ("ip_adapter_proj_model.", "image_proj.")
_XLABS_BLOCK = re.compile(
    r"double_blocks\.(\d+)\.processor\.ip_adapter_double_stream_([kv])_proj\.(weight|bias)"
)
_DIFFUSERS_BLOCK = re.compile(r"ip_adapter\.(\d+)\.to_([kv])_ip\.(weight|bias)")
WIDE_TOKENS, WIDE_ROWS, TOKENS = 16, 65536, 4  # diffusers' rule for the number of image tokens


class IPAdapterError(WeightsError):
    """An IP-Adapter file that is missing, not an IP-Adapter, or made for another transformer."""


@dataclass
class IPAdapterWeights:
    """An IP-Adapter's tensors under our names (`image_proj.proj.weight`, `blocks.N.to_k_ip.weight`, ...) and
    its shape: CLIP embedding width, image tokens, token width (the transformer's text width), blocks."""

    file: Path
    sha256: str
    tensors: dict[str, Tensor]
    embed_dim: int
    tokens: int
    width: int
    depth: int


def ip_adapter_file(path_or_id: str | Path) -> Path:
    """The file of an IP-Adapter given as a .safetensors path, a folder (or a cached Hugging Face id) holding
    `ip_adapter.safetensors` or a single .safetensors file."""
    try:
        path = resolve(path_or_id)
    except WeightsError as e:
        raise IPAdapterError(f"IP-Adapter {e}") from None
    if path.is_dir():
        named = path / FILE_NAME
        files = [named] if named.is_file() else sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            found = ", ".join(f.name for f in files) if files else "none"
            raise IPAdapterError(f"{path_or_id}: give the IP-Adapter file itself; this folder holds {found}")
        path = files[0]
    return path.absolute()  # not resolved: a cached snapshot's file keeps its name (its blob has a hash)


def _our_name(key: str) -> str | None:
    """Our module name for a file key, None for a key of neither layout."""
    for prefix in _PROJ_PREFIXES:
        if key.startswith(prefix):
            return "image_proj." + key[len(prefix) :]
    m = _XLABS_BLOCK.fullmatch(key) or _DIFFUSERS_BLOCK.fullmatch(key)
    if m is not None:
        return f"blocks.{m.group(1)}.to_{m.group(2)}_ip.{m.group(3)}"
    return None


def check_ip_adapter_file(path_or_id: str | Path) -> Path:
    """`ip_adapter_file`, its header read and its keys checked to be an IP-Adapter's (no tensor data): what a
    command checks before it loads a model."""
    path = ip_adapter_file(path_or_id)
    header = _header(path)
    _layout(path, {k: v["shape"] for k, v in header.items()})
    return path


def _header(path: Path) -> dict[str, dict]:
    try:
        header = read_header(path)
    except WeightsError as e:
        raise IPAdapterError(f"{e}; IP-Adapters are read from .safetensors") from None
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _layout(path: Path, shapes: dict[str, list[int]]) -> tuple[int, int, int, int]:
    """(embed_dim, tokens, width, depth) from the keys and shapes; an IPAdapterError where they are not an
    IP-Adapter's."""
    names = {key: _our_name(key) for key in shapes}
    ours = {n: list(shapes[k]) for k, n in names.items() if n is not None}
    proj = ours.get("image_proj.proj.weight")
    blocks = sorted({int(n.split(".")[1]) for n in ours if n.startswith("blocks.")})
    if proj is None or not blocks:
        raise IPAdapterError(
            f"{path.name} is not a FLUX IP-Adapter: it lacks the image projection (ip_adapter_proj_model.proj) "
            "or the double blocks' ip_adapter_double_stream_k_proj / _v_proj keys"
        )
    unknown = sorted(k for k, n in names.items() if n is None)
    if unknown:
        raise IPAdapterError(f"{path.name}: unexpected key {unknown[0]} for a FLUX IP-Adapter")
    if len(proj) != 2:
        raise IPAdapterError(
            f"{path.name}: the image projection's weight has shape {proj}, not (rows, columns)"
        )
    rows, embed_dim = proj
    tokens = WIDE_TOKENS if rows == WIDE_ROWS else TOKENS
    width = rows // tokens
    if blocks != list(range(len(blocks))):
        raise IPAdapterError(
            f"{path.name}: its double blocks are numbered {blocks}, not 0..{len(blocks) - 1}"
        )
    hidden = ours.get("blocks.0.to_k_ip.weight", [0, 0])[0]
    want = {
        "image_proj.proj.weight": [rows, embed_dim],
        "image_proj.proj.bias": [rows],
        "image_proj.norm.weight": [width],
        "image_proj.norm.bias": [width],
    }
    for i in blocks:
        for kv in "kv":
            want[f"blocks.{i}.to_{kv}_ip.weight"] = [hidden, width]
            want[f"blocks.{i}.to_{kv}_ip.bias"] = [hidden]
    for name, shape in want.items():
        if ours.get(name) != shape:
            got = "missing" if name not in ours else f"shape {ours[name]}"
            raise IPAdapterError(f"{path.name}: {name} is {got}, expected {shape}")
    return embed_dim, tokens, width, len(blocks)


def read_ip_adapter(path_or_id: str | Path) -> IPAdapterWeights:
    """The IP-Adapter's tensors (CPU, the file's dtypes) under our names, its layout and its file's sha256."""
    from safetensors.torch import load

    path = ip_adapter_file(path_or_id)
    header = _header(path)
    embed_dim, tokens, width, depth = _layout(path, {k: v["shape"] for k, v in header.items()})
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    raw = load(data)
    del data
    tensors = {_our_name(k): t for k, t in raw.items()}
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise IPAdapterError(f"{path.name}: {name} is {t.dtype}, not a floating-point tensor")
        if not bool(torch.isfinite(t).all()):
            raise IPAdapterError(f"{path.name}: {name} holds NaN or infinite values; the file is damaged")
    return IPAdapterWeights(path, sha, tensors, embed_dim, tokens, width, depth)  # type: ignore[arg-type]
