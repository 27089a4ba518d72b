"""Step caching in parallel runs on CPU processes (gloo): each branch's ranks decide together from the whole
image's means (an all-reduce), so rank 0's latents, image and record equal one process's cached call, for
Ulysses, CFG parallelism and both, with a threshold, the Taylor forecast and a forced pattern."""

from __future__ import annotations

import pytest

from scripts.bench_cache import Skips
from tests.parallel.ranks import run_ranks
from tests.parallel.workers import pipeline_parity

SIZE = dict(width=64, height=64, num_steps=6)
CFG1 = dict(prompt="a red circle", negative_prompt="a blue square", true_cfg_scale=3.0, **SIZE)

RUNS = {
    "flux1-ulysses-first-block": ("tiny", {}, dict(prompt="a red circle", cache="first-block:threshold=0.3", **SIZE)),
    "flux1-cfg-parallel-skips": ("tiny", {}, dict(**CFG1, cache=Skips(skip=(2, 3)))),
    "flux1-cfg-ulysses-taylor": ("tiny", {"cfg": False}, dict(**CFG1, cache="taylor:order=2,refresh=2")),
    "flux2-ulysses-first-block": (
        "tiny-flux2", {"cfg": False}, dict(prompt="a green star", cache="first-block:threshold=0.3", **SIZE)
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks():
    runs = [dict(model=m, parallel=p, call=c) for m, p, c in RUNS.values()]
    return dict(zip(RUNS, zip(*run_ranks(2, pipeline_parity, runs, timeout=900), strict=True), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_cached_parallel_run_equals_one_process(two_ranks, name):
    main, other = two_ranks[name]
    assert main["equal"], f"{name}: max |latent diff| {main['max_diff']}"
    # both ranks recorded the steps one process computed (rank 1's record is that of the branch it ran)
    record = main["one_cache"]
    assert main["cache"] == record
    branches = record.get("branches", {"cond": record})
    computed = [b["computed_steps"] for b in branches.values()]
    assert all(len(c) < SIZE["num_steps"] for c in computed), "nothing was skipped: the test shows nothing"
    if "branches" in other["cache"] or main["info"]["cfg_parallel"] is False:
        assert other["cache"] == record
    else:  # CFG parallelism: rank 1 ran the negative branch alone
        assert other["cache"]["computed_steps"] == branches["uncond"]["computed_steps"]
