"""Precomputed IP-Adapter image embeddings (`ip_adapter_image_embeds`, `negative_ip_adapter_image_embeds`,
`encode_ip_adapter_image`): the same bits as the image they encode, and as diffusers' FluxPipeline given the
same embeddings; bad embeddings are one-line errors before any model runs; the record fingerprints them and a
replay refuses them."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from flux_runtime.cli.gen import main
from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.pipeline.provenance import check_record, save_png, tensor_fingerprint
from tests.ip_adapter.ip_fixtures import EMBED_DIM, picture
from tests.ip_adapter.test_ip_adapter_parity import CFG, KW, PROMPT, _load_diffusers, _run_diffusers

RUN = dict(seed=42, num_steps=2, guidance=3.5, **KW)


@pytest.fixture(scope="module")
def pipes(ip_files: dict) -> dict[torch.dtype, tuple[Any, Pipeline]]:
    """Per dtype: diffusers' FluxPipeline and ours, each with the adapter loaded at scale 0.7."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ours = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=dtype)
        ours.load_ip_adapter(ip_files["adapter"], 0.7, image_encoder=ip_files["clip"])
        out[dtype] = (_load_diffusers(ip_files, dtype), ours)
    return out


def test_encode_returns_what_diffusers_prepares(pipes: dict) -> None:
    ref, ours = pipes[torch.float32]
    (got,) = ours.encode_ip_adapter_image(picture(1))
    (want,) = ref.prepare_ip_adapter_image_embeds(picture(1), None, torch.device("cpu"), 1)
    assert got.shape == (1, 1, EMBED_DIM) and got.dtype == torch.float16  # the encoder's dtype
    assert not got.requires_grad
    assert torch.equal(got, want)
    assert not torch.equal(got, ours.encode_ip_adapter_image(picture(7))[0])


@pytest.mark.parametrize(
    ("dtype", "call"),
    [
        (torch.float32, {"ip_adapter_image": picture(1)}),
        (torch.float32, {"ip_adapter_image": picture(1), **CFG}),  # the negative branch: a black image
        (
            torch.bfloat16,
            {"ip_adapter_image": picture(1), "negative_ip_adapter_image": picture(9, (30, 30)), **CFG},
        ),
        (torch.bfloat16, {"ip_adapter_image": picture(1), **CFG, "num_images_per_prompt": 2}),
        (torch.bfloat16, {"negative_ip_adapter_image": picture(9), **CFG}),  # a black positive image
    ],
    ids=["fp32", "fp32-cfg", "bf16-cfg-negative", "bf16-cfg-batch2", "bf16-cfg-negative-only"],
)
def test_embeds_give_the_image_bits_and_diffusers_bits(pipes: dict, dtype: torch.dtype, call: dict) -> None:
    """Each image swapped for its embeddings: our latents and images equal the image call's, and diffusers'
    given the same embeddings."""
    ref, ours = pipes[dtype]
    by_image = ours(PROMPT, **RUN, **call)
    embedded = dict(call)
    for role in ("ip_adapter_image", "negative_ip_adapter_image"):
        if role in embedded:
            embedded[role + "_embeds"] = ours.encode_ip_adapter_image(embedded.pop(role))
    got = ours(PROMPT, **RUN, **embedded)
    assert got.latents.dtype == dtype
    assert torch.equal(got.latents, by_image.latents)
    want_latents, want_images = _run_diffusers(ref, 0.7, **embedded)
    assert torch.equal(got.latents, want_latents)
    assert len(got.images) == len(want_images) == call.get("num_images_per_prompt", 1)
    for g, w, i in zip(got.images, want_images, by_image.images, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))
        assert np.array_equal(np.asarray(g), np.asarray(i))


