"""Native Qwen3 (FLUX.2 [klein]'s text encoder) against transformers' `Qwen3ForCausalLM`, bit for bit.

Each case builds transformers' model from a small random config (its default attention, SDPA), copies the state
dict into ours and requires `torch.equal` hidden states (`hidden_states[k]`: the residual stream after k layers)
in float32 and bfloat16, without padding, with right padding (the tokenizer's side) and with left padding. Also:
loading from safetensors (only the tensors used are read, the casts, a missing weight), the package's trained tiny
encoder against transformers' load of the same folder, FP8 and memory-plan parts on the native model, and that
neither importing nor building it imports transformers or `torch._dynamo`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from flux_runtime.text import KleinTextEncoder, qwen3_encoder
from flux_runtime.text.chat import load_qwen3_tokenizer
from flux_runtime.text.fp8 import Fp8TextLinear
from flux_runtime.text.llm import tiny_model
from flux_runtime.text.native_weights import load_native
from flux_runtime.text.qwen3_encoder import Qwen3Encoder, Qwen3EncoderConfig
from flux_runtime.weights import WeightsError
from flux_runtime.weights.safetensors_io import TensorSource

ROOT = Path(__file__).resolve().parents[2]
TINY_KLEIN = ROOT / "flux_runtime" / "assets" / "models" / "tiny-flux2" / "text_encoder"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VOCAB = 97
CASES = {  # query/key-value head counts, head widths, biases; "wide" heads exceed SDPA's GQA limit (256)
    "gqa2": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "mha": dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=3, head_dim=8),
    "gqa3-wide-head": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16),
    "mqa-bias": dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=1, head_dim=4, attention_bias=True),
    "gqa-head-above-256": dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=264),
}  # fmt: skip
LAYERS = 5
READ = (0, 2, 4)


def _config(case: dict, layers: int = LAYERS) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB, intermediate_size=40, num_hidden_layers=layers, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, pad_token_id=0, **case,
    )  # fmt: skip


def _pair(case: dict, dtype: torch.dtype, seed: int = 0) -> tuple[Qwen3ForCausalLM, Qwen3Encoder]:
    """transformers' model (seeded weights in `dtype`, RoPE frequencies float32 as from_pretrained keeps them)
    and ours built `max(READ)` layers deep with its weights."""
    config = _config(case)
    ref = tiny_model(Qwen3ForCausalLM, config, seed, dtype).eval()
    ours = qwen3_encoder.build(config.to_dict(), dtype, "cpu", depth=max(READ))
    ours.load_state_dict({k: v for k, v in ref.state_dict().items() if k in ours.state_dict()}, strict=True)
    return ref, ours


def _masks(batch: int, length: int) -> dict[str, torch.Tensor | None]:
    """No mask, all ones (no padding), right padding and left padding (row 0 always full)."""
    right, left = torch.ones(batch, length, dtype=torch.int64), torch.ones(batch, length, dtype=torch.int64)
    for row in range(1, batch):
        right[row, length - 2 * row :] = 0
        left[row, : 2 * row] = 0
    return {"none": None, "ones": torch.ones(batch, length, dtype=torch.int64), "right": right, "left": left}


@torch.no_grad()
def _check(ref: Qwen3ForCausalLM, ours: Qwen3Encoder, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
    want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    got = ours(ids, mask, READ)
    for k, state in zip(READ, got, strict=True):
        assert state.dtype == want[k].dtype and torch.equal(state, want[k]), f"hidden state {k}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_hidden_states_match_transformers(case: dict, dtype: torch.dtype) -> None:
    ref, ours = _pair(case, dtype)
    g = torch.Generator().manual_seed(1)
    for batch, length in ((1, 1), (1, 7), (3, 12)):
        ids = torch.randint(1, VOCAB, (batch, length), generator=g)
        for name, mask in _masks(batch, length).items():
            if length == 1 and name in ("right", "left"):
                continue
            _check(ref, ours, ids, mask)


def test_config_reading_and_refusals() -> None:
    legacy = {"rope_theta": 5e5, "rope_scaling": None, "num_key_value_heads": None, "num_attention_heads": 4}
    cfg = Qwen3EncoderConfig.from_dict(legacy)
    assert cfg.rope_theta == 5e5 and cfg.num_key_value_heads == 4
    v5 = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "head_dim": 8}
    assert Qwen3EncoderConfig.from_dict(v5).rope_theta == 1e6
    for bad, match in (
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "'yarn'"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"hidden_act": "gelu"}, "'gelu'"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "not a multiple"),
    ):
        with pytest.raises(ValueError, match=match):
            Qwen3EncoderConfig.from_dict(bad)
    with pytest.raises(ValueError, match="cannot build the first 9"):
        qwen3_encoder.build({"num_hidden_layers": 8}, torch.float32, "meta", depth=9)
    ours = qwen3_encoder.build(_config(CASES["gqa2"]).to_dict(), torch.float32, "meta", depth=2)
    with pytest.raises(
        ValueError, match=r"hidden states \(3,\) asked of a Qwen3 encoder built 2 layers deep"
    ):
        ours(torch.zeros(1, 2, dtype=torch.int64), None, (3,))


def _save_folder(
    folder: Path, case: dict, dtype: torch.dtype, *, tie: bool = True, layers: int = LAYERS
) -> None:
    """transformers' model (seeded weights in `dtype`) saved as a Qwen3 folder."""
    config = _config(case, layers)
    config.tie_word_embeddings = tie
    tiny_model(Qwen3ForCausalLM, config, 3, dtype).save_pretrained(folder)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_loader_reads_only_what_the_states_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tie: bool
) -> None:
    _save_folder(tmp_path, CASES["gqa2"], torch.float32, tie=tie)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert ("lm_head.weight" in TensorSource(files).keys()) is not tie
    read: list[str] = []
    get = TensorSource.get
    monkeypatch.setattr(
        TensorSource, "get", lambda self, key, *a, **k: (read.append(key), get(self, key, *a, **k))[1]
    )
    model = load_native("qwen3", tmp_path, files, torch.bfloat16, "cpu", "Qwen3 text encoder", depth=3)
    assert isinstance(model, Qwen3Encoder) and model.depth == 3
    assert "model.embed_tokens.weight" in read
    assert sorted(read) == sorted(model.state_dict())  # each needed tensor once, nothing else
    assert not any(k.startswith(("lm_head", "model.norm", "model.layers.3", "model.layers.4")) for k in read)
    # cast as transformers' from_pretrained(dtype=bf16) casts; RoPE frequencies stay float32
    assert (
        all(p.dtype == torch.bfloat16 for p in model.parameters()) and model.inv_freq.dtype == torch.float32
    )
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"


