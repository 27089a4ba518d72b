"""FLUX.3 GGUF transformers (base and flow map): `flux-convert gguf` writes them as city96 writes FLUX.1 / FLUX.2
ones, our loader keeps their projections quantized, and both agree bit for bit with diffusers'
`Flux3Transformer2DModel.from_single_file(..., quantization_config=GGUFQuantizationConfig(...))` on the same file:
the dequantized weights, the transformer's output (with a reference image and, for the flow map, a target
timestep) and, in `test_gguf_flux3_pipeline.py`, whole pipelines. Bad files fail in one line naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flux_runtime.models.dit.flux3 import Flux3Transformer
from flux_runtime.models.dit.layers import GgufLinear
from flux_runtime.pipeline import Pipeline, placement
from flux_runtime.pipeline.memory import Plan, spread
from flux_runtime.pipeline.placement import apply_plan, dit_layers, footprint
from flux_runtime.sampling import flux2_unpack
from flux_runtime.weights.checkpoint import as_checkpoint
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.gguf_file import GgufSource
from flux_runtime.weights.gguf_write import KEEP_PREFIXES
from flux_runtime.weights.transformer import load_transformer
from tests.cli.convert_helpers import run, tensors
from tests.flux3_fixtures import (
    bfl_state_dict,
    make_diffusers_flux3,
    make_inputs,
    our_forward,
    reference_forward,
    save_bfl,
    save_diffusers,
)
from tests.gguf.test_gguf_write import _check_file
from tests.gguf_fixtures import city96_types, diffusers_gguf_transformer, write_gguf, write_pair
from tests.pipeline.test_flux3_pipeline import KW, PROMPT, STEPS, _diffusers, build_folders

pytest.importorskip("diffusers")

# K-quant rows hold 256 values: hidden 256 (2 heads of 128), SwiGLU hidden 768; the embedders stay kept anyway
WIDE = dict(attention_head_dim=128, axes_dims_rope=(32, 32, 32, 32))
# (type, flow map): every type on one of the two kinds, the K-quant on the widened model
CASES = [("F16", False), ("BF16", True), ("Q8_0", False), ("Q5_0", True), ("Q4_K", False), ("Q6_K", True)]
IDS = [f"{q}-{'flow' if f else 'base'}" for q, f in CASES]
BF = torch.bfloat16


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """`flux-convert gguf` of a bf16 BFL FLUX.3 file in a type, run once each: (its output, the GGUF file, the
    source tensors, a folder with the model's config.json for diffusers' loader)."""
    made: dict[tuple[str, bool], tuple] = {}

    def get(qtype: str, flow_map: bool):
        if (qtype, flow_map) not in made:
            folder = tmp_path_factory.mktemp(f"flux3-{qtype}")
            wide = WIDE if qtype.endswith("_K") else {}
            model = make_diffusers_flux3(flow_map, seed=3, **wide).to(BF)
            src = save_bfl(model, folder / "flux3.safetensors")
            model.save_config(folder / "config")
            out = run("gguf", src, folder / "out.gguf", "--type", qtype)
            made[qtype, flow_map] = out, folder / "out.gguf", tensors(src), folder / "config"
        return made[qtype, flow_map]

    return get


@pytest.mark.parametrize(("qtype", "flow_map"), CASES, ids=IDS)
def test_flux3_written_file_is_read_as_diffusers_reads_it(written, qtype, flow_map):
    out, path, sd, config = written(qtype, flow_map)
    assert f"gguf: bfl -> GGUF {qtype}, {len(sd)} tensors" in out
    # the type rule, every weight torch.equal to diffusers' reading, the error against the source (fp32: the
    # QK-norm weights, fp32 in both, compare as they are)
    _check_file(path, sd, qtype, torch.float32)
    kinds = {k: GgufSource(path).ggml_type(k).name for k in sd}
    kept = [k for k in sd if k.startswith(KEEP_PREFIXES)]
    assert {k.split(".")[0] for k in kept} == {"emb_in", "txt_in", "time_in", "final_layer"} | (
        {"ref_time_in"} if flow_map else set()
    )
    assert all(kinds[k] == "BF16" for k in kept if sd[k].ndim == 2)
    assert kinds["early_stream_modulations.txt.lin.weight"] == qtype  # the modulations are quantized
    assert kinds["single_blocks.0.norm.query_norm.scale"] == "F32"

    # the transformer, in bf16: ours (projections kept quantized, QK norms fp32) against diffusers' GGUF model
    ours = load_transformer(path, device="cpu", dtype=BF)
    assert isinstance(ours, Flux3Transformer) and ours.config.flow_map is flow_map
    assert ours.precision == f"gguf-{qtype}"  # an F16 / BF16 file is named by its stored type too
    layers = [ours.content_mode_blocks["image_cond"][1].q_proj, ours.single_blocks[0].mlp_out]
    layers += [ours.txt_mode_blocks[0].mlp_in, ours.single_stream_modulations["txt"].lin]
    for layer in layers:
        assert isinstance(layer, GgufLinear) == (qtype not in ("F16", "BF16"))
    for kept_layer in (ours.emb_in["image"], ours.txt_in, ours.final_layer["image"].linear):
        assert not isinstance(kept_layer, GgufLinear)
    assert ours.single_blocks[0].norm.query_norm.scale.dtype == torch.float32
    ref = diffusers_gguf_transformer(path, config, BF, "Flux3Transformer2DModel")
    x = make_inputs(1, 3, 5, 7, BF, refs=((2, 3),), flow_map=flow_map)
    want, got = reference_forward(ref, x), our_forward(ours, x)
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_flux3_from_a_diffusers_folder_is_the_same_file(tmp_path):
    """A FLUX.3 diffusers folder (fp32, flow map) becomes the same bytes as its BFL twin; fp32 sources keep the
    embedders F32."""
    model = make_diffusers_flux3(True, seed=1)
    folder = save_diffusers(model, tmp_path / "transformer")
    bfl = save_bfl(model, tmp_path / "flux3.safetensors")
    assert "gguf: diffusers -> GGUF Q8_0" in run("gguf", folder, tmp_path / "a.gguf", "--type", "Q8_0")
    run("gguf", bfl, tmp_path / "b.gguf", "--type", "Q8_0", "-q")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    src = GgufSource(tmp_path / "a.gguf")
    assert src.ggml_type("emb_in.image_cond.weight").name == "F32"
    assert src.ggml_type("ref_time_in.out_layer.weight").name == "F32"
    assert src.ggml_type("content_mode_blocks.image.0.v_proj.weight").name == "Q8_0"


@pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["fp32", "bf16"])
def test_city96_typed_files_match_diffusers_in_either_layout(tmp_path, dtype):
    """Files not of our writer (the `gguf` package's, typed as city96's tools type them: Q4_0 wherever rows hold
    whole blocks of 32, the embedders and the final layer too), under BFL names and under diffusers' (the final
    adaLN's quantized row halves swapped): both load, projections quantized, to diffusers' output on either."""
    model = make_diffusers_flux3(True, seed=2)
    bfl, dif, config = write_pair(model, tmp_path, "Q4_0", "flux3")
    x = make_inputs(2, 4, 3, 6, dtype, refs=((2, 2), (1, 3)), flow_map=True)
    for path in (bfl, dif):
        ours = load_transformer(path, device="cpu", dtype=dtype)
        assert ours.precision == "gguf-Q4_0"
        for layer in (
            ours.emb_in["image"],
            ours.final_layer["image"].adaLN_modulation[1],
            ours.ref_time_in.in_layer,
        ):
            assert isinstance(layer, GgufLinear)
        ref = diffusers_gguf_transformer(path, config, dtype, "Flux3Transformer2DModel")
        want = reference_forward(ref, x)
        assert torch.isfinite(want).all() and torch.equal(our_forward(ours, x), want), path.name


def _one_line(path) -> str:
    with pytest.raises(WeightsError) as e:
        load_transformer(path, device="cpu", dtype=BF)
    line = str(e.value)
    assert "\n" not in line
    return line


def test_bad_flux3_files_name_the_tensor(tmp_path):
    """A FLUX.3 file (city96-typed Q8_0) with a tensor missing, a quantized projection of too few rows, a
    modulation of the wrong width: one line each, naming the tensor."""
    sd, folder = bfl_state_dict(make_diffusers_flux3(False, seed=2)), tmp_path
    missing = {k: v for k, v in sd.items() if k != "single_blocks.1.mlp_out.weight"}
    line = _one_line(write_gguf(missing, folder / "missing.gguf", city96_types("Q8_0")))
    assert "single_blocks.1.mlp_out.weight" in line and "missing" in line
    # a quantized projection with too few rows
    bad = dict(sd, **{"content_mode_blocks.image_cond.0.k_proj.weight": torch.zeros(32, 64)})
    line = _one_line(write_gguf(bad, folder / "rows.gguf", city96_types("Q8_0")))
    assert "content_mode_blocks.image_cond.0.k_proj.weight" in line and "(64, 64)" in line
    # a modulation whose width disagrees with the model's
    bad = dict(sd, **{"early_stream_modulations.txt.lin.weight": torch.zeros(192, 96)})
    line = _one_line(write_gguf(bad, folder / "cols.gguf", city96_types("Q8_0")))
    assert "early_stream_modulations.txt.lin.weight" in line
    # under diffusers' names: a missing joint projection, a final adaLN (its halves swapped) of the wrong width
    dif = make_diffusers_flux3(False, seed=2).state_dict()
    missing = {k: v for k, v in dif.items() if k != "single_transformer_blocks.0.attn.to_k.weight"}
    line = _one_line(write_gguf(missing, folder / "dif-missing.gguf", city96_types("Q8_0")))
    assert "single_transformer_blocks.0.attn.to_k.weight" in line
    bad = dict(dif, **{"norm_out.linear.weight": torch.zeros(128, 96)})
    line = _one_line(write_gguf(bad, folder / "dif-cols.gguf", city96_types("Q8_0")))
    assert "norm_out.linear.weight" in line and "(128, 64)" in line


@pytest.fixture(scope="module")
def gguf_folders(tmp_path_factory):
    """The FLUX.3 pipeline folders of tests/pipeline/test_flux3_pipeline.py, each transformer also written by
    `flux-convert gguf` (base Q8_0, flow map Q5_0)."""
    root = tmp_path_factory.mktemp("flux3-gguf-pipe")
    folders = build_folders(root / "folders")
    out = {}
    for name, qtype in (("base", "Q8_0"), ("flow-map", "Q5_0")):
        path = root / f"{name}-{qtype}.gguf"
        run("gguf", folders[name] / "transformer", path, "--type", qtype, "-q")
        out[name] = folders[name], path, qtype
    return out


def _ours(folder, path, dtype, **kw) -> Pipeline:
    """Our pipeline on the GGUF transformer file, the VAE and text encoder from the diffusers folder."""
    return Pipeline.from_pretrained(
        path, device="cpu", dtype=dtype, vae=folder / "vae", text_encoder=folder, **kw
    )


@pytest.mark.parametrize(
    ("name", "dtype", "with_ref"),
    [("base", BF, False), ("base", torch.float32, True), ("flow-map", torch.float32, False)],
    ids=["base-cfg-bf16", "base-cfg-reference-fp32", "flow-map-fp32-two-images"],
)
def test_pipeline_latents_equal_diffusers_with_the_same_gguf_file(gguf_folders, name, dtype, with_ref):
    """diffusers' modular FLUX.3 pipeline with the GGUF transformer `from_single_file` loads, against ours from the
    .gguf file: the same latents (with a reference image: the reference stream, which the base model runs once
    per generation, through the quantized `image_cond` blocks), the precision recorded."""
    folder, path, qtype = gguf_folders[name]
    flow_map = name == "flow-map"
    ref = _diffusers(folder, flow_map, dtype)
    transformer = diffusers_gguf_transformer(path, folder / "transformer", dtype, "Flux3Transformer2DModel")
    ref.update_components(transformer=transformer)
    n = 2 if flow_map else 1
    image = {"image": _reference()} if with_ref else {}
    state = ref(
        prompt=PROMPT, num_inference_steps=STEPS, num_images_per_prompt=n,
        generator=torch.Generator().manual_seed(7), **image, **KW,
    )  # fmt: skip
    ours = _ours(folder, path, dtype)
    assert isinstance(ours.transformer.single_blocks[1].q_proj, GgufLinear)
    assert isinstance(ours.transformer.content_mode_blocks["image_cond"][0].v_proj, GgufLinear)
    out = ours(PROMPT, num_steps=STEPS, num_images_per_prompt=n, seed=7, **image, **KW)
    want, got = state.get("latents"), flux2_unpack(out.latents, 16, 24)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    assert out.info["precision"] == f"gguf-{qtype}"
    assert len(out.info.get("reference_images", [])) == int(with_ref)


def _reference():
    """A 48x32 noisy gradient: a reference image of the generated size (no canvas, no crop)."""
    from PIL import Image

    y, x = np.mgrid[0:32, 0:48]
    noise = np.random.default_rng(0).integers(-30, 30, (32, 48, 3))
    rgb = np.stack([x * 5, y * 7, (x + y) % 256], axis=-1) + noise
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def test_memory_plans_count_the_stored_bytes_and_keep_the_bits(gguf_folders):
    """The planner's transformer is the file's stored blocks (less than the same model in bf16), and streaming
    every block, its GGML blocks moved as stored, gives the resident pipeline's latents."""
    folder, path, _ = gguf_folders["base"]
    pipe = _ours(folder, path, BF)
    kw = dict(num_steps=1, seed=3, output_type="latent", **KW)
    want = pipe(PROMPT, **kw).latents
    src = GgufSource(path)
    stored = sum(src.nbytes(k) for k in src.keys() if src.is_quantized(k))
    blocks = [m for m in pipe.transformer.modules() if isinstance(m, GgufLinear)]
    as_bf16 = sum(2 * m.in_features * m.out_features for m in blocks)
    assert stored == sum(m.qweight.nbytes for m in blocks) and stored < 0.6 * as_bf16
    fp = footprint(pipe)
    plain = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    assert stored + plain <= fp.dit.total < as_bf16 + plain
    # what the planner reads before loading (the file's headers): the stored blocks, the rest at 16 bits
    plain16 = sum(2 * src.get(k).numel() for k in src.keys() if not src.is_quantized(k))
    assert placement.checkpoint_bytes(as_checkpoint(path), BF, False) == stored + plain16
    nd = len(dit_layers(pipe.transformer))
    apply_plan(pipe, Plan("stream", None, text="offloaded", dit="streamed", streamed_dit=spread(nd, nd),
                          together=False), torch.device("cpu"))  # fmt: skip
    pipe._prompts.clear()
    assert torch.equal(pipe(PROMPT, **kw).latents, want)
    unit = pipe.placement.models["dit"].units[1]
    assert any(e.dtype == torch.uint8 for e in unit.entries)  # the blocks stream as stored


def test_flux_gen_takes_a_flux3_gguf_file_and_replays(gguf_folders, tmp_path):
    """`flux-gen --model file.gguf --vae ... --text-encoder ...` on a FLUX.3 file: the PNG records `gguf-<type>`,
    and `--replay` with the same parts gives the same pixels."""
    import json

    from click.testing import CliRunner
    from PIL import Image

    from flux_runtime.cli.gen import main as gen_main

    folder, path, qtype = gguf_folders["flow-map"]
    parts = ["--vae", str(folder / "vae"), "--text-encoder", str(folder)]
    args = ["--model", str(path), *parts, "--prompt", "a red fox", "--height", "32", "--width", "32"]
    out, again = tmp_path / "a.png", tmp_path / "b.png"
    runner = CliRunner()
    r = runner.invoke(gen_main, [*args, "--steps", "2", "--device", "cpu", "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads(Image.open(out).text["flux_runtime"])["precision"] == f"gguf-{qtype}"
    r = runner.invoke(gen_main, ["--replay", str(out), *parts, "--out", str(again), "-q"])
    assert r.exit_code == 0, r.output
    assert np.array_equal(np.array(Image.open(out)), np.array(Image.open(again)))
