#!/usr/bin/env bash
# One device call: install the carried diffusers wheel, run the GPU tests, the kernel check and the bench.
# Usage on the device (carry .whl):  bash scripts/gpu_check.sh [bench.py flags]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__)"
status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25 || status=1
fi
if [ -f scripts/kernel_check.py ] && [ -z "${SKIP_KERNELS:-}" ]; then
  timeout 240 python3 scripts/kernel_check.py 2>&1 | tee "$OUT/kernel_check.txt" || status=1
fi
python3 scripts/bench.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.txt" || status=1
exit $status
