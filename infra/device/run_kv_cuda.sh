#!/usr/bin/env bash
# The device check of our KV data path (infra/device/kv_cuda_bench.py) on a machine with a GPU and no
# vLLM: torch and xxhash come with the machine's image, pyzmq and msgspec travel as wheels.
#
# Before the run, on this side, in the repository root (1.1 MB of wheels, ignored by git):
#   infra/device/run_kv_cuda.sh --fetch-wheels
# On the device machine (carry .whl), in the repository root:
#   infra/device/run_kv_cuda.sh --device cuda --out "$OUT/kv_cuda.json"
# Everything after the script's name goes to kv_cuda_bench.py. Exit status: the bench's (non-zero when
# it breaks); the RESULT line's verdict= says whether every threshold passed.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${WHEELS:-.whl}
PYTHON=${PYTHON:-python3}
if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
    || echo '/.whl/' >>"$(git rev-parse --git-common-dir)/info/exclude"
  exec "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" pyzmq==27.3.0 msgspec==0.23.0
fi
if ! "$PYTHON" -c 'import zmq, msgspec, xxhash' 2>/dev/null; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "pyzmq/msgspec missing and no wheels in $WHEELS" >&2; exit 3; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
exec timeout 230 "$PYTHON" infra/device/kv_cuda_bench.py "$@"
