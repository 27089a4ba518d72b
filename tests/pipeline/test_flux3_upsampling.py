"""FLUX.3 with the prompt upsampler: the image of diffusers' modular pipeline *with* its upsampler step (a tiny
random Qwen3.5; text to image, edits with one and two references, layout boxes), the caption, mode and boxes in the
provenance, a replay from the caption without the upsampler, the defaults (a folder's prompt_upsampler/, the
registry's id, none for the tiny model) and one-line refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image

from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.pipeline.flux3 import Flux3Pipe
from flux_runtime.registry import FLUX3_UPSAMPLER_ID, spec_for
from flux_runtime.sampling import flux2_unpack
from flux_runtime.text.flux3 import Flux3TextEncoder
from flux_runtime.text.flux3_boxes import box_record
from tests.flux3_upsampler_fixtures import image_processor, make_tiny_upsampler, text_only_processor
from tests.pipeline.test_flux3_pipeline import KW, PROMPT, STEPS, _same_images, folders  # noqa: F401
from tests.pipeline.test_flux3_reference_images import ONE, TWO
from tests.text.test_flux3_boxes import T2I_BOXES, TWO_REF_BOXES
from tests.text.test_flux3_text import text_only_processor as text_encoder_processor


@pytest.fixture(scope="module")
def upsampler(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_upsampler(tmp_path_factory.mktemp("pup"), seed=6)


def _diffusers_with_upsampler(folder, upsampler, dtype, processor=None):
    """diffusers' distilled FLUX.3 blocks, the prompt upsampler step kept, on the folder's parts (the upsampler's
    processor: `processor`, else a text-only one)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux3Transformer2DModel
    from diffusers.modular_pipelines.flux3 import Flux3DistilledAutoBlocks
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3VLForConditionalGeneration

    pipe = Flux3DistilledAutoBlocks().init_pipeline()
    text = Flux3TextEncoder.from_pretrained(folder, dtype=dtype)
    pipe.update_components(
        prompt_upsampler=Qwen3_5ForConditionalGeneration.from_pretrained(upsampler, dtype=dtype),
        prompt_upsampler_processor=processor or text_only_processor(upsampler),
        transformer=Flux3Transformer2DModel.from_pretrained(folder / "transformer", torch_dtype=dtype),
        vae=AutoencoderKLFlux2.from_pretrained(folder / "vae", torch_dtype=dtype),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(folder / "text_encoder", dtype=dtype),
        tokenizer=text_encoder_processor(text),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler"),
        image_processor=Flux3ImageProcessor(vae_scale_factor=4),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=str
)
def test_upsampled_image_equals_diffusers_and_replays_from_the_caption(folders, upsampler, dtype):  # noqa: F811
    ref = _diffusers_with_upsampler(folders["flow-map"], upsampler, dtype)
    state = ref(prompt=PROMPT, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(7), **KW)
    ours = Pipeline.from_pretrained(folders["flow-map"], device="cpu", dtype=dtype)
    assert isinstance(ours, Flux3Pipe) and ours.prompt_upsampler.source is None  # a plain folder has none
    ours.set_prompt_upsampler(upsampler)
    out = ours(PROMPT, num_steps=STEPS, seed=7, **KW)
    assert torch.equal(flux2_unpack(out.latents, 16, 24), state.get("latents"))
    _same_images(out.images, state.get("images"))
    info = out.info
    assert info["prompt"] == PROMPT and info["upsample"] == "on"
    assert info["upsampled_prompt"] == state.get("prompt") != PROMPT
    assert (
        info["prompt_upsampler"]["model"] == str(upsampler) and len(info["prompt_upsampler"]["weights"]) == 16
    )

    # a replay encodes the recorded caption; the upsampler is not even looked for
    ours.set_prompt_upsampler("/nonexistent/upsampler")
    again = ours(PROMPT, num_steps=STEPS, seed=7, upsampled_prompt=info["upsampled_prompt"], **KW)
    assert torch.equal(again.latents, out.latents) and again.info["upsample"] == "given"
    assert again.info["upsampled_prompt"] == info["upsampled_prompt"] and "prompt_upsampler" not in again.info
    plain = ours(PROMPT, num_steps=STEPS, seed=7, upsample=False, **KW)
    assert plain.info["upsample"] == "off" and "upsampled_prompt" not in plain.info
    assert not torch.equal(plain.latents, out.latents)


@pytest.mark.parametrize(
    ("mode", "refs", "boxes"),
    [
        ("t2i_bbox", None, T2I_BOXES),
        ("i2i", ONE, None),
        pytest.param("i2i_bbox", TWO, TWO_REF_BOXES, marks=pytest.mark.slow),
    ],
    ids=["t2i_bbox", "i2i-one", "i2i_bbox-two"],
)
def test_edits_and_layouts_equal_diffusers_and_replay(folders, upsampler, mode, refs, boxes):  # noqa: F811
    """The upsampler with references (the processor's image path: a PIL image processor, no torchvision here) and
    with layout boxes, in diffusers' pipeline and ours: the same caption, latents and pixels."""
    processor = image_processor(upsampler)
    ref = _diffusers_with_upsampler(folders["flow-map"], upsampler, torch.float32, processor)
    image = None if refs is None else refs if len(refs) > 1 else refs[0]
    kw = KW if refs is None else {}
    given = {} if boxes is None else {"boxes": boxes}
    state = ref(
        prompt=PROMPT, image=image, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(7),
        **given, **kw,
    )  # fmt: skip
    ours = Pipeline.from_pretrained(folders["flow-map"], device="cpu", dtype=torch.float32)
    ours.set_prompt_upsampler(upsampler)
    ours.prompt_upsampler.processor = processor
    out = ours(PROMPT, image=image, num_steps=STEPS, seed=7, boxes=boxes, **kw)
    want = state.get("latents")
    assert torch.equal(flux2_unpack(out.latents, 2 * want.shape[-2], 2 * want.shape[-1]), want)
    _same_images(out.images, state.get("images"))
    info = out.info
    assert info["upsample"] == "on" and info["upsampled_prompt"] == state.get("prompt") != PROMPT
    assert info["prompt_upsampler"]["mode"] == mode
    assert info["prompt_upsampler"]["system_prompt"] == ours.prompt_upsampler.loaded.prompts.fingerprint(mode)
    if boxes is None:
        assert "boxes" not in info
    else:
        assert info["boxes"] == box_record(boxes) and json.loads(json.dumps(info["boxes"])) == info["boxes"]
        assert info["upsampled_prompt"].endswith("]") and f"<{boxes[0]['id']}>" not in PROMPT

    ours.set_prompt_upsampler("/nonexistent/upsampler")  # a replay never looks for it
    again = ours(
        PROMPT, image=image, num_steps=STEPS, seed=7, upsampled_prompt=info["upsampled_prompt"], **kw
    )
    assert torch.equal(again.latents, out.latents) and again.info["upsample"] == "given"


