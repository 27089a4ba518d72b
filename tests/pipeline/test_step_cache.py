"""Step caching through the pipelines of every family: exact when nothing is skipped, the skipped steps really
skip the rest of the transformer, each CFG branch has its own cache, memory plans keep the bits, and the record,
the CLI and replay carry the policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flux_runtime.cli.gen import main
from flux_runtime.pipeline import FluxError, Pipeline
from flux_runtime.pipeline.memory import Plan, spread
from flux_runtime.pipeline.placement import apply_plan, footprint
from flux_runtime.pipeline.provenance import read_provenance
from flux_runtime.sampling.step_cache import FirstBlockCache
from scripts.bench_cache import Skips  # a forced pattern: random weights show no real redundancy

MODELS = ("tiny", "tiny-flux2", "tiny-flux3-random")
KW = dict(num_steps=5, height=32, width=32, seed=2, output_type="latent")


@pytest.fixture(scope="module", params=MODELS)
def pipe(request: pytest.FixtureRequest) -> Pipeline:
    return Pipeline.from_pretrained(request.param, device="cpu", dtype=torch.float32)


def _cfg(pipe: Pipeline) -> dict:
    """Arguments that make the call run two branches (true CFG on FLUX.1; FLUX.2 klein and FLUX.3 base guide
    by default)."""
    return dict(negative_prompt="blurry", true_cfg_scale=2.0) if pipe.family == "flux1" else {}


@pytest.mark.parametrize("spec", ["first-block:threshold=0", "taylor:refresh=1,order=2"])
def test_a_cache_that_never_skips_changes_no_bit(pipe: Pipeline, spec: str) -> None:
    want = pipe("a red circle", **KW, **_cfg(pipe))
    got = pipe("a red circle", **KW, **_cfg(pipe), cache=spec)
    assert torch.equal(got.latents, want.latents)
    assert want.info["cache"] == "off"
    record = got.info["cache"]
    assert record["spec"].startswith(spec.split(":")[0]) and set(record["branches"]) == {"cond", "uncond"}
    for branch in record["branches"].values():
        assert branch == {"computed_steps": list(range(5)), "calls": 5}


def test_skipped_steps_run_only_the_probe(pipe: Pipeline) -> None:
    """On a skipped step the transformer runs its probe block and no other: counted by forward hooks."""
    dit = pipe.transformer
    if pipe.family == "flux3":
        probe, rest = dit.content_mode_blocks["image"][0], list(dit.single_blocks)
    else:
        probe, rest = dit.double_blocks[0], [*dit.double_blocks[1:], *dit.single_blocks]
    calls = {"probe": 0, "rest": 0}
    hooks = [probe.register_forward_hook(lambda *a: calls.__setitem__("probe", calls["probe"] + 1))]
    hooks += [m.register_forward_hook(lambda *a: calls.__setitem__("rest", calls["rest"] + 1)) for m in rest]
    try:
        out = pipe("a red circle", **KW, cache=Skips(skip=(2, 3)))
    finally:
        for h in hooks:
            h.remove()
    branches = out.info["cache"].get("branches", {"cond": out.info["cache"]})
    for branch in branches.values():
        assert branch["computed_steps"] == [0, 1, 4]
    assert calls == {"probe": 5 * len(branches), "rest": 3 * len(branches) * len(rest)}
    assert torch.isfinite(out.latents).all()
    assert not torch.equal(out.latents, pipe("a red circle", **KW).latents)


def test_each_branch_keeps_its_own_cache(pipe: Pipeline) -> None:
    """With two branches, the conditional and the unconditional remainders are cached apart: skipping a step
    in both equals what a pipeline that reuses each branch's own last remainder gives, step by step."""
    out = pipe("a red circle", **KW, **_cfg(pipe), cache=Skips(skip=(3,)))
    assert out.info["cache"]["branches"]["uncond"]["computed_steps"] == [0, 1, 2, 4]
    again = pipe("a red circle", **KW, **_cfg(pipe), cache=Skips(skip=(3,)))
    assert torch.equal(out.latents, again.latents)  # nothing left over between calls


def test_memory_plans_keep_the_bits_of_a_cached_call() -> None:
    """A streamed transformer under a skip pattern: the ring of streamed blocks restarts after a skipped step,
    and the latents equal the resident pipeline's."""
    ref = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    policy = Skips(skip=(2, 3))
    want = ref("a red circle", **KW, cache=policy).latents
    nd = len(footprint(pipe).dit.layers)
    for streamed, slots in ((spread(nd, nd), 2), ((0, 2, 3), 1)):
        plan = Plan("stream", 1 << 40, text="offloaded", dit="streamed", streamed_dit=streamed, slots=slots)
        apply_plan(pipe, plan, torch.device("cpu"))
        assert torch.equal(pipe("a red circle", **KW, cache=policy).latents, want), plan.describe()


