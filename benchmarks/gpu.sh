#!/usr/bin/env bash
# The benchmark on a GPU host, in one command: the sweep (with its GPU % column), the naive baseline and
# the model's in-process ceiling, all on CUDA, plus what nvidia-smi says before, during and after.
#
#   benchmarks/gpu.sh [--dry-run] [--seconds 30] [--concurrency 1,2,4,8,16,32,64,128]
#                     [--children N] [--dtype float16|bfloat16|float32] [--scenarios overload,isolation]
#
#   --dry-run      print the plan (every command, in order) and run nothing: works without a GPU
#   --seconds      per sweep step (default 30)
#   --children     online worker children (default: one per GPU that nvidia-smi lists; child i uses
#                  cuda:(i mod GPUs), inference/core/gpu.py)
#   --dtype        run every model with weights in this dtype (writes a copy of the models file);
#                  default: the models file as it is (float32 unless it says otherwise)
#
# Writes benchmarks/out/gpu/: sweep.md, sweep.csv, sweep.png, scenarios.json (benchmarks/sweep.py),
# nvidia-smi.txt and nvidia-smi-q.txt (before), nvidia-smi-during.csv (one sample a second while it runs),
# nvidia-smi-after.txt, env.txt (torch, CUDA, GPUs, commit), stack.log, and models.yaml with --dtype.
#
# The sweep runs all three systems (python -m benchmarks.sweep, docs/benchmarks.md): it measures the
# ceiling in its own process (benchmarks/ceiling.py), sweeps the platform started here, then starts the
# naive server (benchmarks/naive_server.py) and sweeps it. All of them read INFERENCE_DEVICE=cuda; the
# processes outside the worker pool (ceiling, naive) use cuda:0.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
STEP_SECONDS=30
CONCURRENCY=1,2,4,8,16,32,64,128
CHILDREN=
DTYPE=
SCENARIOS=overload,isolation
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --seconds) STEP_SECONDS=$2; shift ;;
    --concurrency) CONCURRENCY=$2; shift ;;
    --children) CHILDREN=$2; shift ;;
    --dtype) DTYPE=$2; shift ;;
    --scenarios) SCENARIOS=$2; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$DTYPE" in "" | float32 | float16 | bfloat16) ;; *) echo "--dtype must be float32, float16 or bfloat16" >&2; exit 2 ;; esac

OUT=benchmarks/out/gpu
PY=${PYTHON:-.venv/bin/python}
WEB_PORT=${WEB_PORT:-8000}
TORCH_PIN=$(grep -E '^torch==' requirements.txt)
# On this project's CPU machines pip's own configuration (find-links to a local wheel folder) makes
# `pip install torch==2.13.0` take the CPU wheel (+cpu). On a Linux x86_64 GPU host the plain PyPI wheel
# of the same pin is the CUDA build (it pulls the nvidia-* CUDA libraries from PyPI). For another CUDA
# version use PyTorch's own index, e.g. TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 (cu12x:
# the CUDA the driver supports, `nvidia-smi` prints it). PIP_CONFIG_FILE=/dev/null makes pip ignore a
# machine-wide configuration that points at CPU wheels.
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}

say() { printf '\n== %s\n' "$*"; }
# show cmd...: the command as it would be typed (arguments with spaces or quotes in single quotes).
show() {
  local line="+" arg
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then line+=" $arg"; else line+=" '${arg//\'/\'\\\'\'}'"; fi
  done
  printf '%s\n' "$line"
}
run() { show "$@"; [[ $DRY_RUN == 1 ]] || "$@"; }
# run_to FILE cmd...: the command's output into FILE.
run_to() {
  local file=$1; shift
  show "$@"; printf '    > %s\n' "$file"
  [[ $DRY_RUN == 1 ]] || "$@" > "$file"
}

say "1. the GPU"
if [[ $DRY_RUN == 1 ]]; then
  command -v nvidia-smi > /dev/null || echo "(dry run: no nvidia-smi here; a real run stops at this point)"
elif ! command -v nvidia-smi > /dev/null; then
  echo "nvidia-smi not found: this script needs an NVIDIA GPU and its driver" >&2
  exit 1
fi
if [[ -z $CHILDREN ]]; then
  CHILDREN=$( (command -v nvidia-smi > /dev/null && nvidia-smi -L 2> /dev/null) | grep -c '^GPU' || true)
  [[ $CHILDREN -gt 0 ]] || CHILDREN=1
fi
echo "online worker children: $CHILDREN"

say "2. the virtualenv and a CUDA build of torch"
[[ -x $PY ]] || run make venv
CUDA_CHECK='import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "GPUs", torch.cuda.device_count()); sys.exit(0 if torch.cuda.is_available() else 1)'
if [[ $DRY_RUN == 1 ]]; then
  show "$PY" -c "$CUDA_CHECK"
  echo "(if that fails, torch is a CPU build or sees no GPU; then:)"
  show "$PY" -m pip uninstall -y torch
  show env PIP_CONFIG_FILE=/dev/null "$PY" -m pip install "$TORCH_PIN" --index-url "$TORCH_INDEX_URL"
