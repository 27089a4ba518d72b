"""FLUX.2 pipeline parity: tiny random Flux2Pipeline / Flux2KleinPipeline folders saved by diffusers, opened with
our `Pipeline.from_pretrained`, give diffusers' latents (`torch.equal`) and pixels for the same call.

The folders hold a tiny FLUX.2 transformer, a 2x `AutoencoderKLFlux2` with random BatchNorm statistics and the
tiny Mistral3 / Qwen3 text encoders with the package tokenizers ([dev]'s through the genuine PixtralProcessor, see
tests/text/test_flux2_text.py's `pixtral` fixture). [klein] comes as a base model (`is_distilled: false`, CFG
when guidance > 1) and a step-distilled one (`is_distilled: true`, never CFG).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

from flux_runtime import load_transformer, load_vae
from flux_runtime.models.dit import TINY_FLUX2
from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.pipeline import flux2 as flux2_module
from flux_runtime.pipeline.flux2 import Flux2Pipe, image_fingerprint
from flux_runtime.pipeline.sources import MODEL_IDS, flux2_schedule_config
from flux_runtime.sampling import get_schedule
from flux_runtime.text import Flux2TextEncoder, KleinTextEncoder
from flux_runtime.text.tokenizers import TINY_TOKENIZERS
from flux_runtime.weights import WeightsError
from tests.flux2_fixtures import make_diffusers_flux2, save_bfl
from tests.sampling.flux2_helpers import FLUX2_SCHEDULER_CONFIG, random_image
from tests.text.test_flux2_text import pixtral  # noqa: F401  (fixture: PixtralProcessor without torchvision)
from tests.weights.vae_fixtures import make_diffusers_flux2_vae, save_bfl_flux2_vae

PROMPTS = ["a red fox in the snow", "An astronaut riding a horse on the Moon"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# non-square; the tiny VAE is 2x, so 32x48 px is a 16x24 latent, 8x12 = 96 tokens
KW = dict(height=32, width=48, max_sequence_length=48)
REFERENCE = {"dev": Flux2Pipeline, "klein": Flux2KleinPipeline, "klein-distilled": Flux2KleinPipeline}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, pixtral: type) -> dict[str, Path]:  # noqa: F811
    """diffusers' own save_pretrained of a tiny [dev], [klein] base and [klein] distilled pipeline."""
    root = tmp_path_factory.mktemp("flux2-pipelines")
    out = {}
    common = lambda: dict(  # noqa: E731
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=make_diffusers_flux2_vae(seed=2),
    )
    mistral = Flux2TextEncoder.tiny(seed=3)
    dev = Flux2Pipeline(
        text_encoder=mistral.model,
        tokenizer=pixtral.from_pretrained(TINY_TOKENIZERS / "mistral"),
        transformer=make_diffusers_flux2(guidance=True, seed=4),
        **common(),
    )
    qwen = KleinTextEncoder.tiny(seed=5)
    for name, distilled in (("klein", False), ("klein-distilled", True)):
        klein = Flux2KleinPipeline(
            text_encoder=qwen.model,
            tokenizer=qwen.tokenizer,
            transformer=make_diffusers_flux2(guidance=False, seed=6),
            is_distilled=distilled,
            **common(),
        )
        out[name] = root / f"FLUX.2-{name}-tiny"
        klein.save_pretrained(out[name])
    out["dev"] = root / "FLUX.2-dev-tiny"
    dev.save_pretrained(out["dev"])
    return out


