"""FLUX.3's prompt upsampler writes diffusers' caption (a tiny random Qwen3.5, greedy generate) for text requests and
for edit requests with one and two reference images (what `generate` receives equal too), prepares reference images
as diffusers' upsampler step does, and refuses bad system-prompt files in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flux_runtime.text.flux3_upsampler import (
    PromptUpsampler,
    UpsamplerPrompts,
    prepare_upsampler_references,
    upsampler_reference_size,
)
from flux_runtime.weights import WeightsError
from tests.flux3_upsampler_fixtures import image_processor, make_tiny_upsampler, text_only_processor

REQUESTS = ["a red fox in the snow", 'Ein Leuchtturm bei Nacht, "TEXT" auf dem Schild']


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_upsampler(tmp_path_factory.mktemp("pup"), seed=6)


def _diffusers_caption(folder, request: str, dtype: torch.dtype) -> str:
    from diffusers.modular_pipelines.flux3.prompt_upsampler import upsample_prompt
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return upsample_prompt(model, text_only_processor(folder), request)


@pytest.mark.parametrize(
    ("dtype", "request_"),
    [(torch.float32, REQUESTS[0]), (torch.float32, REQUESTS[1]), (torch.bfloat16, REQUESTS[0])],
)
def test_caption_equals_diffusers(folder, dtype, request_):
    ours = PromptUpsampler.from_pretrained(folder, dtype=dtype)
    caption = ours.upsample(request_)
    assert caption == _diffusers_caption(folder, request_, dtype)
    assert len(caption) > 3 and caption != request_
    messages = ours.messages(request_)
    assert (
        messages[0]["content"][0]["text"] == ours.prompts.t2i
        and messages[1]["content"][0]["text"] == request_
    )


def _img(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = 4 if mode in ("RGBA", "P") else 3
    image = Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8))
    if mode == "P":
        image = image.convert("RGB").quantize(16)
        image.info["transparency"] = 3
    return image.convert(mode) if mode not in ("RGB", "P") else image


@pytest.mark.parametrize("count", [1, 2, 3])
def test_reference_preparation_equals_diffusers(count):
    from diffusers.modular_pipelines.flux3.prompt_upsampler import prepare_references

    pool = [
        _img(1500, 1100, seed=1),
        _img(300, 77, "RGBA", seed=2),
        _img(64, 640, "P", seed=3),
        _img(33, 33, "LA"),
    ]
    rotated = _img(120, 80, seed=4)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° on display
    rotated.info["exif"] = exif.tobytes()
    rotated = Image.open(_png_with_exif(rotated, exif))
    images = [rotated, *pool][:count] if count < 3 else pool[:3]
    got, want = prepare_upsampler_references(images), prepare_references(images)
    assert [g.size for g in got] == [w.size for w in want]
    assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want, strict=True))


def _png_with_exif(image: Image.Image, exif: Image.Exif):
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif)
    buffer.seek(0)
    return buffer


def recording(model) -> list[dict[str, torch.Tensor]]:
    """The tensors (input ids, mask, pixel values, image grid, ...) of each `generate` call of `model`, recorded."""
    seen: list[dict[str, torch.Tensor]] = []
    generate = model.generate

    def wrapped(**kwargs):
        seen.append({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        return generate(**kwargs)

    model.generate = wrapped
    return seen


def same_inputs(ours: list[dict[str, torch.Tensor]], theirs: list[dict[str, torch.Tensor]]) -> None:
    """One generate call each, with equal tensors. A text-only request goes through our tokenizer, which gives no
    `mm_token_type_ids` (the processor's all-zero marks of image tokens)."""
    (a,), (b,) = ours, theirs
    extra = b.keys() - a.keys()
    assert extra <= {"mm_token_type_ids"} and all(not b[k].any() for k in extra), sorted(b)
    assert a.keys() <= b.keys() and all(torch.equal(a[k], b[k]) for k in a), sorted(a)


def edit_images(count: int) -> list[Image.Image]:
    return [_img(70, 40, seed=11), _img(32, 64, "RGBA", seed=12)][:count]


@pytest.mark.parametrize(
    ("dtype", "count"),
    [(torch.float32, 1), (torch.float32, 2), pytest.param(torch.bfloat16, 2, marks=pytest.mark.slow)],
    ids=str,
)
def test_edit_caption_equals_diffusers(folder, dtype, count):
    """An edit request: the references prepared, in the chat before the request in the edit scaffold, through the
    processor's image path (here the PIL image processor: this machine has no torchvision)."""
    from diffusers.modular_pipelines.flux3.prompt_upsampler import prepare_references, upsample_prompt
    from transformers import Qwen3_5ForConditionalGeneration

    images = edit_images(count)
    ours = PromptUpsampler.from_pretrained(folder, dtype=dtype)
    ours.processor = image_processor(folder)
    seen = recording(ours.model)
    caption = ours.upsample("make it blue", prepare_upsampler_references(images))
    model = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype, local_files_only=True)
    seen_ref = recording(model)
    want = upsample_prompt(model, image_processor(folder), "make it blue", images=prepare_references(images))
    assert caption == want
    same_inputs(seen, seen_ref)
    assert seen[0]["image_grid_thw"].shape[0] == count and seen[0]["pixel_values"].dtype == torch.float32
    # the images matter (in bf16 this tiny model happens to write the same caption for one and two)
    if dtype == torch.float32 and count == 2:
        assert caption != ours.upsample("make it blue", prepare_upsampler_references(edit_images(3 - count)))