elif ! "$PY" -c "$CUDA_CHECK"; then
  run "$PY" -m pip uninstall -y torch
  run env PIP_CONFIG_FILE=/dev/null "$PY" -m pip install "$TORCH_PIN" --index-url "$TORCH_INDEX_URL"
  "$PY" -c "$CUDA_CHECK" || { echo "torch still sees no GPU: check the driver and CUDA_VISIBLE_DEVICES" >&2; exit 1; }
fi

say "3. what the host is"
run mkdir -p "$OUT"
run_to "$OUT/nvidia-smi.txt" nvidia-smi
run_to "$OUT/nvidia-smi-q.txt" nvidia-smi -q
ENV_PY='import subprocess, torch, transformers
print("commit", subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
print("torch", torch.__version__, "CUDA", torch.version.cuda, "transformers", transformers.__version__)
print("GPUs", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
run_to "$OUT/env.txt" "$PY" -c "$ENV_PY"

if [[ -n $DTYPE ]]; then
  say "3b. every model in $DTYPE"
  MODELS_IN=${INFERENCE_MODELS_FILE:-inference/models.yaml}
  DTYPE_PY='import sys, yaml
raw = yaml.safe_load(open(sys.argv[1]))
for entry in raw["models"].values():
    if entry["task"] != "identity":  # no weights
        entry["dtype"] = sys.argv[2]
yaml.safe_dump(raw, open(sys.argv[3], "w"), sort_keys=False)'
  run "$PY" -c "$DTYPE_PY" "$MODELS_IN" "$DTYPE" "$OUT/models.yaml"
  run export INFERENCE_MODELS_FILE="$PWD/$OUT/models.yaml"
fi

say "4. the stack on CUDA (scripts/run.py: web, online and offline workers, Redis when none answers)"
# One child per GPU; a short wait for company pays on a GPU, where a batch of 8 costs about what 1 does.
run export INFERENCE_DEVICE=cuda ONLINE_CONCURRENCY="$CHILDREN" ONLINE_BATCH_WAIT_MS="${ONLINE_BATCH_WAIT_MS:-2}" \
  WEB_PORT="$WEB_PORT" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
show env PYTHONUNBUFFERED=1 "$PY" scripts/run.py
printf '    > %s 2>&1 &   (stopped with SIGTERM when this script exits)\n' "$OUT/stack.log"
show nvidia-smi --query-gpu=timestamp,index,name,utilization.gpu,memory.used,memory.total,power.draw --format=csv -l 1
printf '    > %s &\n' "$OUT/nvidia-smi-during.csv"
echo "+ wait for http://127.0.0.1:$WEB_PORT/api/v1/ready (up to 600 s: CUDA start-up and model loads)"
STACK_PID=
SMI_PID=
stop() {
  [[ -n $SMI_PID ]] && kill "$SMI_PID" 2> /dev/null || true
  if [[ -n $STACK_PID ]] && kill -0 "$STACK_PID" 2> /dev/null; then
    kill -TERM "$STACK_PID" 2> /dev/null || true
    wait "$STACK_PID" 2> /dev/null || true
  fi
}
if [[ $DRY_RUN == 0 ]]; then
  trap stop EXIT
  PYTHONUNBUFFERED=1 "$PY" scripts/run.py > "$OUT/stack.log" 2>&1 &
  STACK_PID=$!
  nvidia-smi --query-gpu=timestamp,index,name,utilization.gpu,memory.used,memory.total,power.draw \
    --format=csv -l 1 > "$OUT/nvidia-smi-during.csv" &
  SMI_PID=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$WEB_PORT/api/v1/ready" > /dev/null && break
    kill -0 "$STACK_PID" 2> /dev/null || { tail -50 "$OUT/stack.log" >&2; echo "the stack exited" >&2; exit 1; }
    sleep 1
  done
  curl -sf "http://127.0.0.1:$WEB_PORT/api/v1/ready" > /dev/null || { echo "not ready after 600 s: $OUT/stack.log" >&2; exit 1; }
  # The Redis the stack uses (REDIS_URL when it answered, else the embedded one it started).
  REDIS_URL=$(grep -o 'redis://[0-9.:]*/[0-9]*' "$OUT/stack.log" | head -1)
fi
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}

say "5. the sweep: ceiling, platform, naive, then the scenarios"
run "$PY" -m benchmarks.sweep --url "http://127.0.0.1:$WEB_PORT" --redis-url "$REDIS_URL" \
  --seconds "$STEP_SECONDS" --concurrency "$CONCURRENCY" --children "$CHILDREN" --scenarios "$SCENARIOS" --out "$OUT"
run_to "$OUT/nvidia-smi-after.txt" nvidia-smi

say "done: $OUT"
[[ $DRY_RUN == 1 ]] && echo "(dry run: nothing was run)"
exit 0
