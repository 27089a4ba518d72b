"""FLUX.1 Redux on our pipeline gives the bits of diffusers' FluxPriorReduxPipeline feeding FluxPipeline.

Tiny random SigLIP + Redux embedder written by diffusers / transformers in both real layouts (the diffusers
folder; BFL's single file beside a SigLIP folder). Two setups, because diffusers' prompt-free Redux fills
the text part with zeros of FLUX.1's real widths (512 x 4096, pooled 768): a tiny transformer reading those
widths with no text encoders (as diffusers' own example runs it), and the tiny dev folder (text width 32)
with its text encoders, where Redux encodes a prompt per image.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.pipeline import redux as redux_stage
from flux_runtime.pipeline.provenance import parse_provenance, png_bytes
from flux_runtime.pipeline.sources import schedule_config
from flux_runtime.weights import WeightsError, load_transformer, load_vae
from flux_runtime.weights.redux import find_redux
from tests.flux1_fixtures import make_diffusers_transformer
from tests.pipeline.test_flux1_pipeline import PROMPTS, _save_pipeline
from tests.redux_fixtures import IMAGE_TOKENS, save_bfl_redux, save_redux
from tests.weights.vae_fixtures import make_diffusers_vae

KW = dict(height=32, width=48)
NO_TEXT = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def _same(got, want_latents, want_images) -> None:
    assert torch.equal(got.latents, want_latents)
    for g, w in zip(got.images, want_images, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))


def _reference(base, prior_out, **kw):
    """FluxPipeline on the prior's output: (latents, PIL images) from the same seed."""
    run = dict(generator=None, num_inference_steps=3, **KW, **prior_out, **kw)
    lat = base(**{**run, "generator": torch.Generator().manual_seed(3)}, output_type="latent").images
    pil = base(**{**run, "generator": torch.Generator().manual_seed(3)}, output_type="pil").images
    return lat, pil


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """FLUX.1's real text widths (4096, pooled 768) on a tiny transformer with no text encoders, its Redux
    as the diffusers folder and as BFL's single file."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    root = tmp_path_factory.mktemp("redux-wide")
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )  # fmt: skip
    transformer = make_diffusers_transformer(True, joint_attention_dim=4096, pooled_projection_dim=768)
    FluxPipeline(
        scheduler=scheduler, vae=make_diffusers_vae(), transformer=transformer, **NO_TEXT
    ).save_pretrained(root / "base")
    folder = save_redux(root / "FLUX.1-Redux-dev", 4096)
    single = save_bfl_redux(root / "flux1-redux-dev.safetensors", 4096)
    return root / "base", folder, single


def _from_parts(base, dtype) -> Pipeline:
    """Our pipeline from the folder's transformer and VAE, without text encoders."""
    scheduler = json.loads((base / "scheduler" / "scheduler_config.json").read_text())
    return Pipeline(
        load_transformer(base / "transformer", device="cpu", dtype=dtype),
        load_vae(base / "vae", device="cpu", dtype=dtype),
        None,
        schedule=schedule_config(scheduler, True),
        model_name="redux-test",
    )


