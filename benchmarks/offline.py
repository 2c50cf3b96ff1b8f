"""Offline throughput: a CSV job end to end through a running stack, against the raw model in one run.

    python -m benchmarks.offline [--rows 20000] [--via api|form] [--url http://127.0.0.1:8000] [--model router]

1. Builds a CSV of --rows texts drawn at random (seeded) from benchmarks/corpus.txt.
2. Uploads it (API, or the /jobs/ web form with the admin login from var/credentials.json), polls the job
   to its end and takes rows/s from created_at to finished_at (ingest included) and from started_at.
3. With the stack idle, runs the same texts through the same model in this process, one torch thread
   like an offline worker child, in dispatches of JOBS_DISPATCH_ROWS rows cut into length-sorted passes
   by the model's limits: the ceiling the offline path is measured against.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import time
from datetime import datetime
from pathlib import Path

import requests

from benchmarks.ceiling import load_handler, sorted_passes_rate
from benchmarks.loadgen import CORPUS
from benchmarks.smoke import default_token

HERE = Path(__file__).resolve().parent


def build_csv(rows: int, seed: int = 11) -> tuple[bytes, list[str]]:
    rng = random.Random(seed)
    texts = [rng.choice(CORPUS) for _ in range(rows)]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "text"])
    writer.writerows([f"r{i}", t] for i, t in enumerate(texts))
    return out.getvalue().encode(), texts


def upload_api(url: str, token: str, data: bytes, model: str) -> int:
    response = requests.post(
        f"{url}/api/v1/jobs",
        files={"file": ("bench.csv", data, "text/csv")},
        data={"text_column": "text", "id_column": "id", "model": model},
        headers={"Authorization": f"Token {token}"},
        timeout=600,
    )
    response.raise_for_status()
    return response.json()["id"]


def upload_form(url: str, data: bytes, model: str) -> int:
    creds = json.loads((HERE.parent / "var" / "credentials.json").read_text())
    session = requests.Session()
    login = f"{url}/accounts/login/"
    session.get(login, timeout=10)
    session.post(
        login,
        data={
            "username": creds["username"],
            "password": creds["password"],
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
        },
        headers={"Referer": login},
        timeout=10,
    )
    response = session.post(
        f"{url}/jobs/",
        data={
            "model": model,
            "text_column": "text",
            "id_column": "id",
            "encoding": "utf-8",
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
        },
        files={"file": ("bench-form.csv", data, "text/csv")},
        headers={"Referer": f"{url}/jobs/"},
        timeout=600,
    )
    response.raise_for_status()
    return int(response.url.rstrip("/").rsplit("/", 1)[1])


def wait_job(url: str, token: str, job_id: int) -> dict:
    headers = {"Authorization": f"Token {token}"}
    last = -1
    while True:
        job = requests.get(f"{url}/api/v1/jobs/{job_id}", headers=headers, timeout=30).json()
        finished = job["done_rows"] + job["failed_rows"]
        if finished != last:
            print(
                f"\r  job {job_id}: {job['status']} {finished}/{job['total_rows']} rows, {job['rows_per_s']:.1f} rows/s",
                end="",
                flush=True,
            )
            last = finished
        if job["status"] in ("succeeded", "partial", "failed", "cancelled"):
            print()
            return job
        time.sleep(1)


def seconds_between(a: str, b: str) -> float:
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


def raw_ceiling(texts: list[str], model: str, dispatch_rows: int) -> float:
    """Rows per second of the model in this process: one thread, length-sorted passes per dispatch."""
    return sorted_passes_rate(load_handler(model), texts, dispatch_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--via", choices=["api", "form"], default="api")
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", default="router")
    parser.add_argument("--dispatch-rows", type=int, default=int(os.environ.get("JOBS_DISPATCH_ROWS", 1024)))
    parser.add_argument("--skip-raw", action="store_true", help="only the job, not the in-process ceiling")
    args = parser.parse_args()

    data, texts = build_csv(args.rows)
    token = default_token()
    print(f"{args.rows}-row job through the {args.via} ({len(data) / 1e6:.1f} MB) on model {args.model}")
    job_id = (
        upload_api(args.url, token, data, args.model) if args.via == "api" else upload_form(args.url, data, args.model)
    )
    job = wait_job(args.url, token, job_id)
    end_to_end_s = seconds_between(job["created_at"], job["finished_at"])
    running_s = seconds_between(job["started_at"], job["finished_at"])
    exported = requests.get(
        f"{args.url}/api/v1/jobs/{job_id}/results.csv", headers={"Authorization": f"Token {token}"}, timeout=600
    )
    indexes = [int(r["index"]) for r in csv.DictReader(io.StringIO(exported.text))]
    platform_rate = args.rows / end_to_end_s
    print(f"  status {job['status']}: {job['done_rows']} done, {job['failed_rows']} failed")
    print(f"  export: {len(indexes)} rows, each index once: {sorted(indexes) == list(range(args.rows))}")
    print(
        f"  end to end (upload to last row) {end_to_end_s:.1f} s = {platform_rate:.1f} rows/s; from first claim {args.rows / running_s:.1f} rows/s"
    )
    if args.skip_raw:
        return
    ceiling = raw_ceiling(texts, args.model, args.dispatch_rows)
    print(f"  raw model in-process, 1 thread, length-sorted dispatches of {args.dispatch_rows}: {ceiling:.1f} rows/s")
    print(
        f"  platform / ceiling = {platform_rate / ceiling:.2f} (end to end), {args.rows / running_s / ceiling:.2f} (from first claim)"
    )


if __name__ == "__main__":
    main()
