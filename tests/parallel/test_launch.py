"""`flux-gen --gpus N`'s supervisor: ranks started with torchrun's variables, one message when one fails.

The ranks here are small Python programs (no torch), so these tests take a second or two.
"""

from __future__ import annotations

import json
import sys
import time

from flux_runtime.parallel.launch import LOST_PEER, supervise


def _run(code: str, n: int = 2) -> tuple[int, list[str], float]:
    said: list[str] = []
    start = time.monotonic()
    status = supervise([sys.executable, "-c", code], n, say=said.append)
    return status, said, time.monotonic() - start


def test_ranks_get_the_rendezvous_and_no_multicast(tmp_path):
    code = (
        "import json, os; keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', "
        "'NCCL_NVLS_ENABLE', 'TORCH_SYMM_MEM_DISABLE_MULTICAST', 'NVSHMEM_DISABLE_NVLS'); "
        f"open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').write(json.dumps({{k: os.environ[k] for k in keys}}))"
    )
    status, said, _ = _run(code, n=3)
    assert status == 0 and said == []
    envs = [json.loads((tmp_path / str(r)).read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] == [e["LOCAL_RANK"] for e in envs]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"} and len({e["MASTER_PORT"] for e in envs}) == 1
    assert {
        (e["NCCL_NVLS_ENABLE"], e["TORCH_SYMM_MEM_DISABLE_MULTICAST"], e["NVSHMEM_DISABLE_NVLS"])
        for e in envs
    } == {("0", "1", "1")}


def test_a_killed_rank_stops_the_run_with_one_message():
    code = (
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n    time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    status, said, seconds = _run(code)
    assert status == 1
    assert said == ["rank 1 of 2 was killed by SIGKILL; the other ranks were stopped"]
    assert seconds < 20  # rank 0 (asleep for a minute) was stopped, not waited for


def test_the_cause_is_named_not_the_ranks_that_lost_it():
    code = (
        "import os, sys, time\n"
        f"if os.environ['RANK'] == '0':\n    time.sleep(0.5); sys.exit({LOST_PEER})\n"
        "sys.exit(3)\n"
    )
    status, said, _ = _run(code)
    assert status == 1 and said == ["rank 1 of 2 exited with status 3; the other ranks were stopped"]


def test_a_rank_that_printed_its_error_is_not_reported_twice():
    status, said, _ = _run("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(1)\n")
    assert status == 1 and said == []


def test_only_lost_peers():
    status, said, _ = _run(f"import sys; sys.exit({LOST_PEER})")
    assert status == 1 and said == [
        "the ranks lost contact with each other (a collective timed out); the run is stopped"
    ]
