"""Layout boxes for FLUX.3's prompt upsampler: the user's boxes checked and turned into the rows of the box table
the upsampler's layout modes (`t2i_bbox`, `i2i_bbox`) are prompted with, and the upsampler's answer reconciled with
them, as diffusers 0.42.1's upsampler step does.

A box is a dict. Text to image: `{"id", "desc", "bbox"}`; an edit may also place elements by origin:
`{"id", "desc", "from", "src_bbox", "tgt_bbox"}` with `from` "target" (new content: `tgt_bbox` only) or
"ref_image_N" (an element of reference N, 0-based: `src_bbox` where it is there, `tgt_bbox` where it goes, None if
it is removed). Boxes are `[y_min, x_min, y_max, x_max]` as fractions of the image (0-1, origin top left); the
table holds them on the upsampler's 0-1000 grid (`round(v * 1000)`). `id` defaults to `obj_<n>` (n from 1 in the
list's order), `desc` to "".

The answer of a layout mode is a caption citing elements as `<id>` followed by one JSON array (its own table).
Reconciling keeps the user's rows verbatim (taking the answer's description of each), renames an answer row that
re-planned a user box under another id (IoU >= 0.9) to the user's id, in the caption too, and appends the rows the
answer added when they are well formed and cited; the result is the caption, a space, and the table as JSON.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Hashable, Sequence
from typing import Any

GRID = 1000  # the upsampler's box grid
BOX_KEYS = ("id", "desc", "bbox", "from", "src_bbox", "tgt_bbox")
ID_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
REFERENCE_ORIGIN = re.compile(r"ref_image_(0|[1-9][0-9]*)")
ANSWER_ORIGIN = re.compile(r"ref_image_\d+|target")  # what an answer row's `from` may say
SAME_BOX_IOU = 0.9  # an answer row this close to a user box is that box under another id


def canvas_rows(boxes: Sequence[dict[str, Any]], num_references: int) -> list[dict[str, Any]]:
    """The table rows of the user's `boxes` for a request with `num_references` reference images; a ValueError in
    one line naming the box and the problem (an unknown key, a bad or inverted box, an unknown `from`, a reference
    index beyond the references given, a duplicate id)."""
    if isinstance(boxes, (str, bytes, dict)) or not isinstance(boxes, Sequence):
        raise ValueError(f"boxes must be a list of dicts, got {type(boxes).__name__}")
    if not boxes:
        raise ValueError("boxes is empty: give at least one box, or None for no layout")
    rows: list[dict[str, Any]] = []
    for i, box in enumerate(boxes):
        if not isinstance(box, dict):
            raise ValueError(f"box {i} must be a dict, got {type(box).__name__}")
        unknown = [repr(k) for k in box if k not in BOX_KEYS]
        if unknown:
            raise ValueError(
                f"box {i} has unknown key(s) {', '.join(unknown)}: a box takes {', '.join(BOX_KEYS)}"
            )
        given = {k for k, v in box.items() if v is not None}
        row_id = box.get("id", None)
        if row_id is None:
            row_id = f"obj_{i + 1}"
        elif not isinstance(row_id, str) or not ID_PATTERN.fullmatch(row_id):
            raise ValueError(
                f"box {i}: id {row_id!r} must be a letter then letters, digits or '_' (e.g. 'cup_1'), as the "
                "caption cites it as <id>"
            )
        if any(row["id"] == row_id for row in rows):
            raise ValueError(f"box {i}: id {row_id!r} is used twice; ids must be unique")
        desc = box.get("desc", None)
        if desc is None:
            desc = ""
        elif not isinstance(desc, str):
            raise ValueError(f"box {i}: desc must be a string, got {type(desc).__name__}")
        if "bbox" in given:
            mixed = sorted(given & {"from", "src_bbox", "tgt_bbox"})
            if mixed:
                raise ValueError(
                    f"box {i} has 'bbox' and {', '.join(repr(k) for k in mixed)}: give 'bbox' (an element of "
                    "the image) or 'from' with 'src_bbox' / 'tgt_bbox' (an edit), not both"
                )
            rows.append({"id": row_id, "bbox": _grid(box["bbox"], i, "bbox"), "desc": desc})
            continue
        if not given & {"src_bbox", "tgt_bbox"}:
            raise ValueError(
                f"box {i} has no 'bbox' (an element of the image) nor 'src_bbox' / 'tgt_bbox' (with 'from', an edit)"
            )
        origin = box.get("from", None)
        src = None if box.get("src_bbox") is None else _grid(box["src_bbox"], i, "src_bbox")
        tgt = None if box.get("tgt_bbox") is None else _grid(box["tgt_bbox"], i, "tgt_bbox")
        _check_origin(origin, src, tgt, i, num_references)
        rows.append({"id": row_id, "from": origin, "src_bbox": src, "tgt_bbox": tgt, "desc": desc})
    return rows


def box_record(boxes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The (checked) user boxes as JSON values for the provenance: keys given, coordinates as lists of floats."""
    out = []
    for box in boxes:
        entry: dict[str, Any] = {}
        for key, value in box.items():
            if key.endswith("bbox") and value is not None:
                value = [float(v) for v in value]
            entry[key] = value
        out.append(entry)
    return out


