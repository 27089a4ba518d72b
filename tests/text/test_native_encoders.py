"""Native T5 / CLIP text encoders against transformers' `T5EncoderModel` / `CLIPTextModel`, bit for bit.

Each case builds transformers' model from a small random config (transformers picks its default attention,
SDPA), copies its state dict into ours and requires `torch.equal` outputs: T5's last hidden state, CLIP's
pooled output and last hidden state. Also: the package's tiny encoders from their safetensors, loading onto a
meta-device model with `assign=True`, checkpoints that store only one tied T5 embedding or CLIP's
`position_ids`, and that importing our modules leaves transformers unimported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from flux_runtime.text import clip_encoder, t5_encoder
from flux_runtime.text.clip_encoder import ClipTextConfig, ClipTextEncoder
from flux_runtime.text.t5_encoder import T5Encoder, T5EncoderConfig

TINY = Path(__file__).resolve().parents[2] / "flux_runtime" / "assets" / "models" / "tiny"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

T5_CASES = {  # odd head counts, 1-3 layers, bucket / max_distance variations, both feed-forwards
    "gated-3heads": dict(d_model=24, d_kv=8, d_ff=40, num_layers=2, num_heads=3, feed_forward_proj="gated-gelu"),
    "relu-1layer": dict(
        d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=5, feed_forward_proj="relu",
        relative_attention_num_buckets=8, relative_attention_max_distance=12,
    ),
    "gated-3layers": dict(
        d_model=32, d_kv=16, d_ff=48, num_layers=3, num_heads=2, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=16, relative_attention_max_distance=20,
    ),
}  # fmt: skip
CLIP_CASES = {
    "legacy-eos": dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
                       hidden_act="quick_gelu", eos_token_id=2),
    "eos-id": dict(hidden_size=20, intermediate_size=36, num_hidden_layers=1, num_attention_heads=5,
                   hidden_act="gelu", eos_token_id=7),
    "3layers": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                    hidden_act="quick_gelu", eos_token_id=89),  # the last id, as in CLIP-L
}  # fmt: skip
VOCAB, MAX_POS = 90, 24


def _ids(batch: int, length: int, eos: int, seed: int) -> Tensor:
    """Random ids (none equal to `eos`, none the largest id), one `eos` at a different place per row, then
    padding: more `eos` in even rows (as CLIP's tokenizer pads), 0 in odd rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 1, (batch, length), generator=g)
    ids[ids == eos] = 3
    for row in range(batch):
        end = max(min(1, length - 1), length - 1 - 3 * row)
        ids[row, end] = eos
        ids[row, end + 1 :] = 0 if row % 2 else eos
    return ids


def _fill(model: nn.Module, seed: int) -> None:
    """Random weights of useful size (norm weights and biases included) so every term reaches the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if "embed" in name or "relative" in name else 0.3
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name else 0.0))


def _t5_pair(case: dict, dtype: torch.dtype, seed: int = 0) -> tuple[nn.Module, T5Encoder]:
    ref = T5EncoderModel(T5Config(vocab_size=VOCAB, dropout_rate=0.0, **case)).eval()
    _fill(ref, seed)
    ref.to(dtype)
    ours = t5_encoder.build(dict(vocab_size=VOCAB, **case), dtype, "cpu")
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _clip_pair(case: dict, dtype: torch.dtype, seed: int = 0) -> tuple[nn.Module, ClipTextEncoder]:
    cfg = dict(vocab_size=VOCAB, max_position_embeddings=MAX_POS, **case)
    ref = CLIPTextModel(CLIPTextConfig(**cfg)).eval()
    _fill(ref, seed)
    ref.to(dtype)
    ours = clip_encoder.build(cfg, dtype, "cpu")
    ours.load_state_dict(_prefixed(ref.state_dict()))
    return ref, ours


def _prefixed(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers 5's CLIPTextModel names (no `text_model.` level) in the original checkpoints' layout."""
    return {("" if k.startswith("text_model.") else "text_model.") + k: v for k, v in sd.items()}


@torch.no_grad()
def _check_t5(ref: nn.Module, ours: T5Encoder, ids: Tensor) -> None:
    want = ref(input_ids=ids).last_hidden_state
    got = ours(ids)
    assert got.dtype == want.dtype and torch.equal(got, want)


@torch.no_grad()
def _check_clip(ref: nn.Module, ours: ClipTextEncoder, ids: Tensor) -> None:
    want = ref(input_ids=ids)
    hidden, pooled = ours.encode(ids)
    assert torch.equal(hidden, want.last_hidden_state)
    assert torch.equal(pooled, want.pooler_output) and torch.equal(ours(ids), pooled)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", T5_CASES.values(), ids=T5_CASES.keys())
def test_t5_matches_transformers(case: dict, dtype: torch.dtype) -> None:
    ref, ours = _t5_pair(case, dtype)
    assert ref.config._attn_implementation == "sdpa"
    for batch, length in ((1, 1), (1, 9), (2, 30)):  # 30 > max_distance: log-spaced and clipped buckets
        _check_t5(ref, ours, _ids(batch, length, eos=1, seed=length))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CLIP_CASES.values(), ids=CLIP_CASES.keys())