def _diffusers(
    folders: dict[str, Path], flavour: str, dtype: torch.dtype
) -> Flux2Pipeline | Flux2KleinPipeline:
    pipe = REFERENCE[flavour].from_pretrained(folders[flavour], dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run_diffusers(pipe, prompt, *, seed: int, **kwargs) -> tuple[list, torch.Tensor]:
    """diffusers' PIL images and its final packed latents (taken from the step callback)."""
    final: list[torch.Tensor] = []

    def keep(_pipe, _i, _t, tensors):
        final[:] = [tensors["latents"]]
        return tensors

    images = pipe(
        prompt=prompt, generator=torch.Generator().manual_seed(seed), callback_on_step_end=keep, **kwargs
    ).images
    return images, final[0]


def _assert_same_images(got: list, want: list, size: tuple[int, int]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.size == w.size == size
        a = np.asarray(g)
        assert np.array_equal(a, np.asarray(w))
        assert len(np.unique(a)) > 10  # a real picture, not a constant


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(
    ("flavour", "guidance", "cfg"),
    [("dev", 4.0, False), ("klein", 4.0, True), ("klein", 1.0, False), ("klein-distilled", None, False)],
    ids=["dev", "klein-cfg", "klein-guidance-1", "klein-distilled"],
)
def test_two_prompts_equal_diffusers(folders, flavour: str, guidance: float | None, cfg: bool, dtype) -> None:
    ref = _diffusers(folders, flavour, dtype)
    ours = Pipeline.from_pretrained(folders[flavour], device="cpu", dtype=dtype)
    assert isinstance(ours, Flux2Pipe)
    assert ours.is_distilled == (flavour == "klein-distilled")  # from model_index.json
    steps = 3 if flavour == "dev" else 2
    # diffusers' default guidance_scale (4.0) where we pass None
    want_pil, want_latents = _run_diffusers(
        ref,
        PROMPTS,
        seed=42,
        num_inference_steps=steps,
        guidance_scale=4.0 if guidance is None else guidance,
        **KW,
    )
    got = ours(PROMPTS, seed=42, num_steps=steps, guidance=guidance, **KW)
    assert ours.uses_cfg(4.0 if guidance is None else guidance) == cfg
    assert got.latents.dtype == want_latents.dtype == dtype
    assert got.latents.shape == (2, 96, 128)
    assert torch.equal(got.latents, want_latents)
    _assert_same_images(got.images, want_pil, (48, 32))
    assert got.info["quality"] == "lossless" and got.info["seed"] == 42 and got.info["num_steps"] == steps
    assert got.info["guidance"] == (None if flavour == "klein-distilled" else guidance)
    assert got.info["reference_images"] == []


@pytest.mark.parametrize("flavour", ["dev", "klein"])
def test_reference_image_edit_equals_diffusers(folders, flavour: str) -> None:
    """One reference image, no size given: the output takes the reference's size (80x72), as diffusers does."""
    dtype = torch.bfloat16
    image = random_image(80, 72, seed=9)
    ref = _diffusers(folders, flavour, dtype)
    ours = Pipeline.from_pretrained(folders[flavour], device="cpu", dtype=dtype)
    want_pil, want_latents = _run_diffusers(
        ref,
        PROMPTS[0],
        seed=7,
        image=image,
        num_inference_steps=2,
        guidance_scale=4.0,
        max_sequence_length=48,
    )
    got = ours(PROMPTS[0], image=image, seed=7, num_steps=2, max_sequence_length=48)
    assert torch.equal(got.latents, want_latents)
    _assert_same_images(got.images, want_pil, (80, 72))
    assert (got.info["height"], got.info["width"]) == (72, 80)
    assert got.info["reference_images"] == [
        {"path": None, "width": 80, "height": 72, "sha256": image_fingerprint(image)}
    ]
    # the reference conditions the result
    plain = ours(PROMPTS[0], seed=7, num_steps=2, height=72, width=80, max_sequence_length=48)
    assert not torch.equal(plain.latents, got.latents)


@pytest.mark.parametrize("flavour", ["dev", "klein"])
def test_latent_output_is_what_diffusers_returns(folders, flavour: str) -> None:
    """output_type="latent": [dev] gives packed tokens, [klein] the BatchNorm-denormalised decoder input."""
    ref = _diffusers(folders, flavour, torch.float32)
    ours = Pipeline.from_pretrained(folders[flavour], device="cpu", dtype=torch.float32)
    want = ref(
        prompt=PROMPTS[0],
        generator=torch.Generator().manual_seed(3),
        num_inference_steps=2,
        output_type="latent",
        **KW,
    ).images
    got = ours(PROMPTS[0], seed=3, num_steps=2, output_type="latent", **KW)
    assert want.shape == ((1, 96, 128) if flavour == "dev" else (1, 32, 16, 24))
    assert torch.equal(got.images, want)
    assert got.latents.shape == (1, 96, 128)


def test_generators_images_per_prompt_and_embeds(folders) -> None:
    ref = _diffusers(folders, "klein", torch.float32)
    ours = Pipeline.from_pretrained(folders["klein"], device="cpu", dtype=torch.float32)
    assert isinstance(ours, Flux2Pipe)
    kw = dict(height=16, width=24, max_sequence_length=16)

    def gens():
        return [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]

    want = ref(
        prompt=PROMPTS[0],
        generator=gens(),
        num_images_per_prompt=2,
        num_inference_steps=2,
        output_type="np",
        **kw,
    )
    got = ours(PROMPTS[0], generator=gens(), num_images_per_prompt=2, num_steps=2, output_type="np", **kw)
    assert got.images.dtype == np.uint8 and got.images.shape == (2, 16, 24, 3)
    assert np.array_equal(got.images, (want.images * 255).round().astype("uint8"))
    # the embeddings passed in give the same result; the CFG negative is still encoded
    embeds, text_ids = ours.encode_prompt(PROMPTS[0], max_sequence_length=16)
    assert embeds.shape == (1, 16, TINY_FLUX2.context_in_dim) and text_ids.shape == (1, 16, 4)
    again = ours(
        prompt_embeds=embeds, generator=gens(), num_images_per_prompt=2, num_steps=2, output_type="np", **kw
    )
    assert np.array_equal(again.images, got.images)


class _AliasingGraphs:
    """A CPU stand-in for `GraphedDenoiser` with its one hazard: every call returns the same output buffer."""

    made = 0

    def __init__(self, fn) -> None:
        self.fn, self.out = fn, None
        _AliasingGraphs.made += 1

    def __call__(self, *xs):
        y = self.fn(*xs)
        if self.out is None:
            self.out = torch.empty_like(y)
        return self.out.copy_(y)


def test_graph_replays_keep_cfg_branches_apart(folders, monkeypatch) -> None:
    """With CUDA-graph-style static outputs, the conditional and unconditional predictions must not alias."""
    ours = Pipeline.from_pretrained(folders["klein"], device="cpu", dtype=torch.float32)
    image = random_image(64, 64, seed=1)
    eager = ours(PROMPTS, image=image, seed=5, num_steps=3, output_type="latent", **KW)
    assert eager.info["cuda_graphs"] is False
    monkeypatch.setattr(flux2_module, "GraphedDenoiser", _AliasingGraphs)
    monkeypatch.setattr(ours, "_graphs_enabled", lambda: True)
    graphed = ours(PROMPTS, image=image, seed=5, num_steps=3, output_type="latent", **KW)
    assert graphed.info["cuda_graphs"] is True
    assert torch.equal(graphed.latents, eager.latents)
    assert _AliasingGraphs.made == 2  # one per branch, cached: a second call makes none
    ours(PROMPTS, image=image, seed=5, num_steps=1, output_type="latent", **KW)
    assert _AliasingGraphs.made == 2


def test_distilled_klein_ignores_guidance_with_a_warning(folders) -> None:
    pipe = Pipeline.from_pretrained(folders["klein-distilled"], device="cpu", dtype=torch.float32)
    base = pipe("a cat", seed=1, num_steps=2, output_type="latent", **KW)
    with pytest.warns(UserWarning, match="step-distilled: guidance 5.0 is ignored") as said:
        other = pipe("a cat", seed=1, num_steps=2, guidance=5.0, output_type="latent", **KW)
    assert said[0].filename == __file__  # the warning points at the call, not into the pipeline or torch
    assert torch.equal(base.latents, other.latents) and other.info["guidance"] is None


def test_offloaded_text_encoder_moves_once_per_call(folders, monkeypatch) -> None:
    pipe = Pipeline.from_pretrained(
        folders["klein"], device="cpu", dtype=torch.float32, offload_text_encoders=True
    )
    # the memory plan (offload-text) moves it: in once, out once, for the positive and the negative prompts
    assert pipe.memory_plan.name == "offload-text"
    text, moves = pipe.placement.models["text"], []
    enter, leave = text.enter, text.leave
    monkeypatch.setattr(text, "enter", lambda: (moves.append("in"), enter())[1])
    monkeypatch.setattr(text, "leave", lambda: (moves.append("out"), leave())[1])
    out = pipe(PROMPTS, seed=1, num_steps=1, output_type="latent", **KW)  # CFG: positive and negative prompts
    assert moves == ["in", "out"] and not text.on_device
    ref = Pipeline.from_pretrained(folders["klein"], device="cpu", dtype=torch.float32)
    assert torch.equal(out.latents, ref(PROMPTS, seed=1, num_steps=1, output_type="latent", **KW).latents)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_klein_encodes_with_our_qwen3_and_transformers_would_give_the_same_bits(folders, dtype) -> None:
    """From the folder's safetensors and tokenizer.json the [klein] encoder is ours (Qwen3Encoder, FastTokenizer);
    transformers' Qwen3ForCausalLM and Qwen2TokenizerFast of the same folder, swapped in, change no bit of the
    latents or pixels (CFG: the negative prompt too)."""
    from transformers import Qwen3ForCausalLM

    from flux_runtime.text.chat import load_qwen3_tokenizer
    from flux_runtime.text.fast_tokenizers import FastTokenizer
    from flux_runtime.text.qwen3_encoder import Qwen3Encoder

    pipe = Pipeline.from_pretrained(folders["klein"], device="cpu", dtype=dtype)
    te = pipe.text_encoder
    assert isinstance(te.model, Qwen3Encoder) and isinstance(te.tokenizer, FastTokenizer)
    native = pipe(PROMPTS, seed=3, num_steps=2, guidance=4.0, **KW)
    model = Qwen3ForCausalLM.from_pretrained(folders["klein"] / "text_encoder", dtype=dtype)
    pipe.text_encoder = KleinTextEncoder(
        model, load_qwen3_tokenizer(folders["klein"] / "tokenizer", native=False)
    )
    pipe._prompts.clear()  # the cached embeddings are the native encoder's
    ref = pipe(PROMPTS, seed=3, num_steps=2, guidance=4.0, **KW)
    assert torch.equal(native.latents, ref.latents)
    _assert_same_images(native.images, ref.images, (48, 32))


@pytest.mark.parametrize("dynamic", [True, False])
def test_schedule_follows_the_folder_scheduler(dynamic: bool) -> None:
    """The pipelines pass the empirical mu; the scheduler uses it only with use_dynamic_shifting."""
    config = {**FLUX2_SCHEDULER_CONFIG, "use_dynamic_shifting": dynamic}
    for steps, tokens in ((4, 4096), (50, 96), (28, 6000)):
        scheduler = FlowMatchEulerDiscreteScheduler(**config)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
        want, _ = retrieve_timesteps(scheduler, steps, "cpu", sigmas=sigmas, mu=mu)
        got = get_schedule(steps, tokens, config=flux2_schedule_config(config))
        assert torch.equal(got.timesteps, want) and torch.equal(got.sigmas, scheduler.sigmas)
    with pytest.raises(WeightsError, match="use_flow_sigmas"):
        flux2_schedule_config({**config, "use_flow_sigmas": True})


# ---- the built-in model, dispatch and errors ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Flux2Pipe:
    pipe = Pipeline.from_pretrained("tiny-flux2-random", device="cpu", dtype=torch.float32)
    assert isinstance(pipe, Flux2Pipe)
    return pipe


def test_from_pretrained_dispatches_on_the_transformer(tiny: Flux2Pipe) -> None:
    assert type(Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)) is Pipeline
    assert not tiny.is_dev and not tiny.is_distilled and tiny.weights_id == "tiny-flux2-seed0"
    assert isinstance(tiny.text_encoder, KleinTextEncoder)
    assert tiny.text_encoder.output_dim == tiny.transformer.config.context_in_dim == TINY_FLUX2.context_in_dim
    assert (tiny.default_steps, tiny.default_size) == (50, 128)
    assert MODEL_IDS["flux2-klein-4b"] == "black-forest-labs/FLUX.2-klein-4B"


def test_tiny_builtin_is_deterministic(tiny: Flux2Pipe) -> None:
    a = tiny("a red fox", height=32, width=32, num_steps=2, seed=7, output_type="np").images
    b = tiny("a red fox", height=32, width=32, num_steps=2, seed=7, output_type="np").images
    c = tiny("a red fox", height=32, width=32, num_steps=2, seed=8, output_type="np").images
    assert a.dtype == np.uint8 and a.shape == (1, 32, 32, 3)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(height=30), "height 30 is not divisible by 4"),
        (dict(width=0), "width 0 must be a positive integer"),
        (dict(num_steps=0), "num_steps 0 must be an integer >= 1"),
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt=[]), "prompt must be a non-empty string"),
        (dict(max_sequence_length=513), "max_sequence_length 513 must be in 1..512"),
        (dict(seed=1, generator=torch.Generator()), "either seed or generator"),
        (dict(generator=[torch.Generator()], prompt=["a", "b"]), "one torch.Generator per image: 2, got 1"),
        (dict(output_type="jpeg"), "unknown output_type 'jpeg'"),
        (dict(guidance=-1.0), "guidance -1.0 must be a number >= 0"),
        (dict(quality="ultra"), "unknown quality 'ultra'"),
        (dict(image=[]), "image is an empty list"),
        (dict(image="cat.png"), "image must be a PIL image or a list of them, got str"),
        (dict(image=[random_image(64, 64), "cat.png"]), "reference image must be a PIL image, got str"),
        (dict(image=random_image(48, 80)), "reference image 48x80 is too small"),
        (dict(image=random_image(640, 64)), "reference image 640x64 has aspect ratio 10.0; the limit is 8"),
        (
            dict(prompt=None, prompt_embeds=torch.zeros(1, 8, 64)),
            r"prompt_embeds must be a float tensor \(B, L <= 512, 96\)",
        ),
        (dict(prompt_embeds=torch.zeros(1, 8, 96)), "either prompt or prompt_embeds"),
        (
            dict(prompt=None, prompt_embeds=torch.zeros(1, 8, 96, dtype=torch.bfloat16)),
            "prompt_embeds are torch.bfloat16; this pipeline runs torch.float32",
        ),
    ],
)
def test_inputs_are_validated_before_any_model_work(tiny: Flux2Pipe, kwargs, message, monkeypatch) -> None:
    def boom(*a, **k):
        raise AssertionError("a model ran before validation")

    for obj, name in ((tiny.text_encoder, "encode"), (tiny.transformer, "forward"), (tiny.vae, "encode")):
        monkeypatch.setattr(obj, name, boom)
    args = {"prompt": "a cat", "height": 32, "width": 32, **kwargs}
    with pytest.raises(FluxError, match=message):
        tiny(**args)


