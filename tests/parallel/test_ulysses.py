"""Ulysses on CPU processes (gloo): the sharded forward against one process's, for FLUX.1 and FLUX.2.

Each rank builds the same tiny random transformer, runs it whole (one process) and sharded over the group,
and reports whether the two are `torch.equal`, the largest difference, and both relative errors against a
float64 forward. Shapes cover odd lengths (uneven shards), a rank with no text tokens, a rank with no image
tokens, batch 2, bf16 / fp16 / fp32 and FP8 projections.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import layout_parity, transformer_parity

# (family, heads, dtype, batch, h, w, txt_len, fp8); tokens = txt_len + h * w
CASES = [
    ("flux1", 2, torch.float32, 1, 4, 5, 7, False),  # 27 tokens: 14 + 13; rank 1 has no text
    ("flux1", 2, torch.bfloat16, 2, 4, 5, 7, False),
    ("flux1", 2, torch.float16, 1, 3, 3, 5, False),
    ("flux1", 2, torch.float32, 1, 2, 2, 30, False),  # rank 0 has no image tokens
    ("flux1", 2, torch.bfloat16, 1, 4, 4, 9, True),  # FP8 block projections
    ("flux2", 2, torch.float32, 1, 4, 5, 7, False),
    ("flux2", 2, torch.bfloat16, 2, 3, 5, 11, False),
]
THREE = [
    ("flux1", 6, torch.bfloat16, 1, 4, 5, 8, False),  # 28 tokens: 10 + 9 + 9
    ("flux2", 3, torch.bfloat16, 2, 4, 4, 8, False),  # 24 tokens: text only on rank 0, image only on 1 and 2
]
# fp32 GEMMs over few rows: the CPU BLAS may pick its kernel by the row count (on an AVX-512 CPU, a
# matrix-vector path for 1-2 rows and, at width 192, another blocking below about 12 rows), so ranks holding
# 1 or 8 rows of a stream can round their projections differently from one process over 9 or 16 rows.
# Whether they do depends on the CPU (an AVX2 one gave the same bits), so these cases ask for the same bits
# or a difference of rounding size, with the error against float64 no worse than one process's (measured
# on AVX-512: max |diff| 3e-6 to 7e-6, relative L2 7.2e-7 vs 7.3e-7).
INEXACT = [
    ("flux2", 3, torch.float32, 2, 3, 3, 4, False),  # 13 tokens: 5 + 4 + 4; rank 0 has 1 image token
    ("flux2", 3, torch.float32, 1, 4, 4, 8, False),  # 24 tokens: 8 image rows per rank instead of 16
]


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(2, transformer_parity, CASES)


def _check(results, i):
    for rank, res in enumerate(results):
        r = res[i]
        assert r["equal"], f"rank {rank} {r['case']}: max |diff| {r['max_diff']}"
        # the same bits, so the same error against float64
        assert r["err_many"] == r["err_one"]


@pytest.mark.parametrize(
    "i",
    range(len(CASES)),
    ids=[f"{c[0]}-{c[2]}-b{c[3]}-{c[4]}x{c[5]}+{c[6]}" + ("-fp8" if c[7] else "") for c in CASES],
)
def test_two_ranks_equal_one_process(two_ranks, i):
    _check(two_ranks, i)


def test_the_shards_cover_both_streams(two_ranks):
    spans = two_ranks[0][0]["spans"]  # case 0: 7 text + 20 image tokens
    assert spans == [((0, 7), (0, 7)), ((7, 7), (7, 20))]
    assert two_ranks[0][3]["spans"][0][1] == (0, 0)  # case 3: rank 0 holds text only


def test_attention_input_layouts_give_the_same_bits():
    """The all-to-all hands `sdpa` each rank's heads stored as `set_head_major` says (head-major: (B, H/n, L, D)
    contiguous, with 2 heads a rank), whatever layout the token shards arrive in; the sharded forward is the
    same in every layout, and equal to one process's."""
    cases = [("flux1", 4, torch.bfloat16, 2, 4, 5, 7), ("flux2", 4, torch.float32, 1, 3, 5, 6)]
    stored = {True: (True, False), False: (False, True)}  # (head-major, contiguous)
    expected = {
        True: [(stored[True],) * 3],
        False: [(stored[False],) * 3],
        "kv": [(stored[False], stored[True], stored[True])],
    }
    for res in run_ranks(2, layout_parity, cases):
        assert len(res) == 3 * len(cases)
        for r in res:
            assert r["equal"], r["case"]
            assert r["seen"] == expected[r["case"][1]], r


@pytest.mark.slow
def test_three_ranks():
    results = run_ranks(3, transformer_parity, THREE + INEXACT)
    for i in range(len(THREE)):
        _check(results, i)
    assert results[0][len(THREE)]["spans"][0] == ((0, 4), (0, 1))  # the one-row image stream on rank 0
    for res in results:
        for r in res[len(THREE) :]:
            assert r["equal"] or 0 < r["max_diff"] < 1e-4, r
            assert r["err_many"] < 1.5 * r["err_one"], r  # not less accurate than one process
