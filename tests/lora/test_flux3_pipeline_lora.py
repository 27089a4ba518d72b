"""LoRAs on the FLUX.3 pipeline: images equal to diffusers' FLUX.3 modular pipeline with the same LoRAs fused
(`load_lora_weights` + `fuse_lora`), stacking, exact unload, the provenance record, `flux-gen --lora` and
`--replay`; on CUDA the denoiser's graph is captured again after a LoRA changes the weights."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from flux_runtime.cli.gen import main
from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.pipeline.provenance import read_provenance
from flux_runtime.sampling import flux2_unpack
from flux_runtime.weights.lora_formats import LoraError
from tests.lora import lora_fixtures as lf
from tests.lora.test_flux3_fuse import peft_written
from tests.pipeline import test_flux3_pipeline as f3p

folders = f3p.folders  # the tiny FLUX.3 folders (base, flow map) of the pipeline parity tests
KW, STEPS, PROMPT = f3p.KW, f3p.STEPS, f3p.PROMPT


def _loras(folder, tmp_path, seed):
    """A peft-written diffusers LoRA on attention and MLP layers, and a BFL-named one on per-mode and joint
    blocks (the layouts diffusers' FLUX.3 loader reads whole)."""
    pipe = Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32)
    shapes = lf.linear_shapes(pipe.transformer)
    targets = ["mode_blocks.image.0.attn.to_q", "txt_mode_blocks.1.attn.to_out.0", "single_transformer_blocks.0.ff.linear_in",
               "single_transformer_blocks.1.attn.to_v", "mode_blocks.image_cond.1.ff.linear_out"]  # fmt: skip
    peft = peft_written(
        folder / "transformer", tmp_path / "style.safetensors", targets, rank=4, alpha=8, seed=seed
    )
    bfl = lf.bfl_file(tmp_path / "bfl.safetensors", shapes, lf.flux3_blocks(2, 2)[::3], rank=2, seed=seed + 1)
    return peft, bfl


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("base", torch.float32), ("base", torch.bfloat16), ("flow-map", torch.float32)],
    ids=["base-fp32", "base-bf16", "flow-map-fp32"],
)
def test_lora_images_equal_diffusers_modular_pipeline(folders, tmp_path, name, dtype):
    flow_map = name == "flow-map"
    peft, bfl = _loras(folders[name], tmp_path, seed=21)
    runs = [(peft, 0.8), (bfl, -0.6)]
    ref = lf.diffusers_fused(f3p._diffusers(folders[name], flow_map, dtype), runs)
    state = ref(prompt=PROMPT, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(7), **KW)

    ours = Pipeline.from_pretrained(folders[name], device="cpu", dtype=dtype)
    plain = ours(PROMPT, num_steps=STEPS, seed=7, output_type="latent", **KW).latents
    loaded = [ours.load_lora(path, scale=scale) for path, scale in runs]
    assert [(lo.format, lo.layers) for lo in loaded] == [
        ("diffusers", 5),
        ("bfl", len(lf.flux3_blocks(2, 2)[::3])),
    ]
    out = ours(PROMPT, num_steps=STEPS, seed=7, **KW)
    got = flux2_unpack(out.latents, 16, 24)
    assert torch.equal(got, state.get("latents"))
    f3p._same_images(out.images, state.get("images"))
    assert not torch.equal(out.latents, plain)
    assert [(r["name"], r["scale"], r["format"]) for r in out.info["loras"]] == [
        ("style.safetensors", 0.8, "diffusers"),
        ("bfl.safetensors", -0.6, "bfl"),
    ]


