"""On a host with two or more GPUs (NCCL): the parallel pipeline runs its fused kernels on the shards.

Skipped without two GPUs. Checks that the fused ops run verified on the shards (no failed verification, no
reference fallback that one GPU does not have, also on a rank whose text stream is empty) and that the
image stays within bf16 noise of one GPU's; whether it is `torch.equal` depends on cuBLAS choosing the same GEMM kernels for the shorter
shards, so the test prints it (and `scripts/bench_parallel.py` measures it at full size).
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import gpu_pipeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
    ),
]


@pytest.mark.parametrize("model", ["tiny", "tiny-flux2"])
def test_two_gpus_run_fused_kernels_on_shards(model):
    results = run_ranks(2, gpu_pipeline, model, 256, timeout=600)
    main = results[0]
    for r in results:
        assert r["fused"] > 0 and not r["mismatches"], r
        # the shards (rank 1 holds no text rows) fall back for no reason one GPU does not
        assert set(map(tuple, r["fallbacks"])) <= set(map(tuple, main["one_fallbacks"])), r
    print(f"{model}: latents torch.equal to one GPU: {main['equal']} (max |diff| {main['max_diff']:.3g})")
    assert main["image_diff"] < 0.05
