"""GGUF transformers: city96-style files load kept quantized and run bit-identical to diffusers' GGUF loader."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from flux_runtime.kernels.dispatch import fused_ops_report, reset_fused_ops_report, use_fused
from flux_runtime.models.dit.layers import GgufLinear
from flux_runtime.weights.errors import WeightsError
from flux_runtime.weights.gguf_file import GgufSource
from flux_runtime.weights.transformer import load_transformer
from tests.flux1_fixtures import make_diffusers_transformer, make_inputs
from tests.gguf_fixtures import (
    QUANT_NAMES,
    city96_types,
    diffusers_gguf_transformer,
    encode_all,
    gguf,
    random_blocks,
    write_encoded,
    write_flux1_pair,
    write_gguf,
    write_pair,
)

pytest.importorskip("diffusers")

# K-quant blocks hold 256 values: the tiny model is widened so that its projections' rows hold whole blocks
WIDE = dict(
    attention_head_dim=128, joint_attention_dim=256, pooled_projection_dim=256, axes_dims_rope=(16, 56, 56)
)


def _model(main: str):
    return make_diffusers_transformer(True, **(WIDE if main.endswith("_K") else {}))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Per quantization type: (diffusers model, BFL-named file, diffusers-named file, config folder), built once."""
    made: dict[str, tuple] = {}

    def get(main: str):
        if main not in made:
            model = _model(main)
            made[main] = (model, *write_flux1_pair(model, tmp_path_factory.mktemp(main), main))
        return made[main]

    return get


def _inputs(model, dtype: torch.dtype):
    img, img_ids, txt, txt_ids, t, y, g = make_inputs(1, 4, 4, 8, dtype)
    width = model.config.joint_attention_dim
    gen = torch.Generator().manual_seed(1)
    txt = torch.randn(1, 8, width, generator=gen).to(dtype)
    y = torch.randn(1, model.config.pooled_projection_dim, generator=gen).to(dtype)
    return img, img_ids, txt, txt_ids, t, y, g


def _outputs(ours, ref, inputs):
    img, img_ids, txt, txt_ids, t, y, g = inputs
    with torch.no_grad():
        want = ref(
            hidden_states=img, encoder_hidden_states=txt, pooled_projections=y, timestep=t,
            img_ids=img_ids, txt_ids=txt_ids, guidance=g, return_dict=False,
        )[0]  # fmt: skip
        got = ours(img, img_ids, txt, txt_ids, t, y, g)
    return got, want


@pytest.mark.parametrize("main", QUANT_NAMES)
def test_every_type_loads_quantized_and_dequantizes_as_diffusers(pairs, main):
    """bf16 compute: every projection holds its blocks (uint8) and its weight is `torch.equal` to the
    weight diffusers' GGUFLinear multiplies by (its q, k, v rows stacked as BFL fuses them); the output too."""
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    model, bfl, dif, cfg = pairs(main)
    dtype = torch.bfloat16
    ours = load_transformer(bfl, device="cpu", dtype=dtype)
    ref = diffusers_gguf_transformer(dif, cfg, dtype)
    assert ours.precision == f"gguf-{main}"
    qkv = ours.double_blocks[0].img_attn.qkv
    assert isinstance(qkv, GgufLinear) and qkv.qweight.dtype == torch.uint8 and qkv.ggml_type.name == main
    attn = ref.transformer_blocks[0].attn
    theirs = [dequantize_gguf_tensor(m.weight).to(m.compute_dtype) for m in (attn.to_q, attn.to_k, attn.to_v)]
    assert torch.equal(qkv.weight, torch.cat(theirs))
    lin2, proj = ours.single_blocks[1].linear2, ref.single_transformer_blocks[1].proj_out
    assert torch.equal(lin2.weight, dequantize_gguf_tensor(proj.weight).to(dtype))
    assert ours.double_blocks[0].img_attn.norm.query_norm.scale.dtype == dtype  # F32 in the file: plain
    got, want = _outputs(ours, ref, _inputs(model, dtype))
    assert torch.isfinite(want).all() and torch.equal(got, want)


