#!/usr/bin/env bash
# The wheels flux-serve and scripts/bench_serve.py need on the GPU device, which has no package registry:
# CPython 3.12 on x86-64 Linux, with torch, numpy, transformers, safetensors, pillow, tqdm and requests
# already there. Run it where pip reaches PyPI, from any folder:
#
#   bash scripts/fetch_serve_wheels.sh [DEST]        # DEST default .whl/serve (git-ignored via .whl/)
#
# It downloads the pinned list below (every package of the server, its client and its metrics, and each
# one's dependencies: the versions tests/serve passes with), checks that every dependency a wheel declares
# for Python 3.12 on Linux is in the list or on the device, then installs the set into a fresh folder and
# imports it with a bare Python 3.12 (`-S`: no site-packages, only that folder on PYTHONPATH) when one is
# found ($PYTHON312, python3.12, or pyenv's). bench_serve.py installs DEST on the device with
#   pip install --no-index --no-deps --target /tmp/serve-site DEST/*.whl
# and puts /tmp/serve-site first on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl/serve}
WHEELS=(
  # the ASGI app and its request models
  fastapi==0.165.0 starlette==1.10.0 anyio==4.16.0 idna==3.20 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.13.4 pydantic-core==2.46.4 typing-inspection==0.4.2 annotated-types==0.7.0
  typing-extensions==4.16.0
  python-multipart==0.0.34
  # the server
  uvicorn==0.54.0 click==8.5.1 h11==0.16.0
  # the client (bench_serve.py, the tests)
  httpx==0.28.1 httpcore==1.0.9 certifi==2026.5.20
  # /metrics
  prometheus-client==0.26.0
)
ON_DEVICE="torch numpy transformers safetensors pillow tqdm requests"

rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --no-deps -d "$DEST" "${WHEELS[@]}" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

# every declared dependency (markers evaluated for CPython 3.12 on x86-64 Linux, extras left out) is here
python3 - "$DEST" "$ON_DEVICE" <<'EOF'
import re, sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

dest, on_device = Path(sys.argv[1]), sys.argv[2].split()
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
have, needs = {}, {}
for wheel in sorted(dest.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    name = norm(re.search(r"^Name: (.+)$", meta, re.M)[1].strip())
    have[name] = re.search(r"^Version: (.+)$", meta, re.M)[1].strip()
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            needs.setdefault(norm(req.name), []).append((name, req.specifier))
missing = sorted(set(needs) - set(have) - {norm(n) for n in on_device})
unmet = [f"{dep} {have[dep]} (needs {spec} for {who})" for dep, reqs in needs.items() if dep in have
         for who, spec in reqs if have[dep] not in spec]
if missing or unmet:
    sys.exit(f"fetch_serve_wheels: missing {missing}, unmet {unmet}")
print(f"fetch_serve_wheels: {len(have)} wheels, every dependency met: " + " ".join(f"{k}=={v}" for k, v in sorted(have.items())))
EOF

PY312=
for candidate in ${PYTHON312:-} python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3; do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
    PY312=$candidate
    break
  fi
done
if [ -z "$PY312" ]; then
  echo "fetch_serve_wheels: no Python 3.12 here (set PYTHON312): the import check did not run" >&2
  exit 0
fi
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
"$PY312" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --target "$SITE" "$DEST"/*.whl
PYTHONPATH="$SITE" "$PY312" -S -W ignore - "$SITE" <<'EOF'
import sys
site = sys.argv[1]
import fastapi, uvicorn, httpx, prometheus_client, multipart, pydantic, pydantic_core, starlette
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

for module in (fastapi, uvicorn, httpx, prometheus_client, multipart, pydantic, pydantic_core, starlette):
    assert module.__file__.startswith(site), f"{module.__name__} came from {module.__file__}, not {site}"
app = FastAPI()

@app.post("/form")
async def form(request: Request):
    f = await request.form()
    return {"prompt": f["prompt"], "image": len(await f["image"].read())}

with TestClient(app) as client:  # a multipart form through starlette and python-multipart
    r = client.post("/form", data={"prompt": "x"}, files={"image": ("a.png", b"12345", "image/png")})
assert r.json() == {"prompt": "x", "image": 5}, r.text
registry = CollectorRegistry()
Counter("probe", "a probe", registry=registry).inc()
families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
assert families["probe"].samples[0].value == 1, families
print(f"fetch_serve_wheels: Python {sys.version.split()[0]} -S imports fastapi {fastapi.__version__}, uvicorn "
      f"{uvicorn.__version__}, httpx {httpx.__version__}, prometheus_client, multipart {multipart.__version__}, "
      f"pydantic {pydantic.VERSION} from the wheels alone; a multipart form and a metrics page work")
EOF