def _check_origin(origin: Any, src: list[int] | None, tgt: list[int] | None, i: int, refs: int) -> None:
    if not isinstance(origin, str) or not (origin == "target" or REFERENCE_ORIGIN.fullmatch(origin)):
        raise ValueError(
            f"box {i}: 'from' is {origin!r}; give 'target' (a new element, with tgt_bbox) or 'ref_image_N' (an "
            "element of reference image N, counted from 0, with src_bbox)"
        )
    if origin == "target":
        if src is not None or tgt is None:
            raise ValueError(
                f"box {i}: a 'target' box is a new element: it has a tgt_bbox (where it goes) and no src_bbox"
            )
        return
    index = int(origin.removeprefix("ref_image_"))
    if index >= refs:
        have = (
            "no reference images were given"
            if refs == 0
            else f"{refs} reference image{'s were' if refs > 1 else ' was'} given (ref_image_0 to ref_image_{refs - 1})"
        )
        raise ValueError(f"box {i}: 'from' is {origin} but {have}")
    if src is None:
        raise ValueError(
            f"box {i}: a box from {origin} needs its src_bbox (where the element is in that image); its tgt_bbox "
            "is where it goes (None: removed)"
        )


def _grid(value: Any, i: int, key: str) -> list[int]:
    """A user box (0-1) on the 0-1000 grid, or a ValueError saying what is wrong with it."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence) or len(value) != 4:
        raise ValueError(f"box {i}: {key} must be [y_min, x_min, y_max, x_max], got {value!r}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"box {i}: {key} {list(value)!r} must hold four finite numbers")
        if not 0 <= v <= 1:
            raise ValueError(
                f"box {i}: {key} {list(value)!r} must be fractions of the image in [0, 1] (origin top left); "
                "divide pixel or 0-1000 coordinates by the image's size or by 1000"
            )
    y0, x0, y1, x1 = value
    if not (y0 < y1 and x0 < x1):
        raise ValueError(
            f"box {i}: {key} {list(value)!r} is [y_min, x_min, y_max, x_max]: y_min < y_max and x_min < x_max"
        )
    grid = [round(float(v) * GRID) for v in value]
    if not (grid[0] < grid[2] and grid[1] < grid[3]):
        raise ValueError(f"box {i}: {key} {list(value)!r} is thinner than 1/{GRID} of the image")
    return grid


# ------------------------------------------------------------------ the answer


def split_table(text: str) -> tuple[str, list[Any] | None]:
    """(caption, table): the table is the JSON array the text ends with (the one starting at the last '[' from
    which the rest parses), None if there is none; the caption is the text before it."""
    start = len(text)
    while (start := text.rfind("[", 0, start)) >= 0:
        try:
            value = json.loads(text[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(value, list):
            return text[:start].rstrip(), value
    return text.strip(), None


def answer_box(value: Any) -> list[Any] | None:
    """An answer's box as a list if it is a proper box on the 0-1000 grid (four finite numbers, positive extent,
    inside the grid, not all at most 1, which would be 0-1 coordinates), else None."""
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        return None
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == math.inf:
            return None
    y0, x0, y1, x1 = value
    if min(y0, x0) < 0 or y1 <= y0 or x1 <= x0 or max(y1, x1) > GRID or max(value) <= 1:
        return None
    return list(value)


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two [y_min, x_min, y_max, x_max] boxes (0 when the union is empty)."""
    overlap_y = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    overlap_x = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = overlap_y * overlap_x
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def added_row(row: Any, caption: str) -> dict[str, Any] | None:
    """A row the answer added, normalised, if it is well formed and the caption cites it; else None."""
    if not isinstance(row, dict):
        return None
    row_id, desc = row.get("id"), row.get("desc")
    if not (isinstance(row_id, str) and ID_PATTERN.fullmatch(row_id) and f"<{row_id}>" in caption):
        return None
    if not isinstance(desc, str) or not desc.strip():
        return None
    box = answer_box(row.get("bbox"))
    if box is not None:
        return {"id": row_id, "bbox": box, "desc": desc.strip()}
    origin, src, tgt = row.get("from"), row.get("src_bbox"), row.get("tgt_bbox")
    if not isinstance(origin, str) or not ANSWER_ORIGIN.fullmatch(origin):
        return None
    src_box = None if src is None else answer_box(src)
    tgt_box = None if tgt is None else answer_box(tgt)
    if (src is not None and src_box is None) or (tgt is not None and tgt_box is None):
        return None  # a box given but malformed
    if src_box is None and tgt_box is None:
        return None
    if (origin == "target") == (src_box is not None):
        return None  # new content has no source box; an element of a reference has one
    return {"id": row_id, "from": origin, "src_bbox": src_box, "tgt_bbox": tgt_box, "desc": desc.strip()}