def test_clip_matches_transformers(case: dict, dtype: torch.dtype) -> None:
    ref, ours = _clip_pair(case, dtype)
    assert ref.config._attn_implementation == "sdpa"
    for batch, length in ((1, 1), (1, 7), (2, MAX_POS)):
        ids = _ids(batch, length, eos=case["eos_token_id"], seed=length)
        ids[0, 0] = VOCAB - 1  # the legacy argmax picks this one, the eos rule does not
        _check_clip(ref, ours, ids)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_tiny_package_encoders(dtype: torch.dtype) -> None:
    """The shipped tiny CLIP / T5 checkpoints: our build + load_state_dict vs transformers' from_pretrained."""
    for folder, ref_cls, mod, eos in (
        ("text_encoder", CLIPTextModel, clip_encoder, 2),
        ("text_encoder_2", T5EncoderModel, t5_encoder, 1),
    ):
        path = TINY / folder
        ref = ref_cls.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
        ours = mod.build(json.loads((path / "config.json").read_text()), dtype, "cpu")
        ours.load_state_dict(load_file(path / "model.safetensors"))
        vocab = ref.config.vocab_size
        ids = torch.randint(3, vocab, (2, 20), generator=torch.Generator().manual_seed(1))
        ids[:, 12] = vocab - 1 if eos == 2 else eos
        with torch.no_grad():
            want = ref(input_ids=ids)
            got = ours.encode(ids) if eos == 2 else (ours(ids), None)
        assert torch.equal(got[0], want.last_hidden_state)
        if eos == 2:
            assert torch.equal(got[1], want.pooler_output)


def test_meta_build_assign_and_checkpoint_variants() -> None:
    """Streaming load onto the meta device; only one tied T5 embedding; CLIP's stored position_ids."""
    case = T5_CASES["gated-3heads"]
    ref, _ = _t5_pair(case, torch.bfloat16)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    for drop in t5_encoder._TIED:
        part = {k: v for k, v in sd.items() if k != drop}
        ours = t5_encoder.build(dict(vocab_size=VOCAB, **case), torch.bfloat16, "meta")
        result = ours.load_state_dict(part, assign=True)
        assert not result.missing_keys and not result.unexpected_keys
        assert ours.shared is ours.encoder.embed_tokens and not ours.shared.weight.is_meta
        assert all(not t.is_meta for t in ours.state_dict().values())
        _check_t5(ref, ours, _ids(2, 11, eos=1, seed=3))

    ccase = CLIP_CASES["legacy-eos"]
    cref, _ = _clip_pair(ccase, torch.bfloat16)
    csd = _prefixed(cref.state_dict())
    assert "text_model.embeddings.position_ids" not in csd  # non-persistent in transformers
    csd["text_model.embeddings.position_ids"] = torch.arange(MAX_POS)[
        None
    ]  # as original CLIP-L files hold it
    ours_clip = clip_encoder.build(
        dict(vocab_size=VOCAB, max_position_embeddings=MAX_POS, **ccase), torch.bfloat16
    )
    result = ours_clip.load_state_dict(csd, assign=True)
    assert not result.missing_keys and not result.unexpected_keys
    _check_clip(cref, ours_clip, _ids(2, 9, eos=2, seed=4))
    assert set(ours_clip.state_dict()) == set(cref.state_dict())  # transformers 5's names, loaded from either