def test_cache_set_on_the_pipeline_and_switched_off_per_call() -> None:
    pipe = Pipeline.from_pretrained(
        "tiny", device="cpu", dtype=torch.float32, cache="first-block:threshold=0.2"
    )
    assert pipe.cache == FirstBlockCache(threshold=0.2)
    assert pipe("a red circle", **KW).info["cache"]["policy"] == "first-block"
    assert pipe("a red circle", **KW, cache="off").info["cache"] == "off"


def test_bad_caches_fail_before_any_model_work() -> None:
    with pytest.raises(FluxError, match="unknown cache policy 'teacache'"):
        Pipeline.from_pretrained("tiny", device="cpu", cache="teacache")
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    with pytest.raises(FluxError, match=r"threshold 3\.0 is out of range"):
        pipe("a red circle", **KW, cache="first-block:threshold=3")
    depth = pipe.transformer.max_probe_blocks
    with pytest.raises(FluxError, match=f"probe={depth + 1} is deeper than tiny's {depth} probe-able blocks"):
        pipe("a red circle", **KW, cache=f"first-block:probe={depth + 1}")


def test_flux_gen_cache_is_recorded_and_replayed(tmp_path: Path) -> None:
    runner = CliRunner()
    png, again = tmp_path / "a.png", tmp_path / "b.png"
    args = ["--model", "tiny", "--prompt", "a red circle", "--steps", "5", "--width", "32", "--height", "32"]
    result = runner.invoke(
        main, [*args, "--cache", "first-block:threshold=0.5", "--out", str(png), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    record = read_provenance(png)["cache"]
    assert record["spec"] == "first-block:warmup=1,last=1,probe=1,threshold=0.5"
    assert record["computed_steps"][0] == 0 and record["computed_steps"][-1] == 4
    result = runner.invoke(main, ["--replay", str(png), "--out", str(again), "--quiet"])
    assert result.exit_code == 0, result.output
    assert read_provenance(again)["cache"] == record
    assert png.read_bytes() == again.read_bytes() or _same_pixels(png, again)
    bad = runner.invoke(main, [*args, "--cache", "taylor:refresh=0", "--out", str(tmp_path / "c.png")])
    assert bad.exit_code == 2 and "taylor refresh=0 is out of range" in bad.output
    assert not (tmp_path / "c.png").exists()


def _same_pixels(a: Path, b: Path) -> bool:
    import numpy as np
    from PIL import Image

    return np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["tiny", "tiny-flux2"])
@pytest.mark.parametrize(("quality", "fp8"), [("lossless", False), ("high", False), ("lossless", True)])
def test_gpu_a_cache_that_never_skips_changes_no_bit(model: str, quality: str, fp8: bool) -> None:
    """On CUDA, with the fused kernels (the probe's pending residual written out beside the fused path), in
    bf16 and FP8, both under CUDA graphs (the cached call's split at the probe): the same latents as the uncached
    call; a skip pattern gives the eager cached call's latents bit for bit and stays finite."""
    pipe = Pipeline.from_pretrained(model, device="cuda", quality=quality, fp8=fp8)
    eager = Pipeline.from_pretrained(model, device="cuda", quality=quality, fp8=fp8, cuda_graphs=False)
    kw = dict(num_steps=8, height=128, width=128, seed=1, output_type="latent")
    want = pipe("a red circle", **kw)
    got = pipe("a red circle", **kw, cache="first-block:threshold=0")
    assert want.info["cuda_graphs"] and got.info["cuda_graphs"]
    assert torch.equal(got.latents, want.latents)
    for policy in (Skips(skip=(3, 5)), "taylor:order=2,refresh=3"):
        skipped = pipe("a red circle", **kw, cache=policy)
        again = eager("a red circle", **kw, cache=policy)
        assert skipped.info["cuda_graphs"] and not again.info["cuda_graphs"]
        assert torch.equal(skipped.latents, again.latents), policy
        assert skipped.info["cache"] == again.info["cache"]
        latents = skipped.latents.float()
        assert torch.isfinite(latents).all()
        assert (latents - want.latents.float()).norm() < 0.5 * want.latents.float().norm()
