"""flux-serve's tests need the serve and test extras (FastAPI, uvicorn, httpx, the OpenAI client); on a
machine without them (the GPU device), a module whose needs are missing is not collected and the header says
why. The metrics module needs only prometheus_client, the GPU and bench modules no openai client, so their GPU
tests run on the device with the wheels of scripts/fetch_serve_wheels.sh on PYTHONPATH; the extras module
(`flux-serve` without them) needs none."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_ALL = ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client", "multipart")
_NEEDS = {
    "test_serve_metrics.py": ("prometheus_client",),
    "test_serve_gpu.py": ("fastapi", "uvicorn", "httpx", "prometheus_client", "multipart"),
    "test_bench_serve.py": ("fastapi", "uvicorn", "httpx", "prometheus_client", "multipart"),
    "test_serve_extras.py": (),
}
_MISSING = {
    path.name: [m for m in _NEEDS.get(path.name, _ALL) if importlib.util.find_spec(m) is None]
    for path in Path(__file__).parent.glob("test_*.py")
}
collect_ignore = [name for name, missing in _MISSING.items() if missing]


def pytest_report_header() -> str | None:
    missing = sorted({m for name in collect_ignore for m in _MISSING[name]})
    if missing:
        skipped = ", ".join(collect_ignore)
        return (
            f"tests/serve: {skipped} not collected: missing {', '.join(missing)} (pip install -e '.[test]')"
        )
    return None