def test_parts_that_do_not_fit_are_refused(folders) -> None:
    with pytest.raises(FluxError, match=r"FLUX\.2 needs the FLUX\.2 VAE"):
        Pipeline.from_pretrained("tiny-flux2-random", vae="tiny", device="cpu", dtype=torch.float32)
    with pytest.raises(FluxError, match=r"FLUX\.2 has one text encoder"):
        Pipeline.from_pretrained(folders["dev"], text_encoder_2=folders["dev"], device="cpu")
    wide = load_transformer(
        "tiny-flux2-random", config=replace(TINY_FLUX2, context_in_dim=64), dtype=torch.float32
    )
    vae = load_vae("tiny-flux2-random", dtype=torch.float32)
    with pytest.raises(FluxError, match="gives 96-wide embeddings but the transformer reads 64"):
        Flux2Pipe(wide, vae, KleinTextEncoder.tiny(), schedule=flux2_schedule_config(None))
    # a [dev] folder's Mistral encoder in place of [klein]'s Qwen3: opened by its config.json, same width here
    mixed = Pipeline.from_pretrained(
        folders["klein"], text_encoder=folders["dev"], device="cpu", dtype=torch.float32
    )
    assert isinstance(mixed, Flux2Pipe) and isinstance(mixed.text_encoder, Flux2TextEncoder)


