"""Smoke load against a running stack: N concurrent clients for a fixed time, one text per request.

    python -m benchmarks.smoke [--url http://127.0.0.1:8000] [--model router] [--clients 16] [--seconds 10]

Prints P50/P95/P99 latency, QPS, status counts, the mean batch size requests ran in (from their
timing), and the worker's own pass statistics from Redis.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import redis

from benchmarks.loadgen import HERE, closed_loop
from inference.core.keys import stats_key


def default_token() -> str:
    token = os.environ.get("API_TOKEN")
    if token:
        return token
    creds = HERE.parent / "var" / "credentials.json"
    if creds.exists():
        return json.loads(creds.read_text())["token"]
    raise SystemExit("no API token: set API_TOKEN or run `make run` once (it writes var/credentials.json)")


def worker_stats(redis_url: str, model: str) -> dict[str, int]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    return {k: int(v) for k, v in client.hgetall(stats_key(model)).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", default="router")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = parser.parse_args()

    url = f"{args.url}/api/v1/models/{args.model}/predict"
    before = worker_stats(args.redis_url, args.model)
    run = closed_loop(url, {"Authorization": f"Token {default_token()}"}, args.clients, args.seconds)
    after = worker_stats(args.redis_url, args.model)

    def grew(name: str) -> int:
        return after.get(name, 0) - before.get(name, 0)

    print(f"{args.clients} clients x {args.seconds:.0f} s against {url}")
    print(f"  requests   {len(run.results)}  statuses {dict(Counter(r.status for r in run.results))}")
    if run.ok():
        print(
            f"  latency    P50 {run.percentile_ms(50):.1f} ms  P95 {run.percentile_ms(95):.1f} ms  "
            f"P99 {run.percentile_ms(99):.1f} ms  mean {run.mean_ms():.1f} ms"
        )
        print(f"  throughput {run.qps():.1f} QPS (successful)")
        print(f"  batch size {run.mean_batch():.2f} mean as seen by requests (texts in the pass each ran in)")
    if grew("forward_passes"):
        print(
            f"  worker     {grew('batches')} dispatches of {grew('requests_done') / max(grew('batches'), 1):.2f} requests "
            f"on average, {grew('forward_passes')} forward passes of "
            f"{grew('forward_texts') / grew('forward_passes'):.2f} texts on average"
        )
    print(f"  load generator CPU {run.client_cpu_pct:.0f}% of one core")


if __name__ == "__main__":
    main()