@pytest.mark.parametrize("main", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_transformer_output_is_bit_identical_to_diffusers(pairs, main, dtype):
    """The transformer's output from the BFL-named file (city96's) and the same bytes under diffusers' names,
    against diffusers' `from_single_file` with `GGUFQuantizationConfig(compute_dtype=dtype)`."""
    model, bfl, dif, cfg = pairs(main)
    ref = diffusers_gguf_transformer(dif, cfg, dtype)
    inputs = _inputs(model, dtype)
    for path in (bfl, dif):
        ours = load_transformer(path, device="cpu", dtype=dtype)
        got, want = _outputs(ours, ref, inputs)
        assert got.dtype == dtype and torch.equal(got, want), path.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wide_types_stored_2d_load_plain_and_match_diffusers(tmp_path, dtype):
    """2-D weights stored BF16, F16 or F32 beside Q5_0 ones: plain Linear weights here (diffusers dequantizes
    its BF16 ones before each matmul, exactly), the output bit-identical all the same."""
    model = _model("Q5_0")
    base = city96_types("Q5_0")
    wide = {"txt_in.weight": "BF16", "img_in.weight": "F16", "final_layer.linear.weight": "F32"}

    def type_of(name: str, shape: tuple[int, ...]) -> str:
        return wide.get(name) or ("BF16" if ".img_mlp." in name and len(shape) == 2 else base(name, shape))

    bfl, dif, cfg = write_pair(model, tmp_path, "Q5_0", type_of=type_of)
    src = GgufSource(bfl)
    assert [src.ggml_type(k).name for k in wide] == list(wide.values())
    ours = load_transformer(bfl, device="cpu", dtype=dtype)
    assert ours.precision == "gguf-Q5_0"
    for name in [*wide, "double_blocks.0.img_mlp.0.weight"]:
        layer = ours.get_submodule(name.removesuffix(".weight"))
        assert not isinstance(layer, GgufLinear) and layer.weight.dtype == dtype, name
    ref = diffusers_gguf_transformer(dif, cfg, dtype)
    got, want = _outputs(ours, ref, _inputs(model, dtype))
    assert torch.equal(got, want)


def test_mixed_types_and_the_precision_name(tmp_path):
    """A Q4_K file whose narrow rows fall back to Q8_0 (as quantizers do) and whose 2-D F16 tensors stay plain:
    the precision names the dominant type, `gguf_types` counts every one."""
    model = _model("Q4_K")
    from flux_runtime.weights import flux1_layout
    from tests.random_models import bfl_transformer_state_dict

    sd = bfl_transformer_state_dict(model, flux1_layout, "guidance_embeds")
    base = city96_types("Q4_K")

    def type_of(name: str, shape: tuple[int, ...]) -> str:
        return "F16" if name.startswith("final_layer.") and len(shape) == 2 else base(name, shape)

    ours = load_transformer(
        write_gguf(sd, tmp_path / "mixed.gguf", type_of), device="cpu", dtype=torch.float32
    )
    assert ours.precision == "gguf-Q4_K"
    assert set(ours.gguf_types) == {"Q4_K", "Q8_0"} and ours.gguf_types["Q8_0"] == 256 * 64  # img_in
    assert not isinstance(ours.final_layer.linear, GgufLinear)
    assert ours.final_layer.linear.weight.dtype == torch.float32


def test_reader_lists_tensors_in_torch_order(pairs):
    """Names, types and (rows, cols) shapes as the file holds them; quantized data as uint8 block rows."""
    _, bfl, _, _ = pairs("Q8_0")
    src = GgufSource(bfl)
    assert src.ggml_type("double_blocks.0.img_attn.qkv.weight").name == "Q8_0"
    assert src.shape("double_blocks.0.img_attn.qkv.weight") == (192, 64)
    assert src.raw("double_blocks.0.img_attn.qkv.weight").shape == (192, 2 * 34)
    assert src.dtype("double_blocks.0.img_attn.qkv.weight") == "F16"  # the values' dtype
    assert src.dtype("double_blocks.0.img_attn.qkv.bias") == "F32"
    assert not src.is_quantized("double_blocks.0.img_attn.qkv.bias")


def test_the_memory_plan_counts_quantized_weights_as_stored(pairs):
    """The placement's estimate of the loaded transformer: blocks at their stored size, the rest in the dtype."""
    from flux_runtime.pipeline.placement import checkpoint_bytes
    from flux_runtime.weights.checkpoint import open_transformer

    _, bfl, _, _ = pairs("Q8_0")
    ckpt = open_transformer(bfl)
    ours = load_transformer(ckpt, device="cpu", dtype=torch.float32)
    loaded = sum(t.numel() * t.element_size() for t in (*ours.parameters(), *ours.buffers()))
    assert checkpoint_bytes(ckpt, torch.float32, False) == loaded


# ----------------------------------------------------------------------------------------------
# bad files: one line naming the file and the tensor


@pytest.fixture
def small_file(tmp_path):
    model = make_diffusers_transformer(True)
    from flux_runtime.weights import flux1_layout
    from tests.random_models import bfl_transformer_state_dict

    return bfl_transformer_state_dict(model, flux1_layout, "guidance_embeds"), tmp_path


def test_a_truncated_file_names_the_tensor_cut_short(small_file):
    sd, tmp = small_file
    path = write_gguf(sd, tmp / "t.gguf", city96_types("Q8_0"))
    data = path.read_bytes()
    last = list(sd)[-1]
    cut = tmp / "cut.gguf"
    cut.write_bytes(data[: len(data) - 7])
    with pytest.raises(
        WeightsError, match=rf"cut.gguf: the file is truncated: {last} ends at byte \d+, the file has \d+"
    ) as e:
        load_transformer(cut, device="cpu", dtype=torch.float32)
    assert "\n" not in str(e.value)
    head = tmp / "head.gguf"
    head.write_bytes(data[:20])
    with pytest.raises(WeightsError, match=r"head.gguf: cannot read the GGUF file"):
        GgufSource(head)


def test_an_unsupported_type_names_the_tensor(small_file):
    sd, tmp = small_file
    entries = encode_all(sd, city96_types("Q8_0"))
    name = "double_blocks.1.txt_mlp.0.weight"
    rows, cols = sd[name].shape
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    entries[name] = ("IQ4_NL", np.zeros((rows, cols // block * size), dtype=np.uint8))
    path = write_encoded(entries, tmp / "iq.gguf")
    with pytest.raises(
        WeightsError,
        match=rf"iq.gguf: {name} is stored as GGML IQ4_NL, which is not supported \(supported: F32, F16, BF16, Q4_0",
    ):
        load_transformer(path, device="cpu", dtype=torch.float32)


def test_a_tensor_of_the_wrong_shape_is_named(small_file):
    sd, tmp = small_file
    sd["double_blocks.0.img_mlp.2.weight"] = torch.randn(64, 96)  # the MLP is 256 wide
    path = write_gguf(sd, tmp / "shape.gguf", city96_types("Q8_0"))
    with pytest.raises(
        WeightsError,
        match=r"double_blocks.0.img_mlp.2.weight: expected shape \(64, 256\), checkpoint has \(64, 96\)",
    ):
        load_transformer(path, device="cpu", dtype=torch.float32)


def test_rows_that_are_not_whole_blocks_are_named(small_file):
    """A Q8_0 tensor whose stated rows (48 values) are not a whole number of 32-value blocks: its dims edited
    in place through the package's own reader (the writer cannot make such a file)."""
    sd, tmp = small_file
    path = write_gguf(sd, tmp / "rows.gguf", city96_types("Q8_0"))
    name = "double_blocks.0.img_mlp.0.weight"  # (256, 64) in Q8_0
    reader = gguf.GGUFReader(str(path), "r+")
    dims = next(t for t in reader.tensors if t.name == name).field.parts[3]
    dims[:] = [48, 256]
    reader.data.flush()
    del reader
    with pytest.raises(
        WeightsError,
        match=rf"rows.gguf: {name} has shape \[\d+, 48\], whose rows are not a whole number of Q8_0 blocks of 32",
    ):
        load_transformer(path, device="cpu", dtype=torch.float32)


def test_an_infinite_scale_in_a_quantized_weight_is_named(small_file):
    """One Q8_0 block whose fp16 scale is +inf: refused at load like any non-finite weight, naming the tensor."""
    sd, tmp = small_file
    entries = encode_all(sd, city96_types("Q8_0"))
    name = "single_blocks.1.linear2.weight"
    kind, data = entries[name]
    data = data.copy()
    data[3, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    entries[name] = (kind, data)
    path = write_encoded(entries, tmp / "inf.gguf")
    with pytest.raises(WeightsError, match=rf"inf.gguf: {name} holds NaN or infinite values in float16"):
        load_transformer(path, device="cpu", dtype=torch.float32)


def test_fp8_on_a_gguf_file_and_a_missing_gguf_package_are_one_line_errors(small_file, monkeypatch):
    sd, tmp = small_file
    path = write_gguf(sd, tmp / "q.gguf", city96_types("Q8_0"))
    with pytest.raises(WeightsError, match="already quantized; load it without fp8"):
        load_transformer(path, device="cpu", dtype=torch.bfloat16, fp8=True)
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(
        WeightsError, match=r"needs the gguf extra \(gguf is missing\): pip install 'flux-runtime\[gguf\]'"
    ):
        load_transformer(path, device="cpu", dtype=torch.float32)


def test_k_quant_blocks_of_the_fixtures_are_finite():
    """The random K-quant blocks the tests use decode to finite values of a sane size."""
    from flux_runtime.kernels import gguf_dequant

    for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        w = gguf_dequant.dequantize(
            torch.from_numpy(random_blocks(name, 4, 512, 0)), gguf_dequant.BY_NAME[name]
        )
        assert torch.isfinite(w).all() and 0 < w.abs().max() < 1, name


def test_a_lora_fuses_into_the_dequantized_layers_it_touches(pairs, tmp_path):
    """A LoRA on a GGUF transformer: each layer it touches becomes a plain one holding its dequantized weight
    (diffusers' dequantization) with the LoRA fused there, as into a bf16 model of those weights; the other
    layers stay quantized; unfusing puts the GGUF layers back, bit for bit."""
    from flux_runtime.models.dit import Flux1Transformer
    from flux_runtime.weights.lora import FusedState, unfuse
    from tests.lora import lora_fixtures as lf

    model, bfl, _, _ = pairs("Q8_0")
    dtype = torch.float32
    ours = load_transformer(bfl, device="cpu", dtype=dtype)
    plain: dict[str, torch.Tensor] = {}  # the same model with every GGUF weight dequantized once
    for name, module in ours.named_modules():
        if isinstance(module, GgufLinear):
            plain[f"{name}.weight"] = module.weight
    plain.update({k: v for k, v in ours.state_dict().items() if not k.endswith(".qweight")})
    with torch.device("meta"):
        dense = Flux1Transformer(ours.config)
    dense.load_state_dict(plain, strict=True, assign=True)
    img, img_ids, txt, txt_ids, t, y, g = _inputs(model, dtype)
    with torch.no_grad():
        before = ours(img, img_ids, txt, txt_ids, t, y, g)
    touched = ["double_blocks.0.img_attn.qkv", "single_blocks.1.linear1", "double_blocks.1.txt_mlp.2"]
    lora = lf.bfl_file(tmp_path / "lora.safetensors", lf.linear_shapes(ours), touched)
    state, dense_state = FusedState(), FusedState()
    report, _, _ = lf.fuse_file(ours, lora, 0.8, state)
    lf.fuse_file(dense, lora, 0.8, dense_state)
    assert report.gguf_layers == 3
    assert not isinstance(ours.get_submodule(touched[0]), GgufLinear)
    assert isinstance(ours.double_blocks[0].txt_attn.qkv, GgufLinear)  # untouched: still quantized
    with torch.no_grad():
        got = ours(img, img_ids, txt, txt_ids, t, y, g)
        want = dense(img, img_ids, txt, txt_ids, t, y, g)
    assert torch.equal(got, want) and not torch.equal(got, before)
    unfuse(ours, None, state)
    assert isinstance(ours.get_submodule(touched[0]), GgufLinear)
    with torch.no_grad():
        assert torch.equal(ours(img, img_ids, txt, txt_ids, t, y, g), before)


@pytest.mark.gpu
@pytest.mark.parametrize("main", ["Q8_0", "Q4_K", "Q6_K"])
def test_on_a_gpu_the_output_is_bit_identical_to_diffusers(pairs, main):
    """On CUDA in bf16: the blocks stay uint8 on the GPU and the output equals diffusers' GGUF load on the same
    GPU (its torch dequantization; DIFFUSERS_GGUF_CUDA_KERNELS unset, as by default)."""
    model, bfl, dif, cfg = pairs(main)
    dtype = torch.bfloat16
    ours = load_transformer(bfl, device="cuda", dtype=dtype)
    qkv = ours.double_blocks[0].img_attn.qkv
    assert qkv.qweight.device.type == "cuda" and qkv.qweight.dtype == torch.uint8
    ref = diffusers_gguf_transformer(dif, cfg, dtype).to("cuda")
    inputs = [x.to("cuda") for x in _inputs(model, dtype)]
    got, want = _outputs(ours, ref, inputs)
    assert torch.equal(got, want)
    # the lossless tier: every projection's weight from the fused dequantization kernel, verified on first use
    reset_fused_ops_report(forget_signatures=True)
    with torch.no_grad(), use_fused("lossless"):
        for _ in range(2):
            assert torch.equal(ours(*inputs), want)
    report = fused_ops_report()
    assert report.fused_calls.get("gguf_dequant", 0) > 0 and not report.mismatches, str(report)
    assert not [k for k in report.fallbacks if k[0] == "gguf_dequant"], str(report)