def test_several_images_on_dim_1_and_a_bare_tensor(pipes: dict) -> None:
    """(1, 2, E) is one prompt of two images, as diffusers reads it; a bare tensor is taken as a list of one."""
    ref, ours = pipes[torch.float32]
    (one,), (two,) = ours.encode_ip_adapter_image(picture(1)), ours.encode_ip_adapter_image(picture(7))
    both = [torch.cat([one, two], dim=1)]
    got = ours(PROMPT, **RUN, ip_adapter_image_embeds=both, num_images_per_prompt=2)
    want, _ = _run_diffusers(ref, 0.7, ip_adapter_image_embeds=both, num_images_per_prompt=2)
    assert torch.equal(got.latents, want)
    single = ours(PROMPT, **RUN, ip_adapter_image_embeds=[one], output_type="latent").latents
    assert not torch.equal(got.latents[:1], single)
    bare = ours(PROMPT, **RUN, ip_adapter_image_embeds=one, output_type="latent").latents
    assert torch.equal(bare, single)


def test_embeds_in_another_dtype_follow_diffusers(pipes: dict) -> None:
    """fp32 embeddings into a bf16 pipeline: both cast them to the projection's dtype."""
    ref, ours = pipes[torch.bfloat16]
    embeds = [ours.encode_ip_adapter_image(picture(1))[0].float() * 1.001]
    got = ours(PROMPT, **RUN, ip_adapter_image_embeds=embeds, **CFG)
    want, _ = _run_diffusers(ref, 0.7, ip_adapter_image_embeds=embeds, **CFG)
    assert torch.equal(got.latents, want)


def test_bad_embeds_are_one_line_errors_before_any_model_runs(
    pipes: dict, ip_files: dict, monkeypatch
) -> None:
    _, pipe = pipes[torch.float32]
    plain = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=torch.float32)
    good = [torch.zeros(1, 1, EMBED_DIM)]
    for model in (pipe.transformer, pipe.image_encoder, pipe.text_encoder.t5, pipe.text_encoder.clip):
        monkeypatch.setattr(model, "forward", _no_run)
    cases = [
        (lambda: plain(PROMPT, ip_adapter_image_embeds=good, **RUN), "ip_adapter_image_embeds needs an IP-Adapter"),
        (lambda: plain.encode_ip_adapter_image(picture(1)), "no IP-Adapter is loaded"),
        (
            lambda: pipe(PROMPT, ip_adapter_image=picture(1), ip_adapter_image_embeds=good, **RUN),
            "pass either ip_adapter_image or ip_adapter_image_embeds, not both",
        ),
        (
            lambda: pipe(
                PROMPT, negative_ip_adapter_image=picture(1), negative_ip_adapter_image_embeds=good, **RUN, **CFG
            ),
            "pass either negative_ip_adapter_image or negative_ip_adapter_image_embeds",
        ),
        (
            lambda: pipe(PROMPT, ip_adapter_image_embeds=good * 2, **RUN),
            rf"2 tensors for 1 loaded IP-Adapter; pass a list of one \(1, num_images, {EMBED_DIM}\)",
        ),
        (lambda: pipe(PROMPT, ip_adapter_image_embeds=[], **RUN), "0 tensors for 1 loaded"),
        (
            lambda: pipe(PROMPT, ip_adapter_image_embeds=(good[0],), **RUN),
            "must be a list of one tensor .*encode_ip_adapter_image",
        ),
        (lambda: pipe(PROMPT, ip_adapter_image_embeds=[np.zeros((1, 1, EMBED_DIM))], **RUN), "a list of one tensor"),
        (
            lambda: pipe(PROMPT, ip_adapter_image_embeds=[torch.zeros(1, EMBED_DIM)], **RUN),
            rf"ip_adapter_image_embeds\[0\] must be \(1, num_images, {EMBED_DIM}\) .* got \(1, {EMBED_DIM}\)",
        ),
        (
            lambda: pipe(PROMPT, negative_ip_adapter_image_embeds=[torch.zeros(1, 1, 8)], **RUN, **CFG),
            rf"negative_ip_adapter_image_embeds\[0\] must be \(1, num_images, {EMBED_DIM}\) .*got \(1, 1, 8\)",
        ),
        (
            lambda: pipe(PROMPT, ip_adapter_image_embeds=[torch.zeros(1, 0, EMBED_DIM)], **RUN),
            "must be",
        ),
        (
            lambda: pipe(PROMPT, ip_adapter_image_embeds=[torch.zeros(1, 1, EMBED_DIM, dtype=torch.int64)], **RUN),
            "must be a floating-point tensor, got torch.int64",
        ),
        (
            lambda: pipe(
                [PROMPT, "a cat"], ip_adapter_image_embeds=[torch.zeros(2, 1, EMBED_DIM)], **RUN
            ),
            r"has batch 2, .* put them on dim 1 \(torch.cat\(embeds, dim=1\)\), .* run one call per prompt",
        ),
    ]  # fmt: skip
    for run, message in cases:
        with pytest.raises(FluxError, match=message) as err:
            run()
        assert "\n" not in str(err.value)


