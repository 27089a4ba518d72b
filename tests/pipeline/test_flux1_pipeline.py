"""Pipeline parity: our Pipeline on a tiny random FluxPipeline folder saved by diffusers gives its bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.text import Flux1TextEncoder
from tests.flux1_fixtures import make_diffusers_transformer
from tests.weights.vae_fixtures import make_diffusers_vae

PROMPTS = ["a red fox in the snow", "An astronaut riding a horse on the Moon"]


def _save_pipeline(folder, guidance: bool, **vae: object):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    text = Flux1TextEncoder.tiny(seed=3)
    if guidance:
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=make_diffusers_vae(**vae),
        text_encoder=text.clip,
        tokenizer=text.clip_tokenizer,
        text_encoder_2=text.t5,
        tokenizer_2=text.t5_tokenizer,
        transformer=make_diffusers_transformer(guidance),
    )
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["dev", "schnell"])
def folder(request, tmp_path_factory):
    return _save_pipeline(tmp_path_factory.mktemp("pipe") / "FLUX.1-tiny", request.param), request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pipeline_equals_diffusers(folder, dtype):
    from diffusers import FluxPipeline

    path, guidance = folder
    ref = FluxPipeline.from_pretrained(path, dtype=dtype)
    ours = Pipeline.from_pretrained(path, device="cpu", dtype=dtype)
    kw = dict(height=32, width=48, max_sequence_length=64)
    steps = 3 if guidance else 2
    ref_kw = dict(num_inference_steps=steps, guidance_scale=3.5 if guidance else 0.0, **kw)

    want_latents = ref(
        PROMPTS, generator=torch.Generator().manual_seed(42), output_type="latent", **ref_kw
    ).images
    want_images = ref(
        PROMPTS, generator=torch.Generator().manual_seed(42), output_type="pil", **ref_kw
    ).images

    got = ours(PROMPTS, seed=42, num_steps=steps, guidance=3.5 if guidance else None, **kw)
    assert got.latents.dtype == want_latents.dtype == dtype
    assert torch.equal(got.latents, want_latents)
    assert len(got.images) == 2
    for g, w in zip(got.images, want_images, strict=True):
        assert g.size == w.size == (48, 32)
        assert np.array_equal(np.asarray(g), np.asarray(w))
    assert got.info["quality"] == "lossless" and got.info["seed"] == 42


def test_generator_num_images_and_embeds(folder):
    from diffusers import FluxPipeline

    path, guidance = folder
    if not guidance:
        pytest.skip("dev covers it")
    ref = FluxPipeline.from_pretrained(path, dtype=torch.float32)
    ours = Pipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    kw = dict(height=32, width=32, max_sequence_length=16)
    want = ref(
        PROMPTS[0],
        generator=torch.Generator().manual_seed(1),
        num_images_per_prompt=2,
        num_inference_steps=2,
        output_type="latent",
        **kw,
    ).images
    got = ours(
        PROMPTS[0],
        generator=torch.Generator().manual_seed(1),
        num_images_per_prompt=2,
        num_steps=2,
        output_type="latent",
        **kw,
    )
    assert torch.equal(got.images, want)
    # embeddings passed in directly give the same latents
    embeds, pooled, _ = ours.encode_prompt(PROMPTS[0], max_sequence_length=16)
    again = ours(
        prompt_embeds=embeds,
        pooled_prompt_embeds=pooled,
        generator=torch.Generator().manual_seed(1),
        num_images_per_prompt=2,
        num_steps=2,
        output_type="latent",
        **kw,
    )
    assert torch.equal(again.latents, want)


def test_schnell_warns_that_guidance_is_ignored(folder):
    path, guidance = folder
    if guidance:
        pytest.skip("schnell only")
    pipe = Pipeline.from_pretrained(path, device="cpu", dtype=torch.float32)
    with pytest.warns(UserWarning, match="guidance 5.0 is ignored"):
        pipe(
            "a cat",
            height=16,
            width=16,
            num_steps=1,
            guidance=5.0,
            max_sequence_length=8,
            output_type="latent",
        )


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
        (dict(output_type="jpeg"), "unknown output_type 'jpeg'"),
        (dict(guidance=-1.0), "guidance -1.0 must be a number >= 0"),
        (dict(quality="ultra"), "unknown quality 'ultra'"),
    ],
)
def test_inputs_are_validated_before_any_model_work(kwargs, message, monkeypatch):
    pipe = Pipeline.from_pretrained("tiny-random", device="cpu", dtype=torch.float32)

    def boom(*a, **k):
        raise AssertionError("a model ran before validation")

    monkeypatch.setattr(pipe.text_encoder, "encode", boom)
    monkeypatch.setattr(pipe.transformer, "forward", boom)
    args = {"prompt": "a cat", "height": 32, "width": 32, **kwargs}
    with pytest.raises(FluxError, match=message):
        pipe(**args)


def test_tiny_builtin_is_deterministic():
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    a = pipe("a red fox", height=32, width=32, num_steps=2, seed=7, output_type="np").images
    b = pipe("a red fox", height=32, width=32, num_steps=2, seed=7, output_type="np").images
    c = pipe("a red fox", height=32, width=32, num_steps=2, seed=8, output_type="np").images
    assert a.dtype == np.uint8 and a.shape == (1, 32, 32, 3)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_unknown_model_id_is_one_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    from flux_runtime.weights import WeightsError

    with pytest.raises(
        WeightsError, match=r"'black-forest-labs/FLUX\.1-dev' is not in the local Hugging Face cache"
    ):
        Pipeline.from_pretrained("flux1-dev", device="cpu", download=False)


def test_provenance_says_which_kernels_ran():
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32, quality="high")
    out = pipe("a cat", height=16, width=16, num_steps=1, output_type="latent")
    assert out.info["quality"] == "lossless"  # high needs CUDA: said once, recorded here
    assert out.info["kernels"] == "off"  # the reference ops ran


@pytest.mark.gpu
@pytest.mark.parametrize("quality", ["lossless", "high"])
def test_cuda_graph_replay_gives_the_eager_latents(quality):
    eager = Pipeline.from_pretrained(
        "tiny", device="cuda", dtype=torch.bfloat16, cuda_graphs=False, quality=quality
    )
    graphed = Pipeline.from_pretrained("tiny", device="cuda", dtype=torch.bfloat16, quality=quality)
    kw = dict(height=64, width=96, num_steps=4, seed=3, output_type="latent")
    a = eager(["a red fox", "a cat"], **kw)
    b = graphed(["a red fox", "a cat"], **kw)
    c = graphed(["a red fox", "a cat"], **kw)  # second call: pure replays
    assert b.info["cuda_graphs"] and torch.equal(a.latents, b.latents) and torch.equal(b.latents, c.latents)
    assert a.info["kernels"].startswith(
        quality
    )  # the dispatch tier that ran (high mounts the lossless kernels)
    assert c.info["kernels"] == b.info["kernels"]  # pure replays still say which kernels the graph holds


@pytest.mark.gpu
def test_high_tier_images_stay_within_35_db_of_lossless():
    lossless = Pipeline.from_pretrained("tiny", device="cuda", dtype=torch.bfloat16, quality="lossless")
    high = Pipeline.from_pretrained("tiny", device="cuda", dtype=torch.bfloat16, quality="high")
    kw = dict(height=128, width=128, num_steps=8, seed=11, output_type="np")
    a = lossless(["a red fox", "a lighthouse at night"], **kw).images.astype(np.float64)
    b = high(["a red fox", "a lighthouse at night"], **kw)
    mse = ((a - b.images.astype(np.float64)) ** 2).mean()
    psnr = 10 * np.log10(255**2 / mse) if mse else float("inf")
    assert psnr >= 35.0, f"PSNR {psnr:.1f} dB"
    assert b.info["decode_kernels"] == "high"  # the fused GroupNorm + SiLU decoded it


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny", "tiny-flux2"])
def test_high_tier_decode_stays_within_40_db_of_the_lossless_decode(model):
    """The trained autoencoders decode the same latents in both tiers: the fused GroupNorm + SiLU only."""
    from flux_runtime import load_vae
    from flux_runtime.kernels import use_fused

    vae = load_vae(model, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(
        2, vae.config.z_channels, 32, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    z = z.to(torch.bfloat16)
    a = vae.decode(z)
    with use_fused("high"):
        b = vae.decode(z)
    assert not torch.equal(a, b)
    a, b = ((t.float().clamp(-1, 1) + 1) / 2 for t in (a, b))
    psnr = 10 * torch.log10(1 / (a - b).pow(2).mean()).item()
    assert psnr >= 40.0, f"PSNR {psnr:.1f} dB"


def test_vae_tile_decodes_in_tiles_and_is_checked_first(monkeypatch):
    pipe = Pipeline.from_pretrained("tiny-random", device="cpu", dtype=torch.float32)
    kw = dict(height=64, width=96, num_steps=1, seed=4, output_type="pt")
    whole = pipe("a cat", **kw).images
    pipe.vae_tile = 16  # latent pixels: the 32x48 latent is decoded in overlapping tiles
    tiled = pipe("a cat", **kw).images
    assert tiled.shape == whole.shape and not torch.equal(tiled, whole)
    assert (tiled - whole).abs().max() < 0.5  # blended seams, same picture
    pipe.vae_tile = 10
    monkeypatch.setattr(pipe.transformer, "forward", lambda *a, **k: pytest.fail("model ran"))
    with pytest.raises(FluxError, match="vae_tile 10 must be None or a positive multiple of 4"):
        pipe("a cat", **kw)


def test_high_tier_modulation_table_matches_each_steps_projection():
    # the batched table (high tier, CUDA) must hold, row by row, what each step would project live
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    from flux_runtime.sampling import FLUX1_DEV_SCHEDULE, get_schedule

    sched = get_schedule(5, 64, config=FLUX1_DEV_SCHEDULE)
    pooled = torch.randn(2, 32)
    g = torch.full([1], 3.5).expand(2)
    table = pipe._modulation_table(sched.timesteps, pooled, g, 2, torch.float32)
    model = pipe.transformer
    assert table.shape[:2] == (5, 2)
    for i, t in enumerate(sched.timesteps):
        live = model.modulation_table(model.conditioning(t.expand(2).to(torch.float32) / 1000, pooled, g))
        torch.testing.assert_close(table[i], live, rtol=1e-5, atol=1e-6)