@pytest.mark.slow  # the embedder is 4096 x 12288 x 2 wide: the fixture and the first load take seconds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prompt_free_redux_equals_diffusers(wide, dtype):
    from diffusers import FluxPipeline, FluxPriorReduxPipeline

    base, folder, single = wide
    image = _image(40, 30, seed=1)
    prior = FluxPriorReduxPipeline.from_pretrained(folder, dtype=dtype)(image)
    want_lat, want_pil = _reference(FluxPipeline.from_pretrained(base, dtype=dtype, **NO_TEXT), prior)

    pipe = _from_parts(base, dtype)
    # BFL's single file, its SigLIP from the diffusers folder; then the folder alone
    for path, encoder in ((single, folder), (folder, None)):
        pipe.load_redux(path, encoder)
        txt, vec = redux_stage.conditioning(pipe, [image], None, 512, [1.0], [1.0])
        assert txt.shape == (1, 512 + IMAGE_TOKENS, 4096) and txt.dtype == dtype
        assert torch.equal(txt, prior.prompt_embeds) and torch.equal(vec, prior.pooled_prompt_embeds)
        got = pipe(image=image, seed=3, num_steps=3, **KW)
        _same(got, want_lat, want_pil)
    assert got.info["redux"]["path"] == str(folder) and got.info["redux"]["image_encoder"] is None


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    """The tiny dev folder (text width 32, its CLIP and T5) and a Redux for it."""
    root = tmp_path_factory.mktemp("redux-dev")
    return _save_pipeline(root / "FLUX.1-tiny", True), save_redux(root / "FLUX.1-Redux-tiny", 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_redux_with_prompts_and_scales_equals_diffusers(dev, dtype):
    """Two images, a prompt each, a scale each: the prior's weighted sum, then FluxPipeline on it."""
    from diffusers import FluxPipeline, FluxPriorReduxPipeline

    folder, redux = dev
    base = FluxPipeline.from_pretrained(folder, dtype=dtype)
    text = {k: getattr(base, k) for k in NO_TEXT}
    images = [_image(40, 30, seed=1), _image(20, 50, seed=2)]
    scales = dict(prompt_embeds_scale=[1.0, 0.7], pooled_prompt_embeds_scale=[0.5, 1.3])
    prior = FluxPriorReduxPipeline.from_pretrained(redux, dtype=dtype, **text)(
        images, prompt=PROMPTS, **scales
    )
    want_lat, want_pil = _reference(base, prior)

    ours = Pipeline.from_pretrained(folder, device="cpu", dtype=dtype, redux=redux)
    txt, vec = redux_stage.conditioning(ours, images, PROMPTS, 512, [1.0, 0.7], [0.5, 1.3])
    assert torch.equal(txt, prior.prompt_embeds) and torch.equal(vec, prior.pooled_prompt_embeds)
    got = ours(PROMPTS, image=images, seed=3, num_steps=3, **scales, **KW)
    _same(got, want_lat, want_pil)
    record = got.info["redux"]
    assert record["prompt_embeds_scale"] == [1.0, 0.7] and len(record["images"]) == 2
    assert parse_provenance(json.dumps(got.info), "test")["redux"] == record
    png_bytes(got.images[0], got.info)  # the writer's schema check accepts it


def test_one_prompt_serves_every_image_and_the_cache_answers(dev, monkeypatch):
    """One string prompt, one scale: as diffusers repeats them per image. A repeated call runs no encoder;
    several images per prompt repeat the one conditioning (diffusers, given the prior's batch-1 embeddings,
    broadcasts them instead: the same values, so it is compared here with them repeated)."""
    from diffusers import FluxPipeline, FluxPriorReduxPipeline

    folder, redux = dev
    base = FluxPipeline.from_pretrained(folder, dtype=torch.float32)
    images = [_image(33, 33, seed=4), _image(48, 16, seed=5)]
    prior = FluxPriorReduxPipeline.from_pretrained(redux, **{k: getattr(base, k) for k in NO_TEXT})(
        images, prompt=PROMPTS[1], prompt_embeds_scale=0.8, pooled_prompt_embeds_scale=1.5
    )
    repeated = dict(
        prompt_embeds=prior.prompt_embeds.repeat(2, 1, 1),
        pooled_prompt_embeds=prior.pooled_prompt_embeds.repeat(2, 1),
    )
    want = base(
        **repeated,
        generator=torch.Generator().manual_seed(3),
        num_inference_steps=2,
        output_type="latent",
        **KW,
    ).images
    ours = Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32, redux=redux)
    kw = dict(image=images, prompt_embeds_scale=0.8, pooled_prompt_embeds_scale=1.5, seed=3, num_steps=2)
    got = ours(PROMPTS[1], num_images_per_prompt=2, output_type="latent", **kw, **KW)
    assert torch.equal(got.images, want)

    def boom(*a, **k):
        raise AssertionError("the encoders ran for a cached Redux conditioning")

    monkeypatch.setattr(ours.redux.embedder, "forward", boom)
    monkeypatch.setattr(ours.text_encoder, "encode", boom)
    again = ours(PROMPTS[1], num_images_per_prompt=2, output_type="latent", **kw, **KW)
    assert torch.equal(again.images, want)
    assert again.info["redux"]["pooled_prompt_embeds_scale"] == [1.5, 1.5]