def test_under_a_memory_plan(ip_files: dict) -> None:
    """Encoding under an offloading plan (the encoder moved in for it) and a call with embeddings (the encoder
    moved in only for the black negative image) keep the resident image call's bits."""
    from flux_runtime.pipeline.memory import Plan
    from flux_runtime.pipeline.placement import apply_plan

    pipe = Pipeline.from_pretrained(ip_files["pipe"], device="cpu", dtype=torch.float32)
    pipe.load_ip_adapter(ip_files["adapter"], 0.7, image_encoder=ip_files["clip"])
    want = pipe(PROMPT, ip_adapter_image=picture(1), **RUN, **CFG, output_type="latent").latents
    apply_plan(
        pipe, Plan("swap", 1 << 40, text="offloaded", dit="offloaded", together=False), torch.device("cpu")
    )
    embeds = pipe.encode_ip_adapter_image(picture(1))
    got = pipe(PROMPT, ip_adapter_image_embeds=embeds, **RUN, **CFG, output_type="latent").latents
    assert torch.equal(got, want)


def test_flux2_refuses_to_encode_an_image_prompt() -> None:
    flux2 = Pipeline.from_pretrained("tiny-flux2", device="cpu", dtype=torch.float32)
    with pytest.raises(FluxError, match=r"IP-Adapters are for FLUX\.1 models; tiny-flux2 is not one"):
        flux2.encode_ip_adapter_image(picture(1))
    with pytest.raises(FluxError, match="ip_adapter_image_embeds"):
        flux2("a fox", ip_adapter_image_embeds=[torch.zeros(1, 1, EMBED_DIM)])


def _no_run(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a model ran")


def test_the_record_fingerprints_the_embeds_and_a_replay_refuses(pipes: dict, tmp_path) -> None:
    _, pipe = pipes[torch.float32]
    positive, negative = pipe.encode_ip_adapter_image(picture(1)), [torch.randn(1, 2, EMBED_DIM)]
    out = pipe(
        PROMPT, ip_adapter_image_embeds=positive, negative_ip_adapter_image_embeds=negative, **RUN, **CFG
    )
    info = check_record(out.info, "<call>")
    assert info["ip_adapter_images"] == {}
    rec = info["ip_adapter_image_embeds"]
    assert rec["ip_adapter_image_embeds"] == {
        "shape": [1, 1, EMBED_DIM],
        "dtype": "float16",
        "sha256": tensor_fingerprint(positive[0]),
    }
    assert rec["negative_ip_adapter_image_embeds"]["shape"] == [1, 2, EMBED_DIM]
    # the fingerprint is of the values: other values, another dtype or another shape give another one
    t = negative[0]
    header = b"float32:1x2x%d:" % EMBED_DIM
    assert tensor_fingerprint(t) == hashlib.sha256(header + t.numpy().tobytes()).hexdigest()
    assert tensor_fingerprint(t.clone()) == tensor_fingerprint(t)
    others = (t + 1, t.double(), t.reshape(1, 1, -1), t.transpose(0, 1))
    assert len({tensor_fingerprint(o) for o in others} | {tensor_fingerprint(t)}) == 5
    assert tensor_fingerprint(torch.zeros(2, dtype=torch.bfloat16)) != tensor_fingerprint(torch.zeros(2))

    png = tmp_path / "embeds.png"
    save_png(out.images[0], png, out.info)
    res = CliRunner().invoke(main, ["--replay", str(png), "--out", str(tmp_path / "again.png"), "--quiet"])
    assert res.exit_code == 1
    assert "cannot replay" in res.output and "given as embeddings (ip_adapter_image_embeds and " in res.output
    assert "--ip-image" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
