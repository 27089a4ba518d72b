"""`flux-gen --prompts FILE`: read the file into one set of call options per line, every line checked at once.

A line is a prompt as plain text or, when it starts with `{`, a JSON object of per-image options named like
flux-gen's options with underscores (`{"prompt": "a fox", "seed": 3, "num_images": 2}`); blank lines and lines
starting with `#` are skipped. The options a line sets override the command line's for that line only; what
is fixed once the model is loaded (`--model`, `--dtype`, `--lora`, ...) stays on the command line.

Reading is all or nothing and needs no model: a bad line (unknown key, wrong type or value, missing image file,
broken JSON) fails here as one line naming FILE:LINE, so a long run never stops on line 90 for a typo, and no
weights are read for a file that cannot run. Checks that need the model's numbers (the size multiple, the
prompt's length in tokens) are flux-gen's and the pipeline's, as for a single run.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import unicodedata
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click


@dataclass(frozen=True)
class _Key:
    """A per-line option: what its value must be (said in errors) and the test of a JSON value."""

    what: str
    ok: Callable[[Any], bool]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _int_in(low: int, high: int | None = None) -> _Key:
    what = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
    return _Key(what, lambda v: _is_int(v) and v >= low and (high is None or v <= high))


def _text(v: object) -> bool:
    return isinstance(v, str) and bool(v.strip())


PATH = _Key("a file path (a string)", _text)
# The per-image options a line may set, as flux-gen's options name them (underscores for dashes). Their
# values are typed JSON (3, not "3"): a line is checked as strictly as the command line's option would be.
KEYS: dict[str, _Key] = {
    "prompt": _Key("a non-empty string", _text),
    "seed": _Key("an integer in 0..2**64-1", lambda v: _is_int(v) and 0 <= v < 2**64),
    "width": _int_in(1),
    "height": _int_in(1),
    "steps": _int_in(1),
    "guidance": _Key("a finite number >= 0", lambda v: _is_number(v) and v >= 0),
    "num_images": _int_in(1),
    "max_sequence_length": _int_in(1, 512),
    "image": _Key(
        "a file path or a list of file paths",
        lambda v: _text(v) or (isinstance(v, list) and bool(v) and all(_text(p) for p in v)),
    ),
    "negative_prompt": _Key("a string", lambda v: isinstance(v, str)),
    "true_cfg": _Key("a finite number >= 1", lambda v: _is_number(v) and v >= 1),
    "strength": _Key("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1),
    "mask": PATH,
    "control_image": _Key(
        "a file path or a list of file paths",
        lambda v: _text(v) or (isinstance(v, list) and bool(v) and all(_text(p) for p in v)),
    ),
    "max_area": _int_in(1),
    "no_auto_resize": _Key("true or false", lambda v: isinstance(v, bool)),
    "no_upsample": _Key("true or false", lambda v: isinstance(v, bool)),
    "boxes": _Key(
        "a JSON list of boxes or a .json file path",
        lambda v: isinstance(v, list) or _text(v),
    ),
}
SKIPPED = "blank lines and lines starting with # are skipped"


@dataclass(frozen=True)
class PromptLine:
    """One image call of the file: its line number (1-based, as editors count) and the options it sets."""

    number: int
    options: dict[str, Any]

    def file_names(self, num_images: int) -> list[str]:
        """The PNG names for this line's `num_images` images: `0007-a-red-fox.png`, or with several images
        `0007-a-red-fox-1.png`, `-2`, ... (the line number keeps names unique and in the file's order)."""
        stem = f"{self.number:04d}"
        words = slug(self.options["prompt"])
        stem = f"{stem}-{words}" if words else stem
        if num_images == 1:
            return [f"{stem}.png"]
        return [f"{stem}-{i}.png" for i in range(1, num_images + 1)]


def slug(prompt: str, limit: int = 40) -> str:
    """The prompt's first words for a file name: lowercase ASCII letters and digits joined by `-`, at most
    `limit` characters, cut at a word (accents are dropped, other scripts leave nothing)."""
    ascii_text = unicodedata.normalize("NFKD", prompt).encode("ascii", "ignore").decode().lower()
    words = re.findall(r"[a-z0-9]+", ascii_text)
    out = ""
    for word in words:
        longer = f"{out}-{word}" if out else word
        if len(longer) > limit:
            break
        out = longer
    return out or (words[0][:limit] if words else "")


def read_prompts(path: Path, command_options: Collection[str]) -> list[PromptLine]:
    """The file's prompt lines, each with its options checked (paths made absolute against the file's folder).

    `command_options` are flux-gen's option names (underscores), so that a line setting one that is fixed for
    the whole run (`model`, `dtype`, ...) is told to move it to the command line rather than called unknown.
    Raises one `click.ClickException` line naming FILE:LINE for the first bad line, or FILE for an empty file.
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise click.ClickException(f"--prompts {path}: cannot read it ({e.strerror or e})") from None
    lines = []
    for number, data in enumerate(raw.split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            text = data.decode("utf-8-sig" if number == 1 else "utf-8").strip()
        except UnicodeDecodeError as e:
            raise click.ClickException(
                f"{where}: not UTF-8 text (byte {e.start + 1} of the line); save the file as UTF-8"
            ) from None
        if not text or text.startswith("#"):
            continue
        if text.startswith("{"):
            options = _json_line(text, where, path.parent, command_options)
        else:
            options = {"prompt": text}
        lines.append(PromptLine(number, options))
    if not lines:
        raise click.ClickException(
            f"--prompts {path} holds no prompts ({SKIPPED}); write one prompt a line or one JSON object a line"
        )
    return lines


def _json_line(text: str, where: str, folder: Path, command_options: Collection[str]) -> dict[str, Any]:
    """A `{...}` line: the JSON object's options, checked, with image paths resolved against `folder`."""

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise click.ClickException(f"{where}: key {key!r} is given twice; keep one")
            seen[key] = value
        return seen

    try:
        obj = json.loads(text, object_pairs_hook=no_repeats)
    except json.JSONDecodeError as e:
        raise click.ClickException(
            f"{where}: not valid JSON ({e.msg} at column {e.colno}); write one JSON object a line, or a plain "
            "prompt that does not start with '{'"
        ) from None
    if not isinstance(obj, dict):  # e.g. `{} []` is extra data, so a `{` line parses to an object or fails
        raise click.ClickException(f"{where}: expected one JSON object")
    for key, value in obj.items():
        if key not in KEYS:
            raise click.ClickException(f"{where}: {_unknown(key, command_options)}")
        if not KEYS[key].ok(value):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise click.ClickException(f"{where}: {key} {shown} must be {KEYS[key].what}")
    if "prompt" not in obj:
        raise click.ClickException(f'{where}: no "prompt"; every line needs one')
    for key in ("image", "mask", "control_image"):
        if key in obj:
            given = obj[key] if isinstance(obj[key], list) else [obj[key]]
            paths = tuple(_existing(p, folder, where, key) for p in given)
            obj[key] = paths if key in ("image", "control_image") else paths[0]
    if isinstance(obj.get("boxes"), str) and not obj["boxes"].lstrip().startswith("["):
        obj["boxes"] = str(_existing(obj["boxes"], folder, where, "boxes"))
    return obj


def _existing(given: str, folder: Path, where: str, key: str) -> Path:
    """`given` as an absolute path (relative ones from the prompts file's folder), which must be a file."""
    path = (folder / Path(given).expanduser()).resolve()
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise click.ClickException(
            f"{where}: {key} {given!r}: {path} {what}; relative paths are read from the prompts file's folder"
        )
    return path


def _unknown(key: str, command_options: Collection[str]) -> str:
    """Why `key` cannot be set on a line, and what to write instead."""
    name = key.replace("-", "_")
    if name in KEYS:
        return f"unknown key {key!r}; did you mean {name!r}? (keys are spelled with underscores)"
    if name in command_options:
        flag = "--" + name.replace("_", "-")
        return f"{key!r} is set once for the whole file; give {flag} on the command line instead"
    near = difflib.get_close_matches(name, KEYS, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}?" if near else f"the keys are {', '.join(KEYS)}"
    return f"unknown key {key!r}; {hint}"
