"""Reading the JSON files that sit beside checkpoints (`config.json`, indexes, scheduler and pipeline configs).

Every reader goes through `read_json_object`, and every field it relies on is type-checked with `check_fields`,
so a damaged or hand-edited file fails as one `WeightsError` naming the file and the field, never as a
`TypeError` from deep inside the loader that first used the value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux_runtime.weights.errors import WeightsError


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or a `WeightsError` naming it (unreadable, not UTF-8, not JSON, not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object, found a {_json_type(data)}")
    return data


def read_json_if_present(path: Path) -> dict[str, Any] | None:
    """`read_json_object(path)`, or None when there is no such file."""
    return read_json_object(path) if path.is_file() else None


@dataclass(frozen=True)
class Kind:
    """What a field must hold: a description for the message and a predicate."""

    what: str
    ok: Callable[[object], bool]

    def or_null(self) -> Kind:
        return Kind(f"{self.what} or null", lambda v: v is None or self.ok(v))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)  # type: ignore[arg-type]


INT = Kind("an integer", _is_int)
NUMBER = Kind("a finite number", _is_number)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
STR = Kind("a string", lambda v: isinstance(v, str))
INT_LIST = Kind("a list of integers", lambda v: isinstance(v, list) and all(_is_int(x) for x in v))
STR_LIST = Kind("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))


def check_fields(data: Mapping[str, Any], schema: Mapping[str, Kind], where: Path | str) -> None:
    """Raise a `WeightsError` for the first field of `schema` present in `data` with the wrong kind of value.

    Absent fields are left to the caller's defaults; fields outside `schema` are not read, so not checked.
    """
    for name, kind in schema.items():
        if name in data and not kind.ok(data[name]):
            raise WeightsError(f"{where}: {name!r} must be {kind.what}, got {_short(data[name])}")


def _json_type(v: object) -> str:
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _short(v: object) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
