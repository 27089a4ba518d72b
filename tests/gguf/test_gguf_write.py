"""`flux-convert gguf`: tiny FLUX.1 / FLUX.2 transformers written as GGUF files in every type written, read back by
our loader, by diffusers' GGUF reader and by the `gguf` package; the type rule; the error against the source."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.kernels import gguf_dequant
from flux_runtime.models.dit.layers import GgufLinear
from flux_runtime.weights.gguf_file import GgufSource
from flux_runtime.weights.gguf_write import GGUF_TYPES, KEEP_PREFIXES, SMALL
from flux_runtime.weights.transformer import load_transformer
from tests.cli.convert_helpers import fail, run, tensors
from tests.flux1_fixtures import make_diffusers_transformer, save_bfl
from tests.flux2_fixtures import make_diffusers_flux2
from tests.flux2_fixtures import make_inputs as make_flux2_inputs
from tests.flux2_fixtures import save_bfl as save_bfl_flux2
from tests.gguf_fixtures import diffusers_gguf_transformer, gguf
from tests.models.helpers import diffusers_forward
from tests.random_models import save_diffusers, save_tensors

pytest.importorskip("diffusers")

# every projection's rows hold whole K-quant blocks of 256 (hidden 256, MLP 1024), one block of each kind
WIDE = dict(
    num_layers=1, num_single_layers=1, attention_head_dim=128, joint_attention_dim=256,
    pooled_projection_dim=256, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
# the largest |error| in a block of 32, as (divisor, steps): the `gguf` package's step is the block's max |x| / the
# divisor; a half step where it rounds to nearest, a whole one for Q4_0/Q5_0, whose scale maps the signed extreme
# to the lowest code so that the other extreme may be clipped by one step
LEGACY_STEP = {
    "Q8_0": (127, 0.5),
    "Q5_1": (15.5, 0.5),
    "Q4_1": (7.5, 0.5),
    "Q5_0": (16, 1.0),
    "Q4_0": (8, 1.0),
}
# relative RMS error of the weights (measured ~0.6x these on the tiny model, std 0.02-ish weights)
REL_RMS = {"F16": 1e-3, "BF16": 4e-3, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.06, "Q5_1": 0.06, "Q5_0": 0.06}
REL_RMS.update({"Q4_K": 0.12, "Q4_1": 0.12, "Q4_0": 0.12, "Q3_K": 0.3, "Q2_K": 0.5})


@pytest.fixture(scope="module")
def flux1(tmp_path_factory):
    """bf16 FLUX.1 [dev]-shaped BFL files (prefixed, as ComfyUI saves them) and their tensors, built once: `wide`
    for the K-quants (rows of 256), the narrow tiny model (rows of 64, whole blocks of 32) for the others."""
    made: dict[bool, tuple] = {}

    def get(wide: bool):
        if wide not in made:
            folder = tmp_path_factory.mktemp("flux1")
            model = make_diffusers_transformer(True, **(WIDE if wide else {})).to(torch.bfloat16)
            src = save_bfl(model, folder / "flux1.safetensors", prefix="model.diffusion_model.")
            made[wide] = src, {k.removeprefix("model.diffusion_model."): v for k, v in tensors(src).items()}
        return made[wide]

    return get


@pytest.fixture(scope="module")
def written(flux1, tmp_path_factory):
    """`flux-convert gguf` of `flux1`'s file (the wide one by default for the K-quants) in a type, run once each:
    (its output, the file, the source tensors)."""
    made: dict[tuple[str, bool], tuple] = {}

    def get(qtype: str, wide: bool | None = None):
        key = qtype, qtype.endswith("_K") if wide is None else wide
        if key not in made:
            src, sd = flux1(key[1])
            dst = tmp_path_factory.mktemp(qtype) / "out.gguf"
            made[key] = run("gguf", src, dst, "--type", qtype.lower()), dst, sd
        return made[key]

    return get


def _diffusers_read(path):
    """diffusers' GGUF reader on `path`: each tensor as its `GGUFLinear` would use it, fp16 for block types."""
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    read = load_gguf_checkpoint(str(path))
    return {k: dequantize_gguf_tensor(v) if isinstance(v, GGUFParameter) else v for k, v in read.items()}


