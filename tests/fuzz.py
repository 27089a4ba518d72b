"""Seeded random mutations of JSON documents and their text, shared by the reader fuzz tests."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

# Values of every JSON kind, edge cases included (NaN and infinities pass Python's json module).
ODD_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    7,
    2**70,
    1.5,
    float("nan"),
    float("inf"),
    "",
    "x",
    "bfloat16",
    [],
    [1, 2],
    [-1, 3],
    ["a"],
    [0.5, 1],
    {},
    {"a": 1},
    {"dtype": "F32"},
)


def _containers(doc: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every dict and list inside `doc` (the root included)."""
    found = []
    if isinstance(doc, (dict, list)):
        found.append(path)
        items = doc.items() if isinstance(doc, dict) else enumerate(doc)
        for k, v in items:
            found += _containers(v, (*path, k))
    return found


def _at(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _odd(rng: random.Random) -> Any:
    """One of `ODD_VALUES`, copied: an inserted list or dict must not be shared (a later edit could make a cycle)."""
    return copy.deepcopy(rng.choice(ODD_VALUES))


def mutate_json(doc: Any, rng: random.Random) -> Any:
    """A copy of `doc` with one to three random edits: a key dropped, a value replaced by one of another
    kind, a key added, a list grown or shrunk, or the whole document replaced."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.05:
            return _odd(rng)
        target = _at(doc, rng.choice(_containers(doc))) if _containers(doc) else None
        if not isinstance(target, (dict, list)) or not target:
            continue
        is_dict = isinstance(target, dict)
        key = rng.choice(list(target) if is_dict else range(len(target)))
        action = rng.random()
        if action < 0.3:
            del target[key]
        elif action < (0.9 if is_dict else 0.8):
            target[key] = _odd(rng)
        elif is_dict:
            target[f"extra{rng.randint(0, 9)}"] = _odd(rng)
        else:
            target.append(_odd(rng))
    return doc


def mutate_text(text: str, rng: random.Random) -> str:
    """`text` cut short, with a character changed, or with one inserted."""
    i = rng.randrange(len(text) + 1)
    action = rng.random()
    if action < 0.4:
        return text[:i]
    if action < 0.7:
        return text[:i] + rng.choice('{}[],:"0a \\') + text[i + 1 :]
    return text[:i] + rng.choice('{}[],:"0a \\') + text[i:]


def mutations(doc: Any, seed: int, n: int) -> list[str]:
    """`n` mutated JSON texts of `doc`: most edit the structure, some the text itself."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.75:
            out.append(json.dumps(mutate_json(doc, rng)))
        else:
            out.append(mutate_text(json.dumps(doc), rng))
    return out
