"""flux-serve's tests need the serve and test extras (FastAPI, uvicorn, httpx, the OpenAI client); on a
machine without them (the GPU device), the module is not collected and the header says why."""

from __future__ import annotations

import importlib.util

_NEEDED = ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client", "multipart")
_MISSING = [m for m in _NEEDED if importlib.util.find_spec(m) is None]
collect_ignore_glob = ["test_*.py"] if _MISSING else []


def pytest_report_header() -> str | None:
    if _MISSING:
        return f"tests/serve not collected: missing {', '.join(_MISSING)} (pip install -e '.[test]')"
    return None