def _torchvision_usable() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a build that does not load against this torch
        return False
    return True


@pytest.mark.skipif(
    not _torchvision_usable(),
    reason="needs torchvision (AutoProcessor opens the upsampler's video processor, which needs it); the only "
    "torchvision 0.28.0 wheel at hand is a CUDA build that does not import against the CPU torch 2.13.0",
)
def test_edit_caption_through_autoprocessor_equals_diffusers(folder):
    """As diffusers loads it: `AutoProcessor` of the upsampler's folder (the torchvision image processor)."""
    from diffusers.modular_pipelines.flux3.prompt_upsampler import prepare_references, upsample_prompt
    from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration

    ours = PromptUpsampler.from_pretrained(folder, dtype=torch.float32)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    )
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    for count in (1, 2):
        images = edit_images(count)
        got = ours.upsample("make it blue", prepare_upsampler_references(images))
        assert got == upsample_prompt(model, processor, "make it blue", images=prepare_references(images))


def test_reference_sizes():
    assert upsampler_reference_size(1000, 1000, 1) == (992, 992)  # rounded to 32
    assert upsampler_reference_size(4000, 3000, 1) == (1152, 864)  # over 1 MP: scaled and floored
    assert (
        upsampler_reference_size(4000, 3000, 3)[0] * upsampler_reference_size(4000, 3000, 3)[1] <= 512 * 512
    )
    with pytest.raises(ValueError, match="aspect ratio over 200:1"):
        upsampler_reference_size(4010, 20, 1)
    with pytest.raises(ValueError, match="at most 10"):
        prepare_upsampler_references([_img(32, 32)] * 11)


def test_prompt_files_are_checked(tmp_path):
    path = tmp_path / "prompts.json"
    with pytest.raises(WeightsError, match=r"no prompt-upsampler system prompts at .*--upsampler-prompts"):
        UpsamplerPrompts.read(path)
    for content, match in [
        ("{", "not a readable JSON file"),
        ("[]", "expected a JSON object"),
        ('{"i2i": "x"}', "no 't2i' system prompt"),
        ('{"t2i": 3}', "'t2i' must be a non-empty string"),
        ('{"t2i": "a", "i2i_scaffold": "{request}"}', "must hold \\{instruction\\} and no other braces"),
        ('{"t2i": "a", "i2i_scaffold": "no slot"}', "has no \\{instruction\\} slot"),
    ]:
        path.write_text(content)
        with pytest.raises(WeightsError, match=match):
            UpsamplerPrompts.read(path)
    path.write_text(json.dumps({"t2i": "Write a caption.", "other": 1}))
    prompts = UpsamplerPrompts.read(path)
    prompts.check_mode("t2i")
    with pytest.raises(WeightsError, match=r"no 'i2i' and no 'i2i_scaffold'.*--no-upsample"):
        prompts.check_mode("i2i")
    with pytest.raises(WeightsError, match=r"no 't2i_bbox' and no 'layout_request': .*layout boxes"):
        prompts.check_mode("t2i_bbox")
    with pytest.raises(
        WeightsError, match=r"no 'i2i_bbox' and no 'i2i_bbox_scaffold' and no 'layout_request'"
    ):
        prompts.check_mode("i2i_bbox")
    for layout, match in [
        ("{prompt}", "has no \\{boxes\\} slot"),
        ("{boxes} {prompt} {x}", "must hold \\{prompt\\} and \\{boxes\\} and no other braces"),
    ]:
        path.write_text(json.dumps({"t2i": "a", "layout_request": layout}))
        with pytest.raises(WeightsError, match=match):
            UpsamplerPrompts.read(path)
    path.write_text(json.dumps({"t2i": "a", "i2i_bbox_scaffold": "no slot"}))
    with pytest.raises(WeightsError, match="'i2i_bbox_scaffold' has no \\{instruction\\} slot"):
        UpsamplerPrompts.read(path)


