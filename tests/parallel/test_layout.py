"""The split of a joint sequence over ranks, the parallel settings, and their errors (no processes started)."""

from __future__ import annotations

import pytest
import torch

from flux_runtime.parallel.group import ParallelConfig, ParallelError, as_config, join
from flux_runtime.parallel.ulysses import Shards, check_heads, split_sizes


@pytest.mark.parametrize(("length", "parts"), [(8, 2), (37, 2), (37, 3), (4608, 4), (5, 4)])
def test_split_sizes_cover_the_sequence_evenly(length, parts):
    sizes = split_sizes(length, parts)
    assert sum(sizes) == length and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1 and list(sizes) == sorted(sizes, reverse=True)


@pytest.mark.parametrize(("n_txt", "n_img", "size"), [(7, 20, 2), (512, 4096, 4), (30, 4, 2), (11, 15, 3)])
def test_shards_are_contiguous_text_then_image(n_txt, n_img, size):
    s = Shards(n_txt, n_img, size)
    txt, img = [], []
    for r in range(size):
        (t0, t1), (i0, i1) = s.txt_span(r), s.img_span(r)
        start, stop = s.span(r)
        assert (t1 - t0) + (i1 - i0) == stop - start
        txt += list(range(t0, t1))
        img += list(range(i0, i1))
    assert txt == list(range(n_txt)) and img == list(range(n_img))  # each token once, in order


def test_a_rank_may_hold_no_text_or_no_image():
    s = Shards(30, 4, 2)  # rank 0: 17 text tokens; rank 1: 13 text, 4 image
    assert s.img_span(0) == (0, 0) and s.txt_span(0) == (0, 17)
    s = Shards(7, 20, 2)  # rank 1: image only
    assert s.txt_span(1) == (7, 7) and s.img_span(1) == (7, 20)


def test_heads_must_split_evenly():
    check_heads(24, 4)
    with pytest.raises(ParallelError, match="24 attention heads, which 5 ranks"):
        check_heads(24, 5)


def test_config_checks():
    assert as_config(2) == ParallelConfig(world_size=2)
    with pytest.raises(ParallelError, match="positive int"):
        ParallelConfig(world_size=0)
    with pytest.raises(ParallelError, match="timeout_s must be > 0"):
        ParallelConfig(world_size=2, timeout_s=0)
    with pytest.raises(ParallelError, match="number of processes or a ParallelConfig"):
        as_config("2")  # type: ignore[arg-type]


def test_join_without_a_launcher_says_how_to_start(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ParallelError, match=r"torchrun --nproc-per-node 2.*flux-gen --gpus 2"):
        join(ParallelConfig(world_size=2), torch.device("cpu"))


def test_join_refuses_a_different_world_and_a_pinned_gpu(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ParallelError, match="started with 4 processes"):
        join(ParallelConfig(world_size=2), torch.device("cpu"))
    with pytest.raises(ParallelError, match="pass device='cuda'"):
        join(ParallelConfig(world_size=4), torch.device("cuda", 1))
    with pytest.raises(ParallelError, match="not mps"):
        join(ParallelConfig(world_size=4), torch.device("mps"))


def test_pipeline_refuses_parallel_without_a_launcher(monkeypatch):
    from flux_runtime.pipeline import Pipeline

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ParallelError, match="parallel=2 needs 2 processes"):
        Pipeline.from_pretrained("tiny-random", device="cpu", dtype=torch.float32, parallel=2)
