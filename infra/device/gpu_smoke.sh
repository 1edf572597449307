#!/usr/bin/env bash
# The GPU path end to end on one NVIDIA GPU: install the CUDA build, run 1 prefill + 1 decode node on the
# one GPU with its memory split between the engines, and measure them with `tandem bench pd` and
# `tandem bench kv-transfer`. The README's GPU figures come from this script and nothing else. The nodes
# use vLLM's NixlConnector on the GPU (TANDEM_NODE_CONNECTOR=nixl; SMOKE_CONNECTOR= to change it).
#
#   bash infra/device/gpu_smoke.sh                 # results under $OUT (default: results/gpu-smoke)
#   SMOKE_PLAN=1 bash infra/device/gpu_smoke.sh    # print the steps and the commands, run nothing
#
# Steps; each writes <step>.log, and a line "step=<name> rc=<status> seconds=<n>" to summary.txt:
#   preflight  nvidia-smi sees a GPU (name, memory, driver to gpu.txt); $PYTHON (3.11, as pyproject
#              requires) exists; a package index answers, unless $VENV is already installed. A failed
#              preflight ends the run with status 2 (no GPU), 3 (no Python 3.11) or 4 (nothing to install from).
#   install    make install TARGET=gpu VENV=$VENV (vllm==0.32.0 and its CUDA torch; the Makefile checks
#              the torch it got is a CUDA build). Not counted in the 10-minute budget: it downloads GBs.
#   redis      an embedded redis-server on 127.0.0.1:$REDIS_PORT (infra/redis_server.py), for the
#              benchmarks' registries.
#   bench-pd   1P+1D on the GPU against one colocated node: TTFT, ITL, tokens/s at concurrency 1 and 8.
#   bench-kv   KV transfer time and GB/s per transport of our connector (tcp, ipc, shm, ucx) and TTFT P/D
#              vs colocated; NixlConnector too with SMOKE_NIXL=1 (two more clusters, ~3 more minutes).
#              Its first cluster names our connector, which refuses CUDA caches: as the code stands this
#              step is expected to fail on a GPU, and its log says how (README, GPU).
# The two benchmarks run under `timeout` (SMOKE_PD_S + SMOKE_KV_S = 570 s by default), so they end
# within 10 minutes whatever happens; a benchmark that fails does not stop the next one.
#
# The memory split: every engine is started with --gpu-memory-utilization $GPU_SHARE through
# TANDEM_NODE_EXTRA_ENGINE_ARGS, which each node agent reads (node_agent/settings.py). 0.30 by default:
# the kv-transfer bench's first cluster runs three engines at once (P, D and a colocated node), and
# 3 x 0.30 leaves room for CUDA contexts. The default model (SmolLM2-135M) needs well under 1 GiB.
set -uo pipefail

cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-results/gpu-smoke}
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv-gpu}
GPU_SHARE=${GPU_SHARE:-0.30}
REDIS_PORT=${REDIS_PORT:-6399}
SMOKE_PD_S=${SMOKE_PD_S:-240}
SMOKE_KV_S=${SMOKE_KV_S:-330}
SMOKE_NIXL=${SMOKE_NIXL:-0}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
TANDEM="$VENV/bin/tandem"

export TANDEM_NODE_EXTRA_ENGINE_ARGS="[\"--gpu-memory-utilization\", \"$GPU_SHARE\"]"
# Our connector moves host-memory KV caches only (kv_transfer/layout.py refuses a CUDA cache), so the
# nodes a benchmark starts without naming a connector (bench pd) use vLLM's NixlConnector.
export TANDEM_NODE_CONNECTOR=${SMOKE_CONNECTOR:-nixl}
export TANDEM_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
export PYTHONUNBUFFERED=1

BENCH_PD=("$TANDEM" bench pd --out "$OUT/bench-pd.json" --concurrency 1 --concurrency 8 --requests 16
  --max-tokens 64)