def _check_file(path, sd, qtype: str, dtype: torch.dtype) -> None:
    """The type rule, (a) our loaded weights against diffusers' reading, (b) the `gguf` package's, (c) the
    error against the source `sd`."""
    src = GgufSource(path)
    assert sorted(src.keys()) == sorted(sd)
    theirs = _diffusers_read(path)
    ours = load_transformer(path, device="cpu", dtype=dtype)
    params = dict(ours.named_parameters())
    quantized = 0
    for name, want in sd.items():
        kind = src.ggml_type(name).name
        shape = tuple(want.shape)
        if len(shape) == 1 or want.numel() <= SMALL:
            assert kind == "F32", name
        elif name.startswith(KEEP_PREFIXES) or qtype in ("F16", "BF16"):
            kept = {torch.bfloat16: "BF16", torch.float32: "F32"}[want.dtype]
            assert kind == (kept if name.startswith(KEEP_PREFIXES) else qtype), name
        else:
            assert kind == qtype, name
        module, _, leaf = name.rpartition(".")
        layer = ours.get_submodule(module)
        got = layer.weight if isinstance(layer, GgufLinear) and leaf == "weight" else params[name]
        # (a) torch.equal to what diffusers' GGUF path multiplies by (its tensor, cast to the compute dtype)
        assert torch.equal(got, theirs[name].to(dtype)), name
        if kind == "F32" or name.startswith(KEEP_PREFIXES):
            assert torch.equal(theirs[name].float(), want.float()), name  # stored exactly
        if kind in gguf_dequant.BY_NAME and src.is_quantized(name):
            quantized += 1
            assert isinstance(layer, GgufLinear) and layer.ggml_type.name == qtype
            raw = src.raw(name)
            fp16 = gguf_dequant.dequantize(raw, src.ggml_type(name))
            # (b) the gguf package's fp32 dequantization: within fp16 rounding (two roundings of the largest term)
            pkg = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind]))
            tol = 2 * 2.0**-11 * pkg.abs().amax().item()
            torch.testing.assert_close(fp16.float(), pkg.float(), rtol=2e-3, atol=tol)
            # (c) the error against the source
            err = fp16.float() - want.float()
            if qtype in LEGACY_STEP:
                divisor, steps = LEGACY_STEP[qtype]
                blocks = want.float().reshape(-1, 32).abs().amax(dim=1)
                # + the fp16 roundings: of the scale (times up to 15 or 127 codes), of the minimum, of the sum
                bound = steps * blocks / divisor + 2.0**-8 * blocks + 2.0**-24
                assert (err.reshape(-1, 32).abs().amax(dim=1) <= bound).all(), name
        if kind == qtype:
            rel = (got.float() - want.float()).pow(2).mean().sqrt() / want.float().pow(2).mean().sqrt()
            assert rel < REL_RMS[qtype], (name, rel.item())
    assert quantized > 0 or qtype in ("F16", "BF16")


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_flux1_round_trip_every_type(written, qtype):
    out, path, sd = written(qtype)
    assert f"gguf: bfl -> GGUF {qtype}, {len(sd)} tensors" in out
    _check_file(path, sd, qtype, torch.bfloat16)
    reader = gguf.GGUFReader(str(path))
    field = reader.get_field("general.architecture")
    assert field.contents() == "flux"  # the name ComfyUI-GGUF accepts for FLUX.1 and FLUX.2
    assert reader.get_field("general.quantization_version").contents() == gguf.GGML_QUANT_VERSION
    assert [p.name for p in path.parent.iterdir()] == ["out.gguf"]  # no .partial left