def test_names_types_and_dtypes() -> None:
    """State-dict names equal transformers'; nn.Linear where it has them; fp16 keeps T5's `wo` in fp32."""
    ref, ours = _t5_pair(T5_CASES["gated-3layers"], torch.float32)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ref_linear = {n for n, m in ref.named_modules() if isinstance(m, nn.Linear)}
    assert ref_linear == {n for n, m in ours.named_modules() if isinstance(m, nn.Linear)}
    half = t5_encoder.build(ours.config, torch.float16, "meta")
    wo = {n: p.dtype for n, p in half.named_parameters() if n.endswith(".wo.weight")}
    assert wo and set(wo.values()) == {torch.float32}
    assert {p.dtype for n, p in half.named_parameters() if n not in wo} == {torch.float16}
    cref, cours = _clip_pair(CLIP_CASES["3layers"], torch.float32)
    assert list(cours.state_dict()) == list(cref.state_dict())
    kinds = (nn.Linear, nn.LayerNorm, nn.Embedding)
    ref_names = {n for n, m in cref.named_modules() if isinstance(m, kinds)}
    assert ref_names == {n for n, m in cours.named_modules() if isinstance(m, kinds)}


def test_t5_eager_variant_matches_transformers_eager_fp32() -> None:
    """The pre-SDPA variant (transformers <= 5.14) against today's eager T5, the same ops in fp32 (in bf16 the
    new eager takes its softmax in bf16, the old one in fp32)."""
    case = T5_CASES["gated-3layers"]
    config = T5Config(vocab_size=VOCAB, dropout_rate=0.0, **case)
    ref = T5EncoderModel._from_config(config, attn_implementation="eager").eval()
    assert ref.config._attn_implementation == "eager"
    _fill(ref, 0)
    ours = t5_encoder.build(dict(vocab_size=VOCAB, **case), torch.float32, "cpu", attention="eager")
    ours.load_state_dict(ref.state_dict())
    _check_t5(ref, ours, _ids(2, 30, eos=1, seed=5))


def test_attention_variant_by_version() -> None:
    pick = t5_encoder.attention_for_transformers
    assert [pick(v) for v in ("5.7.0", "5.14.1", "5.15.0", "5.17.0", "5.19.0", "5.20.0", "5.25.0", "6.0")] == [
        "eager", "eager", "sdpa-strided", "sdpa-strided", "sdpa-strided", "sdpa", "sdpa", "sdpa",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'flash'"):
        T5Encoder(T5EncoderConfig(), attention="flash")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="'gated-silu'"):
        T5EncoderConfig.from_dict({"feed_forward_proj": "gated-silu"})
    with pytest.raises(ValueError, match="'gelu_new'"):
        ClipTextConfig.from_dict({"hidden_act": "gelu_new"})
    assert ClipTextConfig.from_dict({"text_config": {"hidden_size": 8}}).hidden_size == 8


def test_import_does_not_load_transformers() -> None:
    code = (
        "import sys, flux_runtime.text.t5_encoder, flux_runtime.text.clip_encoder;"
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}
    )


# Head size 64 as in T5-XXL and CLIP-L, so CUDA's SDPA picks the kernels the real encoders get.
GPU_T5 = {
    **T5_CASES,
    "d_kv64": dict(d_model=128, d_kv=64, d_ff=256, num_layers=2, num_heads=2, feed_forward_proj="gated-gelu"),
}
GPU_CLIP = {
    **CLIP_CASES,
    "head64": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_act="quick_gelu",
        eos_token_id=2,
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["t5", "clip"])
def test_cuda_bf16_matches_transformers(kind: str) -> None:
    """bf16 on CUDA (SDPA picks a GPU kernel: mem-efficient for T5's float mask, flash/cuDNN for CLIP)."""
    cases = GPU_T5 if kind == "t5" else GPU_CLIP
    for case in cases.values():
        ref, ours = (_t5_pair if kind == "t5" else _clip_pair)(case, torch.bfloat16)
        ref, ours = ref.cuda(), ours.cuda()
        for batch, length in ((1, 1), (2, 9), (2, MAX_POS)):
            ids = _ids(batch, length, eos=1 if kind == "t5" else case["eos_token_id"], seed=length).cuda()
            (_check_t5 if kind == "t5" else _check_clip)(ref, ours, ids)
