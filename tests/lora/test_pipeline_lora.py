"""LoRAs on the FLUX.1 pipeline: images equal to diffusers' (CLIP-L LoRA included, a control LoRA that
widens img_in), repeatable loads, exact unload, the provenance record, bad input refused before any change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.weights.lora_formats import LoraError
from tests.lora import lora_fixtures as lf
from tests.pipeline.test_flux1_pipeline import PROMPTS, _save_pipeline
from tests.pipeline.test_flux1_variants import _image

KW = dict(height=32, width=32, max_sequence_length=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _save_pipeline(tmp_path_factory.mktemp("lora-pipe") / "FLUX.1-tiny", True)


@pytest.fixture(scope="module")
def shapes(folder):
    pipe = Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32)
    bfl = {
        n: (m.out_features, m.in_features)
        for n, m in pipe.transformer.named_modules()
        if hasattr(m, "in_features")
    }
    clip = {
        n: tuple(m.weight.shape)
        for n, m in pipe.text_encoder.clip.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    return bfl, clip


def _same(got, ref, kw):
    lat = ref(generator=torch.Generator().manual_seed(3), output_type="latent", **kw).images
    pil = ref(generator=torch.Generator().manual_seed(3), output_type="pil", **kw).images
    assert torch.equal(got.latents, lat)
    for g, w in zip(got.images, pil, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kohya_lora_with_clip_layers_equals_diffusers(folder, shapes, tmp_path, dtype):
    from diffusers import FluxPipeline

    bfl, clip = shapes
    mods = [m for m in lf.blocks("flux1", 2, 2) if not m.endswith("linear1")]
    te = {m: s for m, s in clip.items() if ".layers.0." in m}
    path = lf.kohya_file(tmp_path / "style.safetensors", bfl, mods, rank=4, alpha=2.0, te=te, seed=11)

    ref = FluxPipeline.from_pretrained(folder, dtype=dtype)
    ref.load_lora_weights(str(path))
    ref.fuse_lora(components=["transformer", "text_encoder"], lora_scale=0.75)
    ours = Pipeline.from_pretrained(folder, device="cpu", dtype=dtype)
    loaded = ours.load_lora(path, scale=0.75)
    assert (loaded.format, loaded.text_layers, loaded.layers) == ("kohya", len(te), len(mods))
    got = ours(PROMPTS, seed=3, num_steps=2, guidance=3.5, **KW)
    _same(got, ref, dict(prompt=PROMPTS, num_inference_steps=2, guidance_scale=3.5, **KW))
    (rec,) = got.info["loras"]
    assert rec["name"] == "style.safetensors" and rec["scale"] == 0.75 and rec["format"] == "kohya"
    assert len(rec["sha256"]) == 64


def test_control_lora_widens_img_in_and_runs_as_flux_control(folder, shapes, tmp_path):
    """A BFL Depth/Canny LoRA on FLUX.1 [dev]: img_in 64 → 128 wide, lora_B biases, QK-norm scales;
    the pipeline becomes a control pipeline and equals FluxControlPipeline with the same LoRA."""
    import inspect

    from diffusers import FluxControlPipeline, FluxPipeline

    from flux_runtime.weights.lora_formats import convert, read_lora
    from flux_runtime.weights.lora_layers import LayerTable

    bfl, _ = shapes
    mods = [*lf.blocks("flux1", 2, 2), "img_in", "txt_in", "final_layer.adaLN_modulation.1"]
    norms = {f"double_blocks.{i}.{s}_attn.norm.{q}.scale": 32 for i in range(2) for s in ("img", "txt")
             for q in ("query_norm", "key_norm")}  # fmt: skip
    path = lf.bfl_file(tmp_path / "depth.safetensors", bfl, mods, rank=4, prefix="", bias=True, norms=norms,
                       widths={"img_in": 128}, seed=12)  # fmt: skip
    ours = Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32)
    before = {k: v.clone() for k, v in ours.transformer.state_dict().items()}
    # the reference: diffusers on the same LoRA in its own names (its BFL control converter is written for
    # FLUX.1 [dev]'s sizes; that conversion is checked against ours at full size elsewhere)
    sd, meta = read_lora(path.read_bytes(), path.name)
    w = convert(sd, meta, LayerTable.of(ours.transformer), None, path.name)
    named = {f"transformer.{k}": v for k, v in w.norms.items()}
    for m, f in w.transformer.items():
        named[f"transformer.{m}.lora_A.weight"], named[f"transformer.{m}.lora_B.weight"] = f.down, f.up
        named[f"transformer.{m}.lora_B.bias"] = f.up_bias
    save_file(
        {k: v.clone().contiguous() for k, v in named.items()}, str(tmp_path / "depth-diffusers.safetensors")
    )
    wanted = inspect.signature(FluxControlPipeline.__init__).parameters
    ref = FluxControlPipeline(
        **{k: v for k, v in FluxPipeline.from_pretrained(folder).components.items() if k in wanted}
    )
    ref.load_lora_weights(str(tmp_path / "depth-diffusers.safetensors"))
    ref.fuse_lora(lora_scale=0.9)

    loaded = ours.load_lora(path, scale=0.9)
    assert loaded.format == "bfl-control" and loaded.widened == "img_in 64 -> 128"
    assert ours.variant == "control" and ours.transformer.config.in_channels == 128
    control = _image(32, 32, seed=4)
    got = ours(PROMPTS, seed=3, num_steps=2, guidance=10.0, control_image=control, **KW)
    _same(
        got,
        ref,
        dict(prompt=PROMPTS, num_inference_steps=2, guidance_scale=10.0, control_image=control, **KW),
    )
    assert got.info["variant"] == "control"

    ours.unload_loras()
    assert ours.variant == "text2img" and ours.transformer.config.in_channels == 64 and not ours.loras
    after = ours.transformer.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_stack_unload_and_switch(folder, shapes, tmp_path):
    bfl, clip = shapes
    a = lf.kohya_file(tmp_path / "a.safetensors", bfl, ["double_blocks.0.img_attn.qkv", "single_blocks.0.linear1"],
                      te={m: s for m, s in clip.items() if m.endswith("layers.1.mlp.fc1")}, seed=13)  # fmt: skip
    b = lf.bfl_file(tmp_path / "b.safetensors", bfl, ["double_blocks.1.txt_mlp.0"], seed=14)
    pipe = Pipeline.from_pretrained(folder, device="cpu", dtype=torch.bfloat16)
    base_t = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    base_c = {k: v.clone() for k, v in pipe.text_encoder.clip.state_dict().items()}
    plain = pipe("a cat", seed=1, num_steps=1, output_type="latent", **KW).latents
    pipe.load_lora(a, scale=1.0)
    pipe.load_lora(b, scale=-0.5)
    with pytest.raises(FluxError, match=r"a\.safetensors is already fused; call unload_loras"):
        pipe.load_lora(a, scale=0.3)
    stacked = pipe("a cat", seed=1, num_steps=1, output_type="latent", **KW)
    assert [lo["scale"] for lo in stacked.info["loras"]] == [1.0, -0.5]
    assert not torch.equal(stacked.latents, plain)
    pipe.unload_loras()
    for model, base in ((pipe.transformer, base_t), (pipe.text_encoder.clip, base_c)):
        now = model.state_dict()
        assert all(torch.equal(now[k], base[k]) for k in base)
    again = pipe("a cat", seed=1, num_steps=1, output_type="latent", **KW)
    assert torch.equal(again.latents, plain) and "loras" not in again.info
    pipe.load_lora(b, scale=-0.5)  # switching: no base reload
    assert [lo.path for lo in pipe.loras] == [str(b.resolve())]


@pytest.fixture
def pipe(folder):
    return Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32)


def _write(tmp_path, sd, name="bad.safetensors"):
    save_file(sd, str(tmp_path / name))
    return tmp_path / name


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda s: {
                "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.ones(2, 4),
                "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.ones(4, 2),
            },
            r"bad.safetensors is a Stable Diffusion / SDXL LoRA \(keys like lora_unet_down_blocks_0",
        ),
        (
            lambda s: {
                "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_A.weight": torch.ones(
                    2, 64
                ),
                "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_B.weight": torch.ones(
                    8, 2
                ),
            },
            r"is a FLUX.2 LoRA \(keys like transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        ),
        (
            lambda s: {
                f"transformer.transformer_blocks.{i}.attn.to_q.lora_{ab}.weight": torch.ones(2, 64)
                if ab == "A"
                else torch.ones(64, 2)
                for i in (0, 5, 6)
                for ab in "AB"
            },
            r"2 LoRA keys match no layer of this FLUX.1 model \(2 double / 2 single blocks\) \(diffusers layout\): "
            r"transformer.transformer_blocks.5.attn.to_q, transformer.transformer_blocks.6.attn.to_q",
        ),
        (
            lambda s: {
                "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.ones(2, 64),
                "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": torch.ones(48, 2),
            },
            r"transformer_blocks.0.attn.to_out.0 \(our double_blocks.0.img_attn.proj\) gets a LoRA update of shape "
            r"\(48, 64\); the model's layer is \(64, 64\)",
        ),
        (
            lambda s: {
                "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.full((2, 64), float("nan")),
                "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": torch.ones(64, 2),
            },
            r"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight holds NaN or infinite values",
        ),
        (
            lambda s: {
                "lora_te2_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight": torch.ones(2, 8),
                "lora_te2_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight": torch.ones(8, 2),
            },
            r"1 T5 text-encoder LoRA weights \(only CLIP-L's can be fused\), e.g. lora_te2_encoder_block_0",
        ),
        (
            lambda s: {
                "transformer.x_embedder.lora_A.weight": torch.ones(2, 64),
                "transformer.x_embedder.lora_B.weight": torch.ones(64, 2),
                "transformer.x_embedder.lora_magnitude_vector": torch.ones(64),
            },
            r"is a DoRA adapter",
        ),
    ],
    ids=["sdxl", "flux2", "unmatched", "shape", "nan", "t5", "dora"],
)
def test_bad_loras_are_refused_before_any_change(pipe, tmp_path, make, message):
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    with pytest.raises(LoraError, match=message):
        pipe.load_lora(_write(tmp_path, make(None)))
    assert all(torch.equal(v, before[k]) for k, v in pipe.transformer.state_dict().items())
    assert not pipe.loras


def test_bad_scales_and_files(pipe, tmp_path):
    for scale in (float("nan"), float("inf"), "1", True):
        with pytest.raises(FluxError, match=r"LoRA scale .* must be a finite number"):
            pipe.load_lora(tmp_path / "none.safetensors", scale=scale)
    (tmp_path / "x.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(LoraError, match=r"x\.safetensors: not a safetensors file"):
        pipe.load_lora(tmp_path / "x.safetensors")
    with pytest.raises(LoraError, match="neither an existing file or folder nor a Hugging Face model id"):
        pipe.load_lora(tmp_path / "missing.safetensors")