def test_flux1_output_near_the_source(flux1, written):
    """The whole transformer from the Q8_0 and Q4_K files in fp32: outputs near the source's, Q8_0 nearer."""
    from tests.flux1_fixtures import make_inputs

    src, _ = flux1(True)
    ref = load_transformer(src, device="cpu", dtype=torch.float32)
    img, img_ids, txt, txt_ids, t, y, g = make_inputs(1, 4, 4, 8, torch.float32)
    gen = torch.Generator().manual_seed(1)
    txt, y = torch.randn(1, 8, 256, generator=gen), torch.randn(1, 256, generator=gen)
    rel = {}
    with torch.no_grad():
        want = ref(img, img_ids, txt, txt_ids, t, y, g)
        for qtype in ("Q8_0", "Q4_K"):
            _, path, _ = written(qtype, wide=True)
            got = load_transformer(path, device="cpu", dtype=torch.float32)(
                img, img_ids, txt, txt_ids, t, y, g
            )
            rel[qtype] = ((got - want).norm() / want.norm()).item()
    # random weights pass every error on through 2 blocks: measured ~0.007 (Q8_0) and ~0.14 (Q4_K)
    assert 0 < rel["Q8_0"] < 0.02 and 5 * rel["Q8_0"] < rel["Q4_K"] < 0.25, rel


@pytest.mark.parametrize(
    ("qtype", "guidance"), [("Q8_0", True), ("Q6_K", False)], ids=["dev-Q8_0", "klein-Q6_K"]
)
def test_flux2_from_a_diffusers_folder(tmp_path, qtype, guidance):
    """A FLUX.2 diffusers folder (fp32) becomes a BFL-named file, the same bytes as from its BFL twin."""
    wide = dict(num_layers=1, num_single_layers=1, attention_head_dim=128, joint_attention_dim=256)
    model = make_diffusers_flux2(guidance, axes_dims_rope=(32, 32, 32, 32), **wide)
    folder = save_diffusers(model, tmp_path / "transformer")
    bfl = save_bfl_flux2(model, tmp_path / "flux2.safetensors")
    out = run("gguf", folder, tmp_path / "a.gguf", "--type", qtype)
    assert "gguf: diffusers -> GGUF" in out
    if qtype == "Q8_0":  # the same bytes from the BFL twin (once: the steps are the same for every type)
        run("gguf", bfl, tmp_path / "b.gguf", "--type", qtype, "-q")
        assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    sd = tensors(bfl)
    _check_file(tmp_path / "a.gguf", sd, qtype, torch.float32)
    # fp32 source: the kept tensors stay F32
    assert GgufSource(tmp_path / "a.gguf").ggml_type("img_in.weight").name == "F32"
    # diffusers' `from_single_file` reads this BFL-named file itself (its FLUX.2 conversion takes the widths
    # from the config; FLUX.1's assumes FLUX.1-dev's): the whole transformer's output is bit-identical
    dtype = torch.bfloat16
    ref = diffusers_gguf_transformer(tmp_path / "a.gguf", folder, dtype, "Flux2Transformer2DModel")
    img, img_ids, txt, txt_ids, t, g = make_flux2_inputs(1, 3, 5, 7, dtype)
    txt = torch.randn(1, 7, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = diffusers_forward(ref, img, img_ids, txt, txt_ids, t, g)
    ours = load_transformer(tmp_path / "a.gguf", device="cpu", dtype=dtype)
    assert ours.config.family == "flux2" and ours.precision == f"gguf-{qtype}"
    with torch.no_grad():
        got = ours(img, img_ids, txt, txt_ids, t, g if guidance else None)
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_rows_that_are_not_whole_blocks_keep_the_source_type(tmp_path):
    """The narrow tiny model (hidden 64, MLP 256) in Q4_K: weights of 256 columns quantized, the others (64 or
    320 columns) kept in bf16, their values exactly the source's; our loader and diffusers agree on all."""
    model = make_diffusers_transformer(False).to(torch.bfloat16)
    src = save_bfl(model, tmp_path / "schnell.safetensors")
    run("gguf", src, tmp_path / "out.gguf", "--type", "Q4_K")
    gsrc, sd = GgufSource(tmp_path / "out.gguf"), tensors(src)
    kinds = {k: gsrc.ggml_type(k).name for k in sd}
    assert kinds["double_blocks.0.img_mlp.2.weight"] == "Q4_K"  # 256 columns
    assert kinds["double_blocks.0.img_attn.qkv.weight"] == "BF16"  # 64 columns
    assert kinds["single_blocks.0.linear2.weight"] == "BF16"  # 320 columns
    theirs = _diffusers_read(tmp_path / "out.gguf")
    for k, kind in kinds.items():
        if kind == "BF16":
            assert torch.equal(theirs[k].to(torch.bfloat16), sd[k]), k
    ours = load_transformer(tmp_path / "out.gguf", device="cpu", dtype=torch.bfloat16)
    assert ours.precision == "gguf-Q4_K"
    assert torch.equal(ours.double_blocks[0].img_attn.qkv.weight, sd["double_blocks.0.img_attn.qkv.weight"])


def test_overwrite(flux1, tmp_path):
    src, _ = flux1(False)
    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"old")
    line = fail("gguf", src, dst, "--type", "Q8_0")
    assert "already exists; pass overwrite (--overwrite)" in line and dst.read_bytes() == b"old"
    run("gguf", src, dst, "--type", "Q8_0", "--overwrite", "-q")
    assert GgufSource(dst).ggml_type("double_blocks.0.img_attn.qkv.weight").name == "Q8_0"


