"""Smoke load against a running stack: N concurrent clients for a fixed time, one text per request.

    python -m benchmarks.smoke [--url http://127.0.0.1:8000] [--model router] [--clients 16] [--seconds 10]

Payloads are drawn at random from benchmarks/corpus.txt (72 texts of 2 to 153 words): one repeated
payload would flatter the result. Prints P50/P95/P99 latency, QPS, status counts, the mean batch size
requests ran in (from their timing), and the worker's own pass statistics from Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import redis
import requests

HERE = Path(__file__).resolve().parent
CORPUS = [line for line in (HERE / "corpus.txt").read_text().splitlines() if line.strip()]


def default_token() -> str:
    token = os.environ.get("API_TOKEN")
    if token:
        return token
    creds = HERE.parent / "var" / "credentials.json"
    if creds.exists():
        return json.loads(creds.read_text())["token"]
    raise SystemExit("no API token: set API_TOKEN or run `make run` once (it writes var/credentials.json)")


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(pct / 100 * (len(ordered) - 1))))]


def client_loop(url: str, token: str, stop_at: float, seed: int, out: list[tuple[int, float, int]]) -> None:
    rng = random.Random(seed)
    session = requests.Session()
    headers = {"Authorization": f"Token {token}"}
    while time.monotonic() < stop_at:
        started = time.perf_counter()
        try:
            response = session.post(url, json={"inputs": [rng.choice(CORPUS)]}, headers=headers, timeout=30)
            status = response.status_code
            batch = response.json().get("timing", {}).get("batch_size", 0) if status == 200 else 0
        except requests.RequestException:
            status, batch = 0, 0
        out.append((status, time.perf_counter() - started, batch))


def worker_stats(redis_url: str, model: str) -> dict[str, int]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    return {k: int(v) for k, v in client.hgetall(f"inference:stats:{model}").items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", default="router")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = parser.parse_args()

    url = f"{args.url}/api/v1/models/{args.model}/predict"
    token = default_token()
    before = worker_stats(args.redis_url, args.model)
    results: list[tuple[int, float, int]] = []
    stop_at = time.monotonic() + args.seconds
    threads = [
        threading.Thread(target=client_loop, args=(url, token, stop_at, seed, results)) for seed in range(args.clients)
    ]
    cpu_before = time.process_time()
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.monotonic() - started
    client_cpu = (time.process_time() - cpu_before) / wall_s
    after = worker_stats(args.redis_url, args.model)

    ok = [latency for status, latency, _ in results if status == 200]
    batches = [batch for status, _, batch in results if status == 200]
    passes = after.get("forward_passes", 0) - before.get("forward_passes", 0)
    pass_texts = after.get("forward_texts", 0) - before.get("forward_texts", 0)
    dispatches = after.get("batches", 0) - before.get("batches", 0)
    requests_done = after.get("requests_done", 0) - before.get("requests_done", 0)
    print(f"{args.clients} clients x {args.seconds:.0f} s against {url}")
    print(f"  requests   {len(results)}  statuses {dict(Counter(s for s, _, _ in results))}")
    if ok:
        print(
            f"  latency    P50 {percentile(ok, 50) * 1000:.1f} ms  P95 {percentile(ok, 95) * 1000:.1f} ms  "
            f"P99 {percentile(ok, 99) * 1000:.1f} ms  mean {statistics.mean(ok) * 1000:.1f} ms"
        )
        print(f"  throughput {len(ok) / wall_s:.1f} QPS (successful)")
        print(f"  batch size {statistics.mean(batches):.2f} mean as seen by requests (texts in the pass each ran in)")
    if passes:
        print(
            f"  worker     {dispatches} dispatches of {requests_done / max(dispatches, 1):.2f} requests on average, "
            f"{passes} forward passes of {pass_texts / passes:.2f} texts on average"
        )
    print(f"  load generator CPU {client_cpu * 100:.0f}% of one core")


if __name__ == "__main__":
    main()
