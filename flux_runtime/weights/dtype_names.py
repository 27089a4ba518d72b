"""The dtype names of safetensors headers and the torch dtypes they stand for: one table for the reader, the
writer and the loaders' dtype checks.

The format names IEEE binary floats `F` followed by their width in bits, bfloat16 `BF16`, the two float8
kinds `F8_E4M3` / `F8_E5M2`, signed and unsigned integers `I` / `U` with their width, and booleans `BOOL`.
"""

from __future__ import annotations

import torch

_IEEE_FLOATS = (torch.float64, torch.float32, torch.float16)

# header name -> torch dtype, for every kind a FLUX checkpoint uses (others go through safetensors itself)
TORCH_DTYPES: dict[str, torch.dtype] = {f"F{torch.finfo(t).bits}": t for t in _IEEE_FLOATS} | {
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_DTYPES: dict[torch.dtype, str] = {t: name for name, t in TORCH_DTYPES.items()}
# the floating-point kinds (a FLUX weight is stored as one of them)
FLOAT_KINDS: frozenset[str] = frozenset(name for name, t in TORCH_DTYPES.items() if t.is_floating_point)
# bytes per element of every kind a header is read with (the sub-byte F4 / F6 kinds are not)
ITEMSIZE: dict[str, int] = {name: t.itemsize for name, t in TORCH_DTYPES.items()} | {
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E8M0": 1,
}
