"""Parallel pipelines on CPU processes (gloo): the image and latents of rank 0 against one process's.

Rank 0 also builds the one-process pipeline and compares; the other ranks report that they hold no text
encoder and return no image. Runs: FLUX.1 sequence parallel, true CFG split over the two ranks (CFG
parallelism) and with both branches sequence-parallel, inpainting (the start shared from rank 0, the blend
on every rank), FLUX.2 [klein] CFG both ways, and a FLUX.2 reference image (its tokens sharded too).
"""

from __future__ import annotations

import pytest
from PIL import Image

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import pipeline_parity

SIZE = dict(width=64, height=64, num_steps=2)
CFG1 = dict(prompt="a red circle", negative_prompt="a blue square", true_cfg_scale=3.0, **SIZE)
PICTURE = Image.new("RGB", (64, 64), (200, 40, 40))
MASK = Image.new("L", (64, 64), 0)
MASK.paste(255, (16, 16, 48, 48))

RUNS = {
    "flux1-ulysses": ("tiny", {}, dict(prompt="a red circle on the left", **SIZE), (2, False)),
    "flux1-true-cfg": ("tiny", {}, CFG1, (1, True)),
    "flux1-true-cfg-ulysses": ("tiny", {"cfg": False}, CFG1, (2, False)),
    "flux1-inpaint": (
        "tiny",
        {},
        dict(prompt="a star", image=PICTURE, mask_image=MASK, strength=0.9, **SIZE),
        (2, False),
    ),
    "flux2-cfg": ("tiny-flux2", {}, dict(prompt="a green star", **SIZE), (1, True)),
    "flux2-cfg-ulysses": ("tiny-flux2", {"cfg": False}, dict(prompt="a green star", **SIZE), (2, False)),
    "flux2-reference": (
        "tiny-flux2",
        {},
        dict(prompt="the same, in blue", image=PICTURE, guidance=1.0, **SIZE),
        (2, False),
    ),
}


@pytest.fixture(scope="module")
def two_ranks():
    runs = [dict(model=m, parallel=p, call=c) for m, p, c, _ in RUNS.values()]
    return dict(zip(RUNS, zip(*run_ranks(2, pipeline_parity, runs, timeout=600), strict=True), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_rank0_image_equals_one_process(two_ranks, name):
    main, other = two_ranks[name]
    assert main["equal"], f"{name}: max |latent diff| {main['max_diff']}"
    seq, cfg = RUNS[name][3]
    for r in (main, other):
        assert r["info"] == {"world_size": 2, "sequence_parallel": seq, "cfg_parallel": cfg}
    # rank 0 alone holds the text encoders and returns the images
    assert main["text_encoder"] and not main["images_none"]
    assert not other["text_encoder"] and other["images_none"]


@pytest.mark.slow
def test_four_ranks_cfg_and_ulysses_compose():
    runs = [
        dict(
            model="tiny-flux2", parallel={}, call=dict(prompt="a green star", **SIZE)
        ),  # 2 halves x Ulysses-2
        # Ulysses-4, no CFG; at 128² each rank holds 32 tokens (at 64², 20 text rows a rank: fp32 GEMMs of
        # 20 rows round differently from 64 on this CPU's BLAS; measured max |latent diff| 2.7e-6)
        dict(model="tiny", parallel={}, call=dict(prompt="a red circle", width=128, height=128, num_steps=2)),
    ]
    results = run_ranks(4, pipeline_parity, runs, timeout=900)
    assert results[0][0]["equal"] and results[0][1]["equal"]
    assert {tuple(sorted(r[0]["info"].items())) for r in results} == {
        (("cfg_parallel", True), ("sequence_parallel", 2), ("world_size", 4))
    }
    assert {r[1]["info"]["sequence_parallel"] for r in results} == {4}
