"""Step-cached calls under CUDA graphs, on a CPU stand-in for graph recording (`tests.graph_emulator`): the probe,
the reuse and the rest recorded from one forward and replayed as the cache decides give the eager cached call's
latents bit for bit, in every family, with true CFG, a skip pattern and the Taylor forecast."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.pipeline import Pipeline
from flux_runtime.pipeline.cached_graphs import SplitGraphs
from flux_runtime.pipeline.graphs import GraphedDenoiser
from scripts.bench_cache import Skips
from tests.graph_emulator import EmulatedCapture
from tests.pipeline.test_step_cache import MODELS, _cfg

KW = dict(num_steps=6, height=32, width=32, seed=3, output_type="latent")


@pytest.fixture(scope="module", params=MODELS)
def pipe(request: pytest.FixtureRequest) -> Pipeline:
    return Pipeline.from_pretrained(request.param, device="cpu", dtype=torch.float32)


def _graphed(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> list[SplitGraphs]:
    """Make `pipe` record its cached branches with the stand-in; the split graphs it makes are listed."""
    made: list[SplitGraphs] = []

    def new_split_graph(fn):
        made.append(SplitGraphs(fn, pipe.transformer, EmulatedCapture()))
        return made[-1]

    monkeypatch.setattr(pipe, "_graphs_enabled", lambda: True)
    monkeypatch.setattr(pipe, "_new_split_graph", new_split_graph)
    monkeypatch.setattr(pipe, "_new_graph", lambda fn: GraphedDenoiser(fn, EmulatedCapture()))
    pipe._graphed.clear()
    return made


def test_uncached_graphs_replay_the_eager_call(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """The uncached path's `GraphedDenoiser` on the same stand-in: one graph per branch, recorded on the second
    step and replayed after, the eager call's latents."""
    eager = pipe("a red circle", **KW, **_cfg(pipe))
    _graphed(pipe, monkeypatch)
    got = pipe("a red circle", **KW, **_cfg(pipe))
    assert got.info["cuda_graphs"] is True and torch.equal(got.latents, eager.latents)
    graphs = [g for d in pipe._graphed.values() for g, _, _ in d.graphs.values()]
    assert [g.replays for g in graphs] == [KW["num_steps"] - 1] * 2


@pytest.mark.parametrize(
    "cache", [Skips(skip=(2, 3)), "taylor:order=2,refresh=2", "first-block:threshold=0"], ids=str
)
def test_split_graphs_replay_the_eager_cached_call(
    pipe: Pipeline, cache: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager = pipe("a red circle", **KW, **_cfg(pipe), cache=cache)
    assert eager.info["cuda_graphs"] is False
    made = _graphed(pipe, monkeypatch)
    got = pipe("a red circle", **KW, **_cfg(pipe), cache=cache)
    assert got.info["cuda_graphs"] is True
    assert torch.equal(got.latents, eager.latents)
    assert got.info["cache"] == eager.info["cache"]
    branches = got.info["cache"]["branches"]
    assert len(made) == len(branches) == 2  # one per CFG branch
    for split, record in zip(made, branches.values(), strict=True):
        # step 0 runs eagerly, step 1 records; every later step replays the probe, then the rest or the reuse
        computed = record["computed_steps"]
        assert split.replays == {"rest": len(computed) - 1, "reuse": KW["num_steps"] - len(computed)}
        graphs = next(iter(split.splits.values())).graphs
        assert graphs["probe"].replays == KW["num_steps"] - 1
        assert (
            graphs["rest"].replays == len(computed) - 1 and graphs["reuse"].replays == split.replays["reuse"]
        )


def test_a_cache_that_never_skips_under_graphs_equals_no_cache(
    pipe: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = pipe("a red circle", **KW, **_cfg(pipe))
    _graphed(pipe, monkeypatch)
    got = pipe("a red circle", **KW, **_cfg(pipe), cache="first-block:threshold=0")
    assert torch.equal(got.latents, want.latents)


def test_recorded_graphs_serve_later_calls_and_other_sizes_record_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipe = Pipeline.from_pretrained("tiny", device="cpu", dtype=torch.float32)
    policy = Skips(skip=(1, 3))
    want = pipe("a red circle", **KW, cache=policy).latents
    other = pipe("a red circle", **{**KW, "width": 48}, cache=policy).latents
    made = _graphed(pipe, monkeypatch)
    first = pipe("a red circle", **KW, cache=policy).latents
    again = pipe("a red circle", **KW, cache=policy).latents
    wider = pipe("a red circle", **{**KW, "width": 48}, cache=policy).latents
    assert torch.equal(first, want) and torch.equal(again, want) and torch.equal(wider, other)
    assert [len(m.splits) for m in made] == [1, 1]  # one branch; two sizes, each recorded once
    # the second call replayed every step, its first included: the probe's graph ran 5 + 6, then 5 times
    probes = [s.graphs["probe"].replays for m in made for s in m.splits.values()]
    assert probes == [11, 5]


def test_the_stand_in_refuses_host_reads_and_replays_new_inputs() -> None:
    """What makes the tests above able to fail: a recording's tensors hold nothing until a replay, a replay reads
    the inputs' new values, and a host read while recording is an error."""
    capture = EmulatedCapture()
    x = torch.ones(4)
    graph = capture.graph()
    capture.begin(graph, None)
    y = (x * 2).sum()
    capture.end(graph)
    assert torch.isnan(y)  # recording computed nothing
    graph.replay()
    assert y.item() == 8.0
    x.copy_(torch.arange(4.0))
    graph.replay()
    assert y.item() == 12.0
    graph = capture.graph()
    capture.begin(graph, None)
    with pytest.raises(RuntimeError, match="reads a tensor on the host"):
        float(x.sum())
    capture.end(graph)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", MODELS)
def test_gpu_split_graphs_replay_the_eager_cached_call(model: str) -> None:
    """On CUDA with real recording (each signature's three graphs in a pool of their own), two branches replayed
    in turn, a second call replaying every step: the eager cached call's latents, bit for bit."""
    graphed = Pipeline.from_pretrained(model, device="cuda")
    eager = Pipeline.from_pretrained(model, device="cuda", cuda_graphs=False)
    kw = dict(num_steps=8, height=128, width=128, seed=4, output_type="latent", **_cfg(graphed))
    for policy in (Skips(skip=(2, 3, 5)), "taylor:order=2,refresh=2", "first-block:threshold=0.2"):
        want = eager("a red circle", **kw, cache=policy)
        for _ in range(2):
            got = graphed("a red circle", **kw, cache=policy)
            assert got.info["cuda_graphs"] and not want.info["cuda_graphs"]
            assert torch.equal(got.latents, want.latents), (model, policy)
            assert got.info["cache"] == want.info["cache"]
    splits = [g for g in graphed._graphed.values() if isinstance(g, SplitGraphs)]
    assert len(splits) == 2 and all(s.replays["reuse"] > 0 and s.replays["rest"] > 0 for s in splits)
