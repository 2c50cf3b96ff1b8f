"""Record a live metric window for the diagnosis tests: a closed-loop load against a running platform, and
what the platform wrote to Redis meanwhile, in the format tests/observability/test_replayed_windows.py
replays (the per-second metric hashes, the online children's heartbeats, the drain-rate buckets' busy
child-seconds).

    make run    # in another terminal
    .venv/bin/python benchmarks/record_window.py --clients 8 --seconds 90 \\
        --out tests/observability/windows/recorded_steady_8_clients.json

Unlike generate.py's windows (built from a model of a load), this one is what the platform measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.loadgen import closed_loop  # noqa: E402
from benchmarks.smoke import default_token  # noqa: E402
from inference.core.keys import WORKERS_KEY, rate_key  # noqa: E402
from observability.keys import second_key  # noqa: E402

# Seconds cut from each end: the first requests' and the last second's figures are partial.
EDGE_S = 2


def children_of(client: redis.Redis, model: str, now: float) -> list[dict]:
    """The live online children serving `model`, as the replay writes their heartbeats back."""
    children = []
    for raw in client.hgetall(WORKERS_KEY).values():
        beat = json.loads(raw)
        if beat.get("queue") != "online" or model not in beat.get("models", []) or now - beat.get("ts", 0) > 10:
            continue
        beat["started_at_s_ago"] = round(now - beat.pop("started_at", now))
        beat.pop("ts", None)
        children.append(beat)
    return children


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", default="router")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--name", default="recorded_steady_8_clients")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")

    client = redis.Redis.from_url(args.redis_url, decode_responses=True)
    headers = {"Authorization": f"Token {default_token()}"}
    url = f"{args.url}/api/v1/models/{args.model}/predict"
    started = time.time()
    run = closed_loop(url, headers, args.clients, args.seconds, seed=23)
    ended = time.time()
    time.sleep(1.5)  # the web tier flushes its sums every 0.25 s; the last second's hash is then whole
    children = children_of(client, args.model, time.time())
    first, last = int(started) + EDGE_S, int(ended) - EDGE_S
    seconds = [{k: float(v) for k, v in client.hgetall(second_key(t)).items()} for t in range(first, last)]
    busy = [float(client.hget(rate_key(args.model, t), "busy_s") or 0.0) for t in range(first, last)]
    errors = len(run.results) - len(run.ok())
    summary = (
        f"{args.clients} closed-loop clients on {len(children)} online children for {args.seconds:.0f} s: "
        f"{run.qps():.0f} req/s, P50 {run.percentile_ms(50):.0f} ms, P99 {run.percentile_ms(99):.0f} ms, "
        f"{errors} not 200"
    )
    window = {
        "name": args.name,
        "source": (
            f"recorded by benchmarks/record_window.py on {time.strftime('%Y-%m-%d', time.gmtime(started))} "
            f"({platform.machine()}, {os.cpu_count()} CPUs) from `make run`"
        ),
        "description": summary,
        "model": args.model,
        "seconds": seconds,
        "busy_s": busy,
        "children": children,
        "expect": {"findings": []},
    }
    Path(args.out).write_text(json.dumps(window, indent=1, sort_keys=True) + "\n")
    print(summary)
    print(f"{len(seconds)} seconds written to {args.out}")


if __name__ == "__main__":
    main()