def test_own_prompts_reach_the_model(tmp_path, folder):
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps({"t2i": "Describe it.", "i2i": "Edit it.", "i2i_scaffold": "Do: {instruction}"})
    )
    ours = PromptUpsampler.from_pretrained(folder, prompts=path, dtype=torch.float32)
    image = _img(64, 64)
    messages = ours.messages("make it blue", [image])
    assert messages[0]["content"][0]["text"] == "Edit it."
    assert messages[1]["content"] == [
        {"type": "image", "image": image},
        {"type": "text", "text": "Do: make it blue"},
    ]
    other = ours.upsample("a red fox in the snow")
    default = PromptUpsampler.from_pretrained(folder, dtype=torch.float32).upsample("a red fox in the snow")
    assert other != default  # the system prompt is part of the input


@pytest.mark.gpu
def test_caption_on_cuda_equals_diffusers(folder):
    from diffusers.modular_pipelines.flux3.prompt_upsampler import upsample_prompt
    from transformers import Qwen3_5ForConditionalGeneration

    ours = PromptUpsampler.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).to("cuda")
    assert ours.upsample(REQUESTS[0]) == upsample_prompt(model, text_only_processor(folder), REQUESTS[0])


@pytest.mark.gpu
def test_edit_and_layout_captions_on_cuda_equal_diffusers(folder):
    from diffusers.modular_pipelines.flux3.prompt_upsampler import prepare_references, upsample_prompt
    from transformers import Qwen3_5ForConditionalGeneration

    ours = PromptUpsampler.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    ours.processor = image_processor(folder)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).to("cuda")
    boxes = [{"id": "hat_1", "from": "target", "tgt_bbox": [0.1, 0.3, 0.3, 0.7]}]
    for count, layout in ((1, None), (2, boxes)):
        images = edit_images(count)
        got = ours.upsample("make it blue", prepare_upsampler_references(images), boxes=layout)
        want = upsample_prompt(
            model, image_processor(folder), "make it blue", images=prepare_references(images), boxes=layout
        )
        assert got == want


def test_prompts_file_written_from_diffusers_gives_diffusers_texts(tmp_path):
    """scripts/upsampler_prompts.py writes a prompts file our reader takes, holding diffusers' texts exactly."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from diffusers.modular_pipelines.flux3 import prompt_upsampler as theirs

    from flux_runtime.text.flux3_upsampler import UpsamplerPrompts

    script = Path(__file__).resolve().parents[2] / "scripts" / "upsampler_prompts.py"
    out = tmp_path / "prompts.json"
    subprocess.run([sys.executable, str(script), str(out)], check=True, capture_output=True)
    p = UpsamplerPrompts.read(out)
    for mode in ("t2i", "i2i", "t2i_bbox", "i2i_bbox"):
        assert getattr(p, mode) == theirs.SYSTEM_PROMPTS[mode]
        p.check_mode(mode)
    assert p.i2i_scaffold == theirs.I2I_SCAFFOLD[False] and p.i2i_bbox_scaffold == theirs.I2I_SCAFFOLD[True]
    rows = [{"id": "cat", "bbox": [10, 20, 300, 400], "desc": "a {curly} cat"}]
    assert p.layout_request is not None
    got = p.layout_request.format(prompt=" a cat ".strip(), boxes=json.dumps(rows, ensure_ascii=False))
    assert got == theirs.format_layout_request(" a cat ", rows)
    again = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True)
    assert again.returncode == 1 and "--overwrite" in again.stderr  # never overwritten unasked
