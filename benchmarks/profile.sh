#!/usr/bin/env bash
# Flame graphs of the running stack under load: one web process, the online worker's main process and
# one online child, recorded at once with py-spy while N closed-loop clients run (default 40, 20 s).
#   benchmarks/profile.sh [clients] [seconds]      (py-spy comes with requirements-dev.txt; needs ptrace rights)
# Writes benchmarks/out/profile-{web,online-main,online-child}.svg and .txt (collapsed stacks).
set -euo pipefail
cd "$(dirname "$0")/.."
CLIENTS=${1:-40}
SECONDS_=${2:-20}
OUT=benchmarks/out
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
SPY=${PY_SPY:-$(dirname "$PY")/py-spy}
uvicorn_parent=$(pgrep -f "python -m platform_.server" | head -1)
web=$(pgrep -P "$uvicorn_parent" -f "multiprocessing.spawn" | head -1)
online_pids=$(pgrep -f "bin/celery -A platform_ worker -Q online")
# The main process is the one whose parent is not itself an online worker process.
online_main=$(for pid in $online_pids; do
  ppid=$(ps -o ppid= -p "$pid" | tr -d ' ')
  echo "$online_pids" | grep -qx "$ppid" || echo "$pid"
done | head -1)
online_child=$(pgrep -P "$online_main" | head -1)
"$PY" -m benchmarks.smoke --clients "$CLIENTS" --seconds "$SECONDS_" > "$OUT/profile-load.txt" &
load=$!
sleep 3
record_s=$((SECONDS_ - 5))
for pair in "web:$web" "online-main:$online_main" "online-child:$online_child"; do
  name=${pair%%:*}; pid=${pair#*:}
  "$SPY" record -p "$pid" -d "$record_s" --nonblocking -r 50 -f flamegraph -o "$OUT/profile-$name.svg" >/dev/null 2>&1 &
  "$SPY" record -p "$pid" -d "$record_s" --nonblocking -r 50 -f raw -o "$OUT/profile-$name.txt" >/dev/null 2>&1 &
done
wait "$load"
wait
cat "$OUT/profile-load.txt"
ls -1 "$OUT"/profile-*
for name in web online-main online-child; do
  "$PY" -m benchmarks.flame "$OUT/profile-$name.txt" --top 40 > "$OUT/profile-$name-top.txt"
done