def test_stack_unload_and_refusals(folders, tmp_path):
    peft, bfl = _loras(folders["base"], tmp_path, seed=31)
    pipe = Pipeline.from_pretrained(folders["base"], device="cpu", dtype=torch.bfloat16)
    base = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    plain = pipe(PROMPT, num_steps=1, seed=1, output_type="latent", **KW).latents
    pipe.load_lora(peft, scale=1.0)
    with pytest.raises(FluxError, match=r"style\.safetensors is already fused; call unload_loras"):
        pipe.load_lora(peft, scale=0.5)
    # a FLUX.2 LoRA is refused before any change, the fused one stays
    fused = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    flux2 = lf.peft_file(tmp_path / "f2.safetensors", {"single_transformer_blocks.0.attn.to_qkv_mlp_proj": (8, 64)},
                         ["single_transformer_blocks.0.attn.to_qkv_mlp_proj"])  # fmt: skip
    with pytest.raises(LoraError, match=r"f2\.safetensors is a FLUX\.2 LoRA .* this pipeline runs FLUX\.3"):
        pipe.load_lora(flux2)
    now = pipe.transformer.state_dict()
    assert all(torch.equal(now[k], fused[k]) for k in fused) and len(pipe.loras) == 1
    pipe.load_lora(bfl, scale=0.5)
    pipe.unload_loras()
    now = pipe.transformer.state_dict()
    assert set(now) == set(base) and all(torch.equal(now[k], base[k]) for k in base)
    again = pipe(PROMPT, num_steps=1, seed=1, output_type="latent", **KW)
    assert torch.equal(again.latents, plain) and "loras" not in again.info
    pipe.load_lora(bfl, scale=0.5)  # switching: no base reload
    assert [lo.path for lo in pipe.loras] == [str(bfl.resolve())]


@pytest.mark.slow
def test_gen_with_a_flux3_lora_records_and_replays(tmp_path):
    pipe = Pipeline.from_pretrained("tiny-flux3-random", device="cpu", dtype=torch.float32)
    lora = lf.bfl_file(tmp_path / "f3.safetensors", lf.linear_shapes(pipe.transformer),
                       ["single_blocks.0.q_proj", "txt_mode_blocks.0.mlp_in", "final_layer.image.adaLN_modulation.1"],
                       seed=41)  # fmt: skip
    base = ["--model", "tiny-flux3-random", "--steps", "1", "--width", "32", "--height", "32", "--quiet",
            "--device", "cpu", "--no-upsample"]  # fmt: skip
    out = tmp_path / "o.png"
    res = CliRunner().invoke(main, [*base, "-p", "a fox", "--lora", f"{lora}:0.7", "-o", str(out)])
    assert res.exit_code == 0, res.output
    (rec,) = read_provenance(out)["loras"]
    assert (rec["name"], rec["scale"], rec["format"]) == ("f3.safetensors", 0.7, "bfl")
    lf.assert_lora_changes_image_and_replays(tmp_path, [*base, "-p", "a fox"], out)
    lora.write_bytes(lora.read_bytes()[:-4] + b"\0\0\0\0")  # the LoRA's bytes change
    res = CliRunner().invoke(main, ["--replay", str(out), "-o", str(tmp_path / "y.png"), "--device", "cpu"])
    assert res.exit_code == 1 and f"its LoRA {lora.resolve()} has changed since" in res.output


@pytest.mark.gpu
def test_cuda_graph_is_recaptured_after_a_lora(folders, tmp_path):
    """A graph captured before the LoRA would replay the old weights: the LoRA's image must equal that of a
    pipeline that fused the LoRA before its first call, and unloading must give the plain image back."""
    peft, bfl = _loras(folders["base"], tmp_path, seed=51)
    kw = dict(num_steps=3, seed=7, output_type="latent", **KW)  # per call: eager, captured, replayed
    pipe = Pipeline.from_pretrained(folders["base"], device="cuda", dtype=torch.bfloat16, cuda_graphs=True)
    plain = pipe(PROMPT, **kw).latents
    assert any(g.graphs for g in pipe._graphed.values()), "the first call captured no CUDA graph"
    pipe.load_lora(peft, scale=0.9)
    pipe.load_lora(bfl, scale=1.1)
    fused = pipe(PROMPT, **kw).latents
    assert any(g.graphs for g in pipe._graphed.values())
    fresh = Pipeline.from_pretrained(folders["base"], device="cuda", dtype=torch.bfloat16, cuda_graphs=True)
    fresh.load_lora(peft, scale=0.9)
    fresh.load_lora(bfl, scale=1.1)
    assert torch.equal(fused, fresh(PROMPT, **kw).latents) and not torch.equal(fused, plain)
    pipe.unload_loras()
    assert torch.equal(pipe(PROMPT, **kw).latents, plain)