@pytest.mark.slow
def test_memory_plans_move_redux_with_the_text_encoders(dev):
    """Under an offload plan Redux lives off the device between text stages, and gives the same bits;
    `load_redux` on a placed pipeline plans again with it counted."""
    from flux_runtime.pipeline.memory import Plan
    from flux_runtime.pipeline.placement import apply_plan, footprint

    folder, redux = dev
    kw = dict(image=_image(40, 30, seed=1), seed=3, num_steps=2, output_type="latent", **KW)
    offload = Plan("offload-text", 1 << 40, text="offloaded")
    planned = Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32, redux=redux)
    want = planned(**kw).latents  # no plan: everything on the device
    apply_plan(planned, offload, torch.device("cpu"))
    assert torch.equal(planned(**kw).latents, want)
    assert planned.planned_tokens(None)[0] == 512 + IMAGE_TOKENS

    plain = Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32)
    without = footprint(plain).text.total
    apply_plan(plain, offload, torch.device("cpu"))
    plain.load_redux(redux)  # after the plan: made again, Redux among the text stage's models
    assert footprint(plain).text.total > without
    text = plain.placement.models["text"]
    assert plain.redux.embedder in text.roots and plain.redux.image_encoder.model in text.roots
    assert text.mode == "offloaded" and text.units  # the encoders packed again, with Redux among them
    assert torch.equal(plain(**kw).latents, want)