def test_loader_missing_weight_and_bad_config(tmp_path: Path) -> None:
    _save_folder(tmp_path, CASES["gqa2"], torch.float32)
    weights = tmp_path / "model.safetensors"
    kept = {k: v for k, v in load_file(weights).items() if k != "model.layers.1.self_attn.k_norm.weight"}
    save_file(kept, weights, metadata={"format": "pt"})
    with pytest.raises(
        WeightsError, match=r"lacks 1 weights, e\.g\. model\.layers\.1\.self_attn\.k_norm\.weight"
    ):
        load_native("qwen3", tmp_path, [weights], torch.float32, "cpu", "Qwen3 text encoder", depth=3)
    # a layer past the depth read may be missing
    assert load_native("qwen3", tmp_path, [weights], torch.float32, "cpu", "Qwen3 text encoder", depth=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"config\.json: Qwen3 RoPE type 'linear' unsupported"):
        load_native("qwen3", tmp_path, [weights], torch.float32, "cpu", "Qwen3 text encoder", depth=1)


@pytest.mark.parametrize(
    "stored,dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_loaded_model_matches_transformers_from_pretrained(
    tmp_path: Path, stored: torch.dtype, dtype: torch.dtype
) -> None:
    """Ours from the folder against transformers' `from_pretrained(folder, dtype=...)`: the same casts and RoPE."""
    _save_folder(tmp_path, CASES["gqa3-wide-head"], stored)
    ref = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    ours = load_native(
        "qwen3", tmp_path, sorted(tmp_path.glob("*.safetensors")), dtype, "cpu", "Qwen3", depth=4
    )
    assert torch.equal(ours.inv_freq, ref.model.rotary_emb.inv_freq)
    ids = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(4))
    for mask in _masks(3, 10).values():
        _check(ref, ours, ids, mask)


def test_tiny_klein_encoder_matches_transformers() -> None:
    """The package's trained tiny klein encoder (tokenizer and weights), ours against transformers' classes."""
    ours = KleinTextEncoder.from_components(TINY_KLEIN, dtype=torch.float32)
    assert isinstance(ours.model, Qwen3Encoder) and type(ours.tokenizer).__name__ == "FastTokenizer"
    ref_model = Qwen3ForCausalLM.from_pretrained(TINY_KLEIN, dtype=torch.float32)
    ref = KleinTextEncoder(ref_model, load_qwen3_tokenizer(TINY_KLEIN, native=False))
    prompts = ["a red circle", "", "two blue squares 🟦🟦 on grey, {{ braces }} <|im_end|>"]
    assert ours.render(prompts) == ref.render(prompts)
    for a, b in zip(ours.tokenize(prompts, 48), ref.tokenize(prompts, 48), strict=True):
        assert torch.equal(a, b)
    got, want = ours.encode(prompts, max_sequence_length=48), ref.encode(prompts, max_sequence_length=48)
    assert torch.equal(got.prompt_embeds, want.prompt_embeds) and torch.equal(got.text_ids, want.text_ids)
    assert ours.output_dim == ref.output_dim == 96