def test_box_refusals_are_one_line_and_early(upsampler, tmp_path):
    pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    box = [{"id": "cup_1", "bbox": [0.1, 0.1, 0.5, 0.5]}]
    with pytest.raises(FluxError, match=r"has no prompt upsampler \(layout boxes need one\).*without boxes"):
        pipe(PROMPT, boxes=box)
    pipe.set_prompt_upsampler(upsampler)
    for kwargs, match in [
        (dict(boxes=box, upsample=False), "layout input: drop upsample=False / --no-upsample, or the boxes"),
        (dict(boxes=box, upsampled_prompt="x"), "upsampled_prompt replaces its run .*drop boxes"),
        (
            dict(boxes=[{"bbox": [0.1, 0.1, 0.5, 2]}]),
            r"boxes: box 0: bbox \[0.1, 0.1, 0.5, 2\] must be fractions",
        ),
        (
            dict(boxes=[{"from": "ref_image_1", "src_bbox": [0, 0, 1, 1]}], image=ONE[0]),
            "boxes: box 0: 'from' is ref_image_1 but 1 reference image was given",
        ),
        (dict(boxes=[{"from": "ref_image_0", "src_bbox": [0, 0, 1, 1]}]), "no reference images were given"),
    ]:
        with pytest.raises(FluxError, match=match) as e:
            pipe(PROMPT, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(FluxError, match="it cannot run on prompt_embeds"):
        pipe(prompt_embeds=torch.zeros(1, 80, 256), boxes=box)
    prompts = tmp_path / "t2i-only.json"
    prompts.write_text(json.dumps({"t2i": "Describe it."}))
    pipe.set_prompt_upsampler(upsampler, prompts=prompts)
    with pytest.raises(FluxError, match=r"no 't2i_bbox' and no 'layout_request'.*--no-upsample"):
        pipe(PROMPT, boxes=box)
    assert pipe.prompt_upsampler.loaded is None  # nothing was loaded by the refused calls


def test_defaults_follow_the_model(folders, upsampler, tmp_path):  # noqa: F811
    assert spec_for("flux3-klein").upsampler == spec_for("flux3-klein-base").upsampler == FLUX3_UPSAMPLER_ID
    assert spec_for("tiny-flux3-random").upsampler is None
    tiny = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    out = tiny(PROMPT, num_steps=1, height=32, width=32, output_type="np")
    assert out.info["upsample"] == "unavailable" and "upsampled_prompt" not in out.info
    with pytest.raises(FluxError, match=r"tiny-flux3-random has no prompt upsampler.*upsample=False"):
        tiny(PROMPT, upsample=True)
    # a folder with prompt_upsampler/ upsamples by default
    folder = tmp_path / "with-upsampler"
    shutil.copytree(folders["flow-map"], folder)
    shutil.copytree(upsampler, folder / "prompt_upsampler")
    pipe = Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32)
    assert pipe.prompt_upsampler.source == folder / "prompt_upsampler"
    assert pipe(PROMPT, num_steps=1, output_type="latent", **KW).info["upsample"] == "on"


def test_refusals_are_one_line_and_early(folders, upsampler, tmp_path):  # noqa: F811
    pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    pipe.set_prompt_upsampler(FLUX3_UPSAMPLER_ID)  # the real one: not in this machine's cache
    with pytest.raises(FluxError) as e:
        pipe(PROMPT)
    msg = str(e.value)
    assert "\n" not in msg and "nor in the local Hugging Face cache" in msg
    assert FLUX3_UPSAMPLER_ID in msg and "--download-only" in msg and "--no-upsample" in msg
    pipe.set_prompt_upsampler(upsampler, prompts=tmp_path / "missing.json")
    with pytest.raises(FluxError, match=r"no prompt-upsampler system prompts at .*missing.json"):
        pipe(PROMPT)
    pipe.set_prompt_upsampler(upsampler)
    with pytest.raises(FluxError, match="upsampled_prompt replaces the upsampler's run"):
        pipe(PROMPT, upsample=True, upsampled_prompt="x")
    with pytest.raises(FluxError, match="cannot run on prompt_embeds"):
        pipe(prompt_embeds=torch.zeros(1, 80, 256), upsample=True)
    # an edit request needs the full processor; without torchvision it fails before any model runs
    image = Image.new("RGB", (40, 28), (10, 200, 30))
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(FluxError, match=r"processor.*torchvision.*--no-upsample"):
            pipe(PROMPT, image=image)
    assert pipe.prompt_upsampler.loaded is None  # nothing was loaded by the refused calls
