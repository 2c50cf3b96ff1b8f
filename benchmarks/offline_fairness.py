"""Offline fairness: how long one user's small job waits beside another user's big one, priorities, and
what sharing costs, against a running stack (`make run`).

    python -m benchmarks.offline_fairness [--url http://127.0.0.1:8000] [--big-rows 20000] [--huge-rows 200000]
        [--skip-huge] [--out benchmarks/out/offline_fairness.json]

Users bench-a .. bench-d are created in the stack's database (as benchmarks/fairness.py does: run it with the
stack's PLATFORM_VAR_DIR / DATABASE_URL), bench-c allowed `high` priority where the platform has priorities.
Scenarios, each on an otherwise idle offline worker (jobs of earlier scenarios are cancelled first):

1. small alone: B's 20-row job, upload to end.
2. small beside big: A's --big-rows job runs; once A has 500 rows done, B uploads the same 20-row job.
3. small beside huge: the same beside a --huge-rows job (its ingest is waited for first).
4. priority: C's 1,000-row job alone, then as `high` beside A's normal --big-rows job: C's rows/s (first claim
   to end) beside over alone.
5. sharing: one 20,000-row job alone, then 4 users' 5,000-row jobs at once: total rows/s over alone.
6. online beside offline: an open loop of router predict calls (--online-rate per s, --online-s s) alone,
   then during scenario 5's four jobs: P99 beside over alone.

A scenario that does not end within --timeout-s is reported as such (the small job "> N s").
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import threading
import time
from datetime import datetime
from pathlib import Path

import requests

from benchmarks.loadgen import CORPUS, HERE, open_loop

TERMINAL = {"succeeded", "partial", "failed", "cancelled"}
USERS = ("bench-a", "bench-b", "bench-c", "bench-d")


def bench_users() -> dict[str, str]:
    """API tokens of the bench users, created in the stack's database if missing; bench-c may ask for high."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    tokens = {}
    for name in USERS:
        user, _ = get_user_model().objects.get_or_create(username=name)
        tokens[name] = Token.objects.get_or_create(user=user)[0].key
    try:  # a platform without priorities (before the fair scheduler) has no shares
        from jobs.models import UserShare

        user = get_user_model().objects.get(username="bench-c")
        UserShare.objects.update_or_create(user=user, defaults={"max_priority": "high"})
    except Exception as error:  # noqa: BLE001 -- reported, and the scenario runs as normal priority
        print(f"  (no user shares on this platform: {type(error).__name__}; priorities are not set)")
    return tokens


class Client:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.headers = url, {"Authorization": f"Token {token}"}

    def upload(self, rows: int, seed: int, priority: str = "normal") -> int:
        response = requests.post(
            f"{self.url}/api/v1/jobs",
            files={"file": ("bench.csv", build_csv(rows, seed), "text/csv")},
            data={"text_column": "text", "id_column": "id", "model": "router", "priority": priority},
            headers=self.headers,
            timeout=600,
        )
        if response.status_code != 202:
            raise SystemExit(f"upload refused: {response.status_code} {response.text[:300]}")
        return response.json()["id"]

    def job(self, job_id: int) -> dict:
        return requests.get(f"{self.url}/api/v1/jobs/{job_id}", headers=self.headers, timeout=30).json()

    def cancel(self, job_id: int) -> None:
        requests.post(f"{self.url}/api/v1/jobs/{job_id}/cancel", headers=self.headers, timeout=30)

    def wait(self, job_id: int, until, timeout_s: float, poll_s: float = 0.1) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            time.sleep(poll_s)
        return None

    def wait_end(self, job_id: int, timeout_s: float) -> dict | None:
        return self.wait(job_id, lambda j: j["status"] in TERMINAL, timeout_s, poll_s=0.1)


def build_csv(rows: int, seed: int) -> bytes:
    rng = random.Random(seed)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "text"])
    writer.writerows([f"r{i}", rng.choice(CORPUS)] for i in range(rows))
    return out.getvalue().encode()


def seconds_between(a: str, b: str) -> float:
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


def end_to_end_s(job: dict) -> float:
    return seconds_between(job["created_at"], job["finished_at"])


def running_rate(job: dict) -> float:
    return job["done_rows"] / max(seconds_between(job["started_at"], job["finished_at"]), 1e-6)


def small_job(client: Client, timeout_s: float, seed: int) -> tuple[float | None, dict]:
    """B's 20-row job, upload to end (None: it had not ended within timeout_s)."""
    job_id = client.upload(20, seed)
    first = client.job(job_id)
    job = client.wait_end(job_id, timeout_s)
    if job is None:
        return None, client.job(job_id)
    return end_to_end_s(job), first


def beside(c: dict[str, Client], big_rows: int, timeout_s: float, seed: int) -> dict:
    a, b = c["bench-a"], c["bench-b"]
    big = a.upload(big_rows, seed)
    ready = a.wait(big, lambda j: j["done_rows"] >= 500 or j["status"] in TERMINAL, timeout_s=max(timeout_s, 900))
    if ready is None or ready["status"] in TERMINAL:
        raise SystemExit(f"the {big_rows}-row job did not get under way: {ready}")
    small_s, seen = small_job(b, timeout_s, seed + 1)
    left = a.job(big)
    a.cancel(big)
    a.wait_end(big, 120)
    return {
        "big_rows": big_rows,
        "small_s": small_s,
        "big_done_at_small_end": left["done_rows"],
        "small_first_answer": {k: seen.get(k) for k in ("status", "chunks_ahead", "waiting_reason", "eta_s")},
    }