def test_bad_inputs_are_one_line(flux1, tmp_path):
    from tests.weights.vae_fixtures import make_diffusers_vae, save_bfl_vae

    src, _ = flux1(False)
    assert "not a type flux-convert writes" in fail("gguf", src, tmp_path / "a.gguf", "--type", "Q7_X")
    assert "llama-quantize" in fail("gguf", src, tmp_path / "a.gguf", "--type", "IQ4_XS")
    assert "needs --type" in fail("gguf", src, tmp_path / "a.gguf")
    assert "ending in .gguf" in fail("gguf", src, tmp_path / "a.safetensors", "--type", "Q8_0")
    vae = save_bfl_vae(make_diffusers_vae(), tmp_path / "ae.safetensors")
    assert fail("gguf", vae, tmp_path / "a.gguf", "--type", "Q8_0").startswith("Error: ")
    model = make_diffusers_transformer(True)
    sd = {k: v.to(torch.float8_e4m3fn) if ".img_mlp." in k and v.ndim == 2 else v for k, v in tensors(
        save_bfl(model, tmp_path / "bf16.safetensors")).items()}  # fmt: skip
    fp8 = save_tensors(sd, tmp_path / "fp8.safetensors")
    assert "not an FP8 one" in fail("gguf", fp8, tmp_path / "a.gguf", "--type", "Q8_0")
    run("gguf", src, tmp_path / "q.gguf", "--type", "Q8_0", "-q")
    assert "GGUF" in fail("gguf", tmp_path / "q.gguf", tmp_path / "b.gguf", "--type", "Q4_0")
    assert not list(tmp_path.glob("a.*")) and not list(tmp_path.glob("b.*"))
    from click.testing import CliRunner

    from flux_runtime.cli.convert import main

    r = CliRunner().invoke(main, ["transformer", str(src), str(tmp_path / "c"), "--type", "Q8_0"])
    assert r.exit_code == 2 and "--type: only for gguf" in r.output  # a usage error, as click reports them


def test_values_fp16_cannot_hold_are_refused(tmp_path):
    model = make_diffusers_transformer(False)
    with torch.no_grad():
        model.transformer_blocks[0].ff.net[2].weight[0, 0] = 1e6
    src = save_bfl(model, tmp_path / "big.safetensors")
    line = fail("gguf", src, tmp_path / "a.gguf", "--type", "Q8_0")
    assert "double_blocks.0.img_mlp.2.weight" in line and "cannot hold" in line
    assert not list(tmp_path.glob("a.gguf*"))
    run("gguf", src, tmp_path / "b.gguf", "--type", "BF16", "-q")  # bf16 holds it
    assert torch.isfinite(GgufSource(tmp_path / "b.gguf").get("double_blocks.0.img_mlp.2.weight")).all()