BENCH_KV=("$TANDEM" bench kv-transfer --out "$OUT/bench-kv-transfer.json" --size 1000 --size 4000
  --repeats 2)
if [ "$SMOKE_NIXL" = 1 ]; then BENCH_KV+=(--nixl); else BENCH_KV+=(--no-nixl); fi

if [ "${SMOKE_PLAN:-0}" = 1 ]; then
  echo "install: make install TARGET=gpu VENV=$VENV PYTHON=$PYTHON"
  echo "TANDEM_NODE_EXTRA_ENGINE_ARGS: $TANDEM_NODE_EXTRA_ENGINE_ARGS"
  echo "TANDEM_NODE_CONNECTOR: $TANDEM_NODE_CONNECTOR"
  echo "TANDEM_REDIS_URL: $TANDEM_REDIS_URL"
  echo "bench-pd: timeout $SMOKE_PD_S ${BENCH_PD[*]}"
  echo "bench-kv: timeout $SMOKE_KV_S ${BENCH_KV[*]}"
  exit 0
fi

mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
REDIS_PID=""

step() {  # step NAME COMMAND...: run it, log it, record its status and time
  local name=$1 start rc
  shift
  start=$(date +%s)
  echo "== $name: $*" | tee -a "$SUMMARY"
  "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "step=$name rc=$rc seconds=$(($(date +%s) - start))" | tee -a "$SUMMARY"
  grep -h '^RESULT' "$OUT/$name.log" >>"$SUMMARY" 2>/dev/null
  return $rc
}

finish() {
  local rc=$1
  [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null
  # At most 8 files come back from a device run: the logs travel as one archive.
  if compgen -G "$OUT/*.log" >/dev/null; then
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log && rm -f ./*.log)
  fi
  echo "exit=$rc" >>"$SUMMARY"
  exit "$rc"
}

preflight() {
  if ! command -v "$NVIDIA_SMI" >/dev/null || ! "$NVIDIA_SMI" -L >/dev/null 2>&1; then
    echo "preflight: no NVIDIA GPU here (nvidia-smi finds none)" | tee -a "$SUMMARY"
    return 2
  fi
  "$NVIDIA_SMI" --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  if ! command -v "$PYTHON" >/dev/null; then
    echo "preflight: no $PYTHON (pyproject requires Python 3.11); set PYTHON=" | tee -a "$SUMMARY"
    return 3
  fi
  if [ ! -e "$VENV/.tandem-installed-gpu" ] &&
    ! PIP_RETRIES=0 PIP_DEFAULT_TIMEOUT=10 timeout 60 "$PYTHON" -m pip index versions vllm >/dev/null 2>&1; then
    echo "preflight: no package index answers and $VENV is not installed: cannot install vllm==0.32.0" |
      tee -a "$SUMMARY"
    return 4
  fi
  return 0
}

# shellcheck disable=SC2317  # called through `step`
start_redis() {
  "$VENV/bin/python" -c "
import sys
from pathlib import Path
from infra.redis_server import start_embedded
proc = start_embedded($REDIS_PORT, Path('$OUT/redis'))
print('redis', proc.pid, flush=True)
sys.exit(proc.wait())
" &
  REDIS_PID=$!
  for _ in $(seq 1 60); do
    "$VENV/bin/python" -c "from infra.redis_server import reachable; import sys; sys.exit(not reachable('$TANDEM_REDIS_URL', 0.2))" &&
      return 0
    kill -0 "$REDIS_PID" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

echo "== preflight" | tee -a "$SUMMARY"
preflight
rc=$?
[ $rc -ne 0 ] && finish $rc
step install make install TARGET=gpu VENV="$VENV" PYTHON="$PYTHON" || finish 5
step redis start_redis || finish 6
step bench-pd timeout "$SMOKE_PD_S" "${BENCH_PD[@]}"
pd=$?
step bench-kv timeout "$SMOKE_KV_S" "${BENCH_KV[@]}"
kv=$?
finish $((pd != 0 || kv != 0))