# ------------------------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tiny_redux(tmp_path_factory):
    """The built-in tiny FLUX.1 (text width 32) with a Redux attached."""
    redux = save_redux(tmp_path_factory.mktemp("redux-tiny") / "redux", 32)
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    pipe.load_redux(redux)
    return pipe


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(strength=0.5), "image= is the Redux image, not an image to redraw: drop strength"),
        (dict(mask_image=_image(32, 32, 0)), "drop mask_image"),
        (
            dict(negative_prompt="blurry", true_cfg_scale=2.0),
            "negative_prompt .true CFG. does not run with Redux",
        ),
        (dict(prompt_embeds_scale=[1.0, 2.0]), "prompt_embeds_scale has 2 values for 1 Redux images"),
        (dict(pooled_prompt_embeds_scale=float("nan")), "must be a finite number"),
        (dict(prompt=["a", "b"]), "got 2 prompts for 1 Redux images"),
        (dict(image=[]), "give a PIL image or a list of them"),
        (dict(image=[_image(32, 32, 0), "cat.png"]), "image 1"),
        (dict(prompt_embeds=torch.zeros(1, 4, 32)), "Redux makes the prompt embeddings itself"),
    ],
)
def test_redux_inputs_are_checked_before_any_model_work(tiny_redux, kwargs, message, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a model ran before validation")

    for obj, name in ((tiny_redux.redux.embedder, "forward"), (tiny_redux.transformer, "forward")):
        monkeypatch.setattr(obj, name, boom)
    with pytest.raises(FluxError, match=message):
        tiny_redux(**{"image": _image(32, 32, 0), "height": 32, "width": 32, **kwargs})


def test_scales_need_a_redux_and_an_image(tiny_redux, monkeypatch):
    with pytest.raises(FluxError, match="pooled_prompt_embeds_scale needs an image"):
        tiny_redux("a cat", pooled_prompt_embeds_scale=0.5)
    monkeypatch.setattr(tiny_redux, "redux", None)
    with pytest.raises(FluxError, match="prompt_embeds_scale needs a Redux pipeline"):
        tiny_redux("a cat", prompt_embeds_scale=0.5)


def test_kontext_and_fill_refuse_redux(tiny_redux, monkeypatch):
    for variant in ("kontext", "fill"):
        monkeypatch.setattr(tiny_redux, "variant", variant)
        with pytest.raises(
            FluxError, match=f"is a {variant.capitalize()} checkpoint, which reads image= itself"
        ):
            tiny_redux(image=_image(32, 32, 0))


def test_bad_redux_files_are_one_line_errors(dev, tmp_path):
    from safetensors.torch import save_file

    folder, redux = dev
    single = save_bfl_redux(tmp_path / "flux1-redux-dev.safetensors", 32)
    with pytest.raises(WeightsError, match="neither an existing file or folder"):
        find_redux(tmp_path / "missing.safetensors")
    with pytest.raises(WeightsError, match="Redux files are not fetched"):
        find_redux("nobody/no-such-redux")
    with pytest.raises(WeightsError, match="BFL's Redux embedder alone: name its SigLIP image encoder"):
        find_redux(single)
    with pytest.raises(WeightsError, match="is a FLUX transformer checkpoint, not a Redux embedder"):
        find_redux(folder / "transformer" / "diffusion_pytorch_model.safetensors", redux)
    save_file({"redux_up.weight": torch.zeros(6, 4)}, str(tmp_path / "half.safetensors"))
    with pytest.raises(WeightsError, match="is not a Redux embedder: it should hold exactly"):
        find_redux(tmp_path / "half.safetensors", redux)
    with pytest.raises(WeightsError, match="is not a Redux folder: it has no image_embedder/"):
        find_redux(folder)
    with pytest.raises(WeightsError, match=r"has no preprocessor_config\.json"):
        find_redux(single, redux / "image_encoder")
    with pytest.raises(FluxError, match="redux_image_encoder is the SigLIP of a Redux: give redux= too"):
        Pipeline.from_pretrained(folder, device="cpu", redux_image_encoder=redux)
    with pytest.raises(FluxError, match="Redux runs on one GPU for now"):
        Pipeline.from_pretrained(folder, device="cpu", redux=redux, parallel=2)


def test_redux_needs_a_flux1_model_of_its_width(tiny_redux, tmp_path):
    redux = tiny_redux.redux.files.source
    with pytest.raises(FluxError, match=r"Redux conditions FLUX\.1 models; tiny-flux2 is FLUX\.2"):
        Pipeline.from_pretrained("tiny-flux2", device="cpu", redux=redux)
    wide = save_redux(tmp_path / "wide", 64)
    with pytest.raises(
        FluxError, match="gives tokens of width 64, but tiny's transformer reads text of width 32"
    ):
        tiny_redux.load_redux(wide)
    assert tiny_redux.redux.files.source == redux  # the one attached stays


def test_the_record_names_local_files_absolutely(dev, monkeypatch):
    """A relative path is recorded absolute, so a replay from another folder finds the same files."""
    _, redux = dev
    monkeypatch.chdir(redux.parent)
    files = find_redux(redux.name, redux.name)
    assert files.source == files.encoder_source == str(redux)
    assert files.weights_id() == find_redux(redux).weights_id()


def test_a_whole_siglip_folder_gives_its_vision_tower(dev, tmp_path):
    """BFL's file beside google/siglip-so400m-patch14-384's layout (vision + text, processor config beside):
    the same states as the diffusers folder's image_encoder/ holding the same vision weights."""
    from flux_runtime.text.siglip import SiglipImageEncoder
    from tests.redux_fixtures import save_whole_siglip

    _, redux = dev
    whole = save_whole_siglip(tmp_path / "siglip-so400m-patch14-384")
    files = find_redux(save_bfl_redux(tmp_path / "flux1-redux-dev.safetensors", 32), whole)
    assert files.image_encoder == files.feature_extractor == whole
    images = [_image(40, 30, seed=1), _image(16, 64, seed=2)]
    states = [
        SiglipImageEncoder.from_folders(
            f.image_encoder, f.feature_extractor, device="cpu", dtype=torch.float32
        ).encode(images, torch.device("cpu"))
        for f in (files, find_redux(redux))
    ]
    assert states[0].shape == (2, IMAGE_TOKENS, 16) and torch.equal(states[0], states[1])