def _row_box(row: dict[str, Any]) -> Any:
    return row.get("bbox") or row.get("tgt_bbox") or row.get("src_bbox")


def reconcile(answer: str, rows: list[dict[str, Any]]) -> str:
    """The layout answer with the user's `rows` (from `canvas_rows`) imposed: see the module docstring."""
    caption, table = split_table(answer)
    entries = [row for row in table or [] if isinstance(row, dict)]
    # ids as the answer gave them; a list or object as an id matches nothing
    ids = [row.get("id") if isinstance(row.get("id"), Hashable) else _NO_ID for row in entries]
    locked = {row["id"] for row in rows}
    present = set(ids)
    renamed: dict[Any, str] = {}
    for lock in rows:
        lock_box = _row_box(lock)
        if lock["id"] in present or lock_box is None:
            continue
        for row, row_id in zip(entries, ids, strict=True):
            if row_id is _NO_ID or "id" not in row or row_id in renamed or row_id in locked:
                continue
            box = answer_box(_row_box(row))
            if box is not None and box_iou(box, lock_box) >= SAME_BOX_IOU:
                renamed[row_id] = lock["id"]
                break
    for row, row_id in zip(entries, ids, strict=True):
        if row_id is not _NO_ID and row_id in renamed:
            row["id"] = renamed[row_id]
    for old, new in renamed.items():
        caption = caption.replace(f"<{old}>", f"<{new}>")

    described = {row["id"]: row for row in entries if isinstance(row.get("id"), str)}
    out = []
    for lock in rows:
        desc = described.get(lock["id"], {}).get("desc")
        out.append({**lock, "desc": desc.strip() if isinstance(desc, str) and desc.strip() else lock["desc"]})
    for row in entries:
        extra = added_row(row, caption)
        if extra is not None and all(extra["id"] != kept["id"] for kept in out):
            out.append(extra)
    return f"{caption} {json.dumps(out, ensure_ascii=False)}"


_NO_ID = object()