def priority(c: dict[str, Client], big_rows: int, timeout_s: float) -> dict:
    a, hi = c["bench-a"], c["bench-c"]
    alone = hi.wait_end(hi.upload(1000, 31, "high"), timeout_s)
    big = a.upload(big_rows, 32)
    a.wait(big, lambda j: j["done_rows"] >= 500 or j["status"] in TERMINAL, timeout_s=900)
    with_big = hi.wait_end(hi.upload(1000, 33, "high"), timeout_s)
    a.cancel(big)
    a.wait_end(big, 120)
    if alone is None or with_big is None:
        return {"alone_rows_per_s": None, "beside_rows_per_s": None, "ratio": None}
    r_alone, r_beside = running_rate(alone), running_rate(with_big)
    return {
        "alone_rows_per_s": round(r_alone, 1),
        "beside_rows_per_s": round(r_beside, 1),
        "ratio": round(r_beside / r_alone, 3),
        "beside_end_to_end_s": round(end_to_end_s(with_big), 2),
    }


def online_p99(url: str, token: str, rate_per_s: float, seconds: float) -> dict:
    run = open_loop(
        f"{url}/api/v1/models/router/predict", {"Authorization": f"Token {token}"}, rate_per_s, seconds, seed=7
    )
    non_2xx = sum(1 for r in run.results if r.status != 200)
    return {"p50_ms": run.percentile_ms(50), "p99_ms": run.percentile_ms(99), "non_2xx": non_2xx}


def sharing(c: dict[str, Client], url: str, args) -> dict:
    a = c["bench-a"]
    alone = a.wait_end(a.upload(20_000, 41), args.timeout_s * 20)
    online_alone = online_p99(url, c["bench-d"].headers["Authorization"].split()[1], args.online_rate, args.online_s)
    ids = [(c[name], c[name].upload(5_000, 50 + i)) for i, name in enumerate(USERS)]
    online: dict = {}
    thread = threading.Thread(
        target=lambda: online.update(
            online_p99(url, c["bench-d"].headers["Authorization"].split()[1], args.online_rate, args.online_s)
        )
    )
    # Online load once every job is under way, so it measures online beside the four jobs running.
    for client, job_id in ids:
        client.wait(job_id, lambda j: j["status"] in ("running", *TERMINAL), 600)
    thread.start()
    ended = [client.wait_end(job_id, args.timeout_s * 20) for client, job_id in ids]
    thread.join()
    if alone is None or any(j is None for j in ended):
        return {"ratio": None}
    first_claim = min(datetime.fromisoformat(j["started_at"]) for j in ended)
    last_end = max(datetime.fromisoformat(j["finished_at"]) for j in ended)
    total_rate = sum(j["done_rows"] for j in ended) / (last_end - first_claim).total_seconds()
    return {
        "alone_rows_per_s": round(running_rate(alone), 1),
        "four_users_rows_per_s": round(total_rate, 1),
        "ratio": round(total_rate / running_rate(alone), 3),
        "ends_s_after_first_claim": [
            round((datetime.fromisoformat(j["finished_at"]) - first_claim).total_seconds(), 1) for j in ended
        ],
        "online_alone": online_alone,
        "online_beside": online,
        "online_p99_ratio": (
            round(online["p99_ms"] / online_alone["p99_ms"], 2)
            if online.get("p99_ms") and online_alone.get("p99_ms")
            else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--big-rows", type=int, default=20_000)
    parser.add_argument("--huge-rows", type=int, default=200_000)
    parser.add_argument("--skip-huge", action="store_true")
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="how long a small job may take before it is given up"
    )
    parser.add_argument("--online-rate", type=float, default=10.0, help="online requests per second (scenario 6)")
    parser.add_argument("--online-s", type=float, default=20.0)
    parser.add_argument("--label", default="", help="a name for this run in the output (e.g. before, after)")
    parser.add_argument(
        "--scenarios", default="1,2,3,4,5", help="which to run (comma-separated; 5 includes 6); 2 and 3 need 1"
    )
    parser.add_argument("--out", default=str(HERE / "out" / "offline_fairness.json"))
    args = parser.parse_args()

    clients = {name: Client(args.url, token) for name, token in bench_users().items()}
    chosen = {int(n) for n in args.scenarios.split(",") if n.strip()}
    report: dict = {"label": args.label, "url": args.url}
    alone_s, _ = small_job(clients["bench-b"], args.timeout_s, 1)
    report["small_alone_s"] = alone_s
    print(f"1. B's 20-row job alone: {alone_s:.2f} s" if alone_s else "1. B's 20-row job alone: did not end")
    for key, rows in (("beside_big", args.big_rows), ("beside_huge", args.huge_rows)):
        if (key == "beside_huge" and (args.skip_huge or 3 not in chosen)) or (key == "beside_big" and 2 not in chosen):
            continue
        result = beside(clients, rows, args.timeout_s, seed=10 if key == "beside_big" else 20)
        report[key] = result
        took = result["small_s"]
        ratio = f" = {took / alone_s:.1f}x alone" if took and alone_s else ""
        shown = f"{took:.2f} s{ratio}" if took else f"> {args.timeout_s:.0f} s (not ended)"
        print(
            f"2. B's 20-row job beside A's {rows}-row job: {shown}; A had {result['big_done_at_small_end']} rows done"
            f"; B's job on upload: {result['small_first_answer']}"
        )
    if 4 in chosen:
        report["priority"] = priority(clients, args.big_rows, args.timeout_s * 5)
        print(f"4. high-priority 1,000 rows beside a normal {args.big_rows}-row job: {report['priority']}")
    if 5 in chosen:
        report["sharing"] = sharing(clients, args.url, args)
        print(f"5/6. four users at once against one job alone, online beside: {report['sharing']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