def test_bfl_file_set_equals_the_diffusers_folder(folders, tmp_path) -> None:
    """BFL `flux-2-klein.safetensors` + `ae.safetensors` beside it, the text encoder named separately."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    klein = folders["klein"]
    model = save_bfl(
        Flux2Transformer2DModel.from_pretrained(klein / "transformer"), tmp_path / "flux-2-klein.safetensors"
    )
    save_bfl_flux2_vae(AutoencoderKLFlux2.from_pretrained(klein / "vae"), tmp_path / "ae.safetensors")
    # Qwen3 as its own repo holds the model and the tokenizer in one folder
    qwen3 = shutil.copytree(klein / "text_encoder", tmp_path / "Qwen3-tiny")
    for f in (klein / "tokenizer").iterdir():
        shutil.copy(f, qwen3)
    folder = Pipeline.from_pretrained(klein, device="cpu", dtype=torch.float32)
    kw = dict(seed=4, num_steps=2, output_type="latent", **KW)
    want = folder(PROMPTS[0], **kw).latents
    for text_encoder in (qwen3, klein):  # a model folder, or a whole diffusers folder
        bfl = Pipeline.from_pretrained(model, text_encoder=text_encoder, device="cpu", dtype=torch.float32)
        assert isinstance(bfl, Flux2Pipe) and not bfl.is_distilled  # no model_index.json: diffusers' default
        assert torch.equal(bfl(PROMPTS[0], **kw).latents, want)
    # without text_encoder=, BFL's pairing by the text width: none is 96 wide
    with pytest.raises(FluxError, match=r"no known \[klein\] text encoder is 96 wide: pass text_encoder="):
        Pipeline.from_pretrained(model, device="cpu", dtype=torch.float32)


def test_unknown_model_id_is_one_clear_error(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(
        WeightsError, match=r"'black-forest-labs/FLUX\.2-klein-4B' is not in the local Hugging Face cache"
    ):
        Pipeline.from_pretrained("flux2-klein-4b", device="cpu", download=False)


def test_provenance_says_which_kernels_ran() -> None:
    pipe = Pipeline.from_pretrained("tiny-flux2-random", device="cpu", dtype=torch.float32, quality="high")
    out = pipe("a cat", height=16, width=16, num_steps=1, output_type="latent")
    assert out.info["quality"] == "lossless"  # high needs CUDA: said once, recorded here
    assert out.info["kernels"] == "off"  # the reference ops ran
    flux1 = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    same_keys = flux1("a cat", height=16, width=16, num_steps=1, output_type="latent").info.keys()
    assert out.info.keys() == same_keys | {"reference_images"}


@pytest.mark.gpu
@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_cuda_graph_replay_gives_the_eager_latents(quality: str) -> None:
    """CFG (two graphs per step) with a reference image: replays equal the eager run, call after call."""
    eager = Pipeline.from_pretrained(
        "tiny-flux2-random", device="cuda", dtype=torch.bfloat16, cuda_graphs=False, quality=quality
    )
    graphed = Pipeline.from_pretrained(
        "tiny-flux2-random", device="cuda", dtype=torch.bfloat16, quality=quality
    )
    kw = dict(
        image=random_image(64, 96, seed=2), height=64, width=96, num_steps=4, seed=3, output_type="latent"
    )
    a = eager(["a red fox", "a cat"], **kw)
    b = graphed(["a red fox", "a cat"], **kw)
    c = graphed(["a red fox", "a cat"], **kw)  # second call: pure replays
    assert b.info["cuda_graphs"] and torch.equal(a.latents, b.latents) and torch.equal(b.latents, c.latents)
    assert a.info["kernels"].startswith(quality)


def test_is_distilled_override_for_files_without_model_index(folders) -> None:
    # a BFL klein file carries no is_distilled flag: the caller states it, and it changes CFG as the folder flag does
    told = Pipeline.from_pretrained(folders["klein"], device="cpu", dtype=torch.float32, is_distilled=True)
    distilled = Pipeline.from_pretrained(folders["klein-distilled"], device="cpu", dtype=torch.float32)
    assert told.is_distilled and not told.uses_cfg(4.0)
    kw = dict(seed=2, num_steps=2, output_type="latent", **KW)
    with pytest.warns(UserWarning, match="step-distilled"):
        a = told("a cat", guidance=4.0, **kw)
    base = Pipeline.from_pretrained(folders["klein"], device="cpu", dtype=torch.float32)
    b = base("a cat", guidance=4.0, **kw)  # the base model runs CFG: another result
    assert not torch.equal(a.latents, b.latents) and distilled.is_distilled


def test_is_distilled_is_refused_for_flux1() -> None:
    with pytest.raises(FluxError, match=r"is_distilled is a FLUX\.2"):
        Pipeline.from_pretrained("tiny", device="cpu", is_distilled=True)
