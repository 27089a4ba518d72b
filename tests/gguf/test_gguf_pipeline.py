"""A GGUF transformer file as a pipeline's model: latents bit-identical to diffusers' FluxPipeline with its
GGUF transformer, the precision recorded."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.pipeline import Pipeline
from tests.gguf_fixtures import diffusers_gguf_transformer, text_encoder_folders, write_flux1_pair
from tests.pipeline.test_flux1_pipeline import _save_pipeline

pytest.importorskip("diffusers")


@pytest.fixture(scope="module", params=[True, False], ids=["dev", "schnell"])
def gguf_pipeline(request, tmp_path_factory):
    """A tiny FluxPipeline folder, its transformer as GGUF files (BFL and diffusers names, Q8_0), and CLIP and
    T5 folders (each model with its tokenizer) for the BFL file set."""
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("gguf-pipe")
    folder = _save_pipeline(root / "FLUX.1-tiny", request.param)
    model = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    bfl, dif, cfg = write_flux1_pair(model, root / "files", "Q8_0")
    text_encoder_folders(folder, root)
    return folder, bfl, dif, cfg, root, request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pipeline_latents_equal_diffusers_with_the_same_gguf_file(gguf_pipeline, dtype):
    from diffusers import FluxPipeline

    folder, bfl, dif, cfg, root, guidance = gguf_pipeline
    ref = FluxPipeline.from_pretrained(
        folder, transformer=diffusers_gguf_transformer(dif, cfg, dtype), dtype=dtype
    )
    ours = Pipeline.from_pretrained(
        bfl,
        device="cpu",
        dtype=dtype,
        vae=folder / "vae",
        text_encoder=root / "clip",
        text_encoder_2=root / "t5",
    )
    prompts = ["a red fox in the snow", "An astronaut riding a horse on the Moon"]
    kw = dict(height=32, width=48, max_sequence_length=64)
    steps, scale = (3, 3.5) if guidance else (2, None)
    want = ref(
        prompts, generator=torch.Generator().manual_seed(42), output_type="latent",
        num_inference_steps=steps, guidance_scale=scale or 0.0, **kw,
    ).images  # fmt: skip
    got = ours(prompts, seed=42, num_steps=steps, guidance=scale, output_type="latent", **kw)
    assert got.latents.dtype == want.dtype == dtype
    assert torch.equal(got.latents, want)
    assert got.info["precision"] == "gguf-Q8_0"


def test_flux_gen_takes_a_gguf_file_records_its_precision_and_replays(gguf_pipeline, tmp_path):
    """`flux-gen --model file.gguf` with the BFL file set's `--vae` / `--text-encoder(-2)`; `--replay` of the
    PNG (given the same parts: the record names the model file, not where its VAE and encoders were) gives the
    same pixels."""
    import json

    import numpy as np
    from click.testing import CliRunner
    from PIL import Image

    from flux_runtime.cli.gen import main as gen_main

    folder, bfl, _, _, root, guidance = gguf_pipeline
    if not guidance:
        pytest.skip("dev covers it")
    out, again = tmp_path / "a.png", tmp_path / "b.png"
    runner = CliRunner()
    parts = [
        "--vae",
        str(folder / "vae"),
        "--text-encoder",
        str(root / "clip"),
        "--text-encoder-2",
        str(root / "t5"),
    ]
    args = [
        "--model",
        str(bfl),
        *parts,
        "--prompt",
        "a red fox",
        "--height",
        "32",
        "--width",
        "32",
        "--steps",
        "2",
    ]
    r = runner.invoke(gen_main, [*args, "--device", "cpu", "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads(Image.open(out).text["flux_runtime"])["precision"] == "gguf-Q8_0"
    r = runner.invoke(gen_main, ["--replay", str(out), *parts, "--out", str(again), "-q"])
    assert r.exit_code == 0, r.output
    assert np.array_equal(np.array(Image.open(out)), np.array(Image.open(again)))


def test_flux_convert_refuses_a_gguf_file(gguf_pipeline, tmp_path):
    """Converting would silently dequantize: a one-line refusal that says to load the file itself."""
    from click.testing import CliRunner

    from flux_runtime.cli.convert import main as convert_main

    _, bfl, _, _, _, guidance = gguf_pipeline
    if not guidance:
        pytest.skip("dev covers it")
    r = CliRunner().invoke(convert_main, ["transformer", str(bfl), str(tmp_path / "out")])
    assert r.exit_code != 0
    assert "flux-convert does not convert GGUF files (yet); load the .gguf file itself" in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_on_a_gpu_with_cuda_graphs_the_latents_equal_diffusers(gguf_pipeline):
    """bf16 on CUDA, the default tier and CUDA graphs (the dequantization is captured in them): the latents equal
    diffusers' FluxPipeline with its GGUF transformer on the same GPU."""
    from diffusers import FluxPipeline

    folder, bfl, dif, cfg, root, guidance = gguf_pipeline
    dtype = torch.bfloat16
    ref = FluxPipeline.from_pretrained(
        folder, transformer=diffusers_gguf_transformer(dif, cfg, dtype), dtype=dtype
    )
    ref = ref.to("cuda")
    ours = Pipeline.from_pretrained(
        bfl,
        device="cuda",
        dtype=dtype,
        vae=folder / "vae",
        text_encoder=root / "clip",
        text_encoder_2=root / "t5",
    )
    steps, scale = (3, 3.5) if guidance else (2, None)
    kw = dict(height=32, width=48, max_sequence_length=64)
    want = ref(
        "a red fox", generator=torch.Generator("cuda").manual_seed(42), output_type="latent",
        num_inference_steps=steps, guidance_scale=scale or 0.0, **kw,
    ).images  # fmt: skip
    for _ in range(2):  # the second call replays the captured graphs
        got = ours("a red fox", generator=torch.Generator("cuda").manual_seed(42), num_steps=steps, guidance=scale,
                   output_type="latent", **kw)  # fmt: skip
        assert torch.equal(got.latents, want)


def test_a_lora_on_a_gguf_pipeline_is_recorded_and_unloads(gguf_pipeline, tmp_path):
    """`load_lora` on a GGUF model fuses into dequantized copies of the layers it touches and says so in the
    provenance; `unload_loras` gives the GGUF model's latents back."""
    from tests.lora import lora_fixtures as lf

    folder, bfl, _, _, root, _ = gguf_pipeline
    pipe = Pipeline.from_pretrained(
        bfl, device="cpu", dtype=torch.float32, vae=folder / "vae", text_encoder=root / "clip",
        text_encoder_2=root / "t5",
    )  # fmt: skip
    kw = dict(height=32, width=48, max_sequence_length=64, num_steps=2, seed=1, output_type="latent")
    base = pipe("a red fox", **kw).latents
    shapes = lf.linear_shapes(pipe.transformer)
    pipe.load_lora(lf.bfl_file(tmp_path / "style.safetensors", shapes, ["double_blocks.0.img_attn.qkv"]), 0.9)
    fused = pipe("a red fox", **kw)
    assert fused.info["lora_gguf"].startswith("1 GGUF layers dequantized") and not torch.equal(
        fused.latents, base
    )
    pipe.unload_loras()
    assert torch.equal(pipe("a red fox", **kw).latents, base)
