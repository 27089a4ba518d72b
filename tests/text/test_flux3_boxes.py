"""FLUX.3's upsampler layout boxes: checked in one line, put on the grid as diffusers' `boxes_to_canvas` does, the
layout caption (t2i_bbox, i2i_bbox with one and two references) equal to diffusers' `upsample_prompt` with `boxes`,
and answers reconciled with the boxes as diffusers' `reconcile_boxes` does."""

from __future__ import annotations

import json

import pytest
import torch

from flux_runtime.text.flux3_boxes import canvas_rows, reconcile, split_table
from flux_runtime.text.flux3_upsampler import PromptUpsampler, prepare_upsampler_references
from tests.flux3_upsampler_fixtures import image_processor, make_tiny_upsampler
from tests.text.test_flux3_upsampler import edit_images, recording, same_inputs

T2I_BOXES = [
    {"id": "cup_1", "desc": "a red cup", "bbox": [0.1, 0.2, 0.5, 0.6]},
    {"bbox": (0, 0.0005, 1, 0.0015)},  # default id and desc; half-way values round to even on the grid
    {"id": "En_Text_1", "desc": '"OPEN"', "bbox": [0.2345, 0.5, 0.9995, 1]},
]
EDIT_BOXES = [
    {"id": "hat_1", "desc": "a straw hat", "from": "target", "tgt_bbox": [0.05, 0.3, 0.25, 0.7]},
    {
        "id": "dog_1",
        "from": "ref_image_0",
        "src_bbox": [0.4, 0.1, 0.9, 0.5],
        "tgt_bbox": [0.4, 0.5, 0.9, 0.9],
    },
    {"id": "lamp_1", "from": "ref_image_0", "src_bbox": [0.0, 0.8, 0.3, 1.0], "tgt_bbox": None},  # removed
]
TWO_REF_BOXES = [
    *EDIT_BOXES,
    {"id": "cat_1", "desc": "the cat", "from": "ref_image_1", "src_bbox": [0.2, 0.2, 0.8, 0.8]},
    {"id": "sun_1", "bbox": [0.0, 0.0, 0.1, 0.1]},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_upsampler(tmp_path_factory.mktemp("pup"), seed=6)


@pytest.mark.parametrize(("boxes", "refs"), [(T2I_BOXES, 0), (EDIT_BOXES, 1), (TWO_REF_BOXES, 2)])
def test_rows_equal_diffusers(boxes, refs):
    from diffusers.modular_pipelines.flux3.prompt_upsampler import boxes_to_canvas

    rows = canvas_rows(boxes, refs)
    assert rows == boxes_to_canvas(boxes)
    # the key order too: it is the prompt's text
    assert json.dumps(rows) == json.dumps(boxes_to_canvas(boxes))
    assert rows[1]["id"] == "obj_2" if refs == 0 else rows[1]["id"] == "dog_1"
    if refs == 0:
        assert rows[1]["bbox"] == [0, 0, 1000, 2]


@pytest.mark.parametrize(
    ("boxes", "refs", "match"),
    [
        ({"bbox": [0, 0, 1, 1]}, 0, "boxes must be a list of dicts"),
        ([], 0, "boxes is empty"),
        (["cup"], 0, "box 0 must be a dict"),
        ([{"bbox": [0, 0, 1, 1], "box": 1}], 0, "box 0 has unknown key.*'box'"),
        ([{"bbox": [0, 0, 1]}], 0, r"box 0: bbox must be \[y_min, x_min, y_max, x_max\]"),
        ([{"bbox": [0, 0, 1, float("nan")]}], 0, "four finite numbers"),
        ([{"bbox": [0, 0, True, 1]}], 0, "four finite numbers"),
        ([{"bbox": [0, 0, 500, 1000]}], 0, r"fractions of the image in \[0, 1\].*divide"),
        ([{"bbox": [0, 0, 1, 1]}, {"bbox": [0.5, 0.2, 0.4, 0.3]}], 0, "box 1: .*y_min < y_max"),
        ([{"bbox": [0.5, 0.1, 0.5002, 0.3]}], 0, "thinner than 1/1000"),
        ([{"id": "2cups", "bbox": [0, 0, 1, 1]}], 0, "id '2cups' must be a letter"),
        ([{"id": "a", "bbox": [0, 0, 1, 1]}, {"id": "a", "bbox": [0, 0, 1, 1]}], 0, "'a' is used twice"),
        ([{"id": "obj_2", "bbox": [0, 0, 1, 1]}, {"bbox": [0, 0, 1, 1]}], 0, "'obj_2' is used twice"),
        ([{"desc": 3, "bbox": [0, 0, 1, 1]}], 0, "desc must be a string"),
        ([{"bbox": [0, 0, 1, 1], "from": "target"}], 1, "has 'bbox' and 'from'"),
        ([{"from": "target"}], 1, "has no 'bbox'.*nor 'src_bbox' / 'tgt_bbox'"),
        ([{"from": "reference_0", "src_bbox": [0, 0, 1, 1]}], 1, "'from' is 'reference_0'; give 'target'"),
        ([{"tgt_bbox": [0, 0, 1, 1]}], 1, "'from' is None"),
        ([{"from": "ref_image_01", "src_bbox": [0, 0, 1, 1]}], 2, "'from' is 'ref_image_01'"),
        (
            [{"from": "ref_image_1", "src_bbox": [0, 0, 1, 1]}],
            1,
            r"ref_image_1 but 1 reference image was given \(ref_image_0 to ref_image_0\)",
        ),
        ([{"from": "ref_image_2", "src_bbox": [0, 0, 1, 1]}], 2, r"ref_image_0 to ref_image_1\)"),
        ([{"from": "ref_image_0", "src_bbox": [0, 0, 1, 1]}], 0, "no reference images were given"),
        ([{"from": "target", "src_bbox": [0, 0, 1, 1], "tgt_bbox": [0, 0, 1, 1]}], 1, "no src_bbox"),
        ([{"from": "ref_image_0", "tgt_bbox": [0, 0, 1, 1]}], 1, "needs its src_bbox"),
    ],
)
def test_bad_boxes_fail_in_one_line(boxes, refs, match):
    with pytest.raises(ValueError, match=match) as e:
        canvas_rows(boxes, refs)
    assert "\n" not in str(e.value)


LOCKED = [
    {"id": "cup_1", "desc": "a cup", "bbox": [0.1, 0.1, 0.5, 0.5]},
    {"id": "hat_1", "from": "target", "tgt_bbox": [0.6, 0.6, 0.9, 0.9]},
    {"id": "lamp_1", "desc": "a lamp", "from": "ref_image_0", "src_bbox": [0.0, 0.8, 0.3, 1.0]},
]
ANSWERS = [
    "Just a caption, no table.",
    "A caption [1, 2] with text after it.",
    'A mug <mug_1> and a hat <hat_1>. [{"id": "mug_1", "bbox": [101, 99, 500, 502], "desc": " a mug. "}, '
    '{"id": "hat_1", "from": "target", "src_bbox": null, "tgt_bbox": [600, 600, 900, 900], "desc": "a hat"}]',
    'A mug <mug_1>. [{"id": "mug_1", "bbox": [150, 150, 500, 500], "desc": "below the IoU"}]',  # not renamed
    'Things <dog_1> <cat_1> <sun_1> <bad_1> <old_1> <x_1> <y_1> <z_1>. [1, "row", '
    '{"id": "dog_1", "from": "ref_image_3", "src_bbox": [1, 2, 300, 400], "tgt_bbox": [5, 5, 600, 700], "desc": "d"},'
    ' {"id": "cat_1", "from": "target", "src_bbox": null, "tgt_bbox": [0, 0, 1000, 1000], "desc": "c"},'
    ' {"id": "sun_1", "bbox": [0, 0, 1, 1], "desc": "0-1 coordinates"},'
    ' {"id": "bad_1", "from": "target", "src_bbox": [0, 0, 10, 10], "tgt_bbox": [0, 0, 10, 10], "desc": "b"},'
    ' {"id": "old_1", "from": "ref_image_0", "src_bbox": null, "tgt_bbox": [0, 0, 10, 10], "desc": "o"},'
    ' {"id": "x_1", "bbox": [0, 0, 1001, 10], "desc": "off the grid"},'
    ' {"id": "y_1", "bbox": [0, 0, true, 10], "desc": "a bool"}, {"id": "z_1", "bbox": [0, 0, 10, 10], "desc": " "},'
    ' {"id": "uncited_1", "bbox": [0, 0, 10, 10], "desc": "u"}, {"id": "2x", "bbox": [0, 0, 10, 10], "desc": "n"},'
    ' {"id": "dog_1", "bbox": [5, 5, 50, 50], "desc": "a duplicate"}, {"id": "w_1", "bbox": [NaN, 0, 5, 5]}]',
    'Renamed <5> and <lampe>. [{"id": 5, "bbox": [100, 100, 500, 500], "desc": "five"}, '
    '{"id": "lampe", "from": "ref_image_0", "src_bbox": [0, 800, 300, 1000], "tgt_bbox": null, "desc": "l"}, '
    '{"id": "cup_1", "desc": ""}]',
    'Two candidates <a_1> <b_1>. [{"id": "a_1", "bbox": [100, 100, 500, 500], "desc": "first"}, '
    '{"id": "b_1", "bbox": [100, 100, 500, 500], "desc": "second"}, {"id": "hat_1", "desc": "kept"}]',
]


@pytest.mark.parametrize("answer", ANSWERS, ids=range(len(ANSWERS)))
def test_reconcile_equals_diffusers(answer):
    from diffusers.modular_pipelines.flux3.prompt_upsampler import boxes_to_canvas, reconcile_boxes

    got = reconcile(answer, canvas_rows(LOCKED, 1))
    assert got == reconcile_boxes(answer, boxes_to_canvas(LOCKED))
    table = split_table(got)[1]
    assert [row["id"] for row in table[:3]] == ["cup_1", "hat_1", "lamp_1"]


def test_reconcile_outcomes():
    rows = canvas_rows(LOCKED, 1)
    caption, table = split_table(reconcile(ANSWERS[2], rows))
    assert caption == "A mug <cup_1> and a hat <hat_1>."  # re-planned under another id: renamed
    assert table[0] == {"id": "cup_1", "bbox": [100, 100, 500, 500], "desc": "a mug."}  # the user's box kept
    assert len(table) == 3 and table[2]["desc"] == "a lamp"
    caption, table = split_table(reconcile(ANSWERS[4], rows))
    assert [row["id"] for row in table[3:]] == ["dog_1", "cat_1"]  # only the valid, cited additions
    # an answer row without an id that re-plans a user box: left alone (diffusers' reconcile_boxes raises KeyError)
    odd = 'A <cup_1>. [{"bbox": [100, 100, 500, 500], "desc": "no id"}, {"id": ["a"], "desc": "a list"}]'
    assert split_table(reconcile(odd, rows))[1] == rows


@pytest.mark.parametrize(
    ("boxes", "count"),
    [(T2I_BOXES, 0), pytest.param(EDIT_BOXES, 1, marks=pytest.mark.slow), (TWO_REF_BOXES, 2)],
    ids=["t2i_bbox", "i2i_bbox-one", "i2i_bbox-two"],
)
def test_layout_caption_equals_diffusers(folder, boxes, count):
    from diffusers.modular_pipelines.flux3.prompt_upsampler import prepare_references, upsample_prompt
    from transformers import Qwen3_5ForConditionalGeneration

    request, images = "a dog with a hat", edit_images(count)
    ours = PromptUpsampler.from_pretrained(folder, dtype=torch.float32)
    ours.processor = image_processor(folder)
    seen = recording(ours.model)
    caption = ours.upsample(request, prepare_upsampler_references(images), boxes=boxes)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    )
    seen_ref = recording(model)
    want = upsample_prompt(
        model, image_processor(folder), request, images=prepare_references(images) or None, boxes=boxes
    )
    assert caption == want
    same_inputs(seen, seen_ref)
    rows = canvas_rows(boxes, count)
    messages = ours.messages(request, prepare_upsampler_references(images), rows)
    system = messages[0]["content"][0]["text"]
    assert system == (ours.prompts.i2i_bbox if count else ours.prompts.t2i_bbox)
    assert json.dumps(rows, ensure_ascii=False) in messages[1]["content"][-1]["text"]
    assert [row["id"] for row in split_table(caption)[1][: len(rows)]] == [row["id"] for row in rows]