def test_fp8_and_memory_plan_parts_on_the_native_model() -> None:
    te = KleinTextEncoder.from_components(TINY_KLEIN, dtype=torch.bfloat16)
    roots, layers = te.parts()
    assert roots == [te.model] and layers == list(te.model.model.layers) and len(layers) == 27
    want = te.encode("a red fox in the snow", max_sequence_length=64).prompt_embeds
    assert te.quantize_fp8() == 7 * 27  # q, k, v, o, gate, up, down of every layer read
    assert isinstance(te.model.model.layers[0].self_attn.q_proj, Fp8TextLinear)
    assert not any(isinstance(m, torch.nn.Linear) for layer in layers for m in layer.modules())
    got = te.encode("a red fox in the snow", max_sequence_length=64).prompt_embeds
    cos = torch.nn.functional.cosine_similarity(want.float().flatten(0, 1), got.float().flatten(0, 1), dim=-1)
    assert cos.mean() > 0.98


def test_import_and_meta_build_load_neither_transformers_nor_dynamo() -> None:
    code = (
        "import sys, torch; from flux_runtime.text import qwen3_encoder, flux2;"
        "qwen3_encoder.build({'num_hidden_layers': 4, 'hidden_size': 64, 'head_dim': 16,"
        " 'num_attention_heads': 4, 'num_key_value_heads': 2}, torch.bfloat16, 'meta', 3);"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'transformers' or m == 'torch._dynamo'];"
        "assert not bad, bad"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )


def test_bin_weights_and_other_tokenizer_folders_go_through_transformers(tmp_path: Path) -> None:
    """A `.bin` checkpoint loads into transformers' model, the same bits; a tokenizer folder the native reader
    does not reproduce (here: named chat templates) into transformers' tokenizer."""
    folder = tmp_path / "qwen3"
    shutil.copytree(TINY_KLEIN, folder)
    state = load_file(folder / "model.safetensors")
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    te = KleinTextEncoder.from_components(folder, dtype=torch.float32)
    assert isinstance(te.model, Qwen3ForCausalLM) and type(te.tokenizer).__name__ == "FastTokenizer"
    native = KleinTextEncoder.from_components(TINY_KLEIN, dtype=torch.float32)
    assert torch.equal(te.encode("a cat").prompt_embeds, native.encode("a cat").prompt_embeds)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "other.jinja").write_text("{{ messages[0]['content'] }}")
    tokenizer = load_qwen3_tokenizer(folder)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"


# Qwen3-4B's widths (and 8B's head layout): head_dim 128, 32 query and 8 key/value heads; a few layers.
GPU_CASES = {
    "qwen3-4b": dict(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_cuda_bf16_matches_transformers_at_real_widths(case: dict, tmp_path: Path) -> None:
    """bf16 on CUDA at Qwen3's real widths, 512 tokens: SDPA's kernels for `is_causal` + `enable_gqa` (no
    padding) and for the boolean mask with repeated k/v heads (right padding, as the tokenizer pads). Ours is
    loaded as the pipeline loads it (`load_native` onto CUDA through the pinned ring); transformers' model as
    diffusers gets it (`from_pretrained` on the CPU, then `.cuda()`) and as our transformers fallback does
    (`hf_weights.load_pretrained`: the state dict streamed onto CUDA, `device_map`): the same RoPE frequencies
    and hidden states from all three."""
    from flux_runtime.text.hf_weights import load_pretrained

    config = Qwen3Config(
        vocab_size=1024, intermediate_size=3 * case["hidden_size"], num_hidden_layers=4, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=True, **case,
    )  # fmt: skip
    tiny_model(Qwen3ForCausalLM, config, 0, torch.bfloat16).save_pretrained(tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    ours = load_native("qwen3", tmp_path, files, torch.bfloat16, "cuda", "Qwen3", depth=3)
    refs = {
        "from_pretrained+cuda": Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        .cuda()
        .eval(),
        "load_pretrained(cuda)": load_pretrained(Qwen3ForCausalLM, tmp_path, torch.bfloat16, "cuda")[
            0
        ].eval(),
    }
    ids = torch.randint(0, 1024, (2, 512), generator=torch.Generator().manual_seed(0)).cuda()
    right = torch.ones(2, 512, dtype=torch.int64, device="cuda")
    right[1, 100:] = 0
    for name, ref in refs.items():
        assert torch.equal(ours.inv_freq, ref.model.rotary_emb.inv_freq), name
        for mask in (None, torch.ones_like(right), right):
            with torch.no_grad():
                want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
                got = ours(ids, mask, (1, 2, 3))
            for k, state in zip((1, 2, 3), got, strict=True):
                assert torch.equal(state, want.hidden_states[k]), f"{name}: hidden state {k}"
