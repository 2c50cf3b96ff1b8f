"""The OpenAI Batch API against a running stack (`make run`): validation time, rows/s beside the same rows as a
CSV job, and the web processes' memory while a big file uploads and while an output file downloads.

    python -m benchmarks.batch_api --url http://127.0.0.1:8000 --token KEY
        [--validate-lines 100000] [--run-lines 5000] [--model embedding] [--out benchmarks/out/batch_api.json]

1. validation: a --validate-lines embeddings file is uploaded (web RSS sampled meanwhile), a batch made
   from it, and the time from creation to `in_progress` taken; the batch is then cancelled (running
   100,000 embeddings on a 2-core CPU takes about 20 minutes).
2. throughput: --run-lines lines as a batch, then the same texts as a CSV job, one after the other on an
   otherwise idle stack: rows/s of each from its first claim to its end (the job's started_at and
   finished_at), and the batch's time from its job's end to `completed` (finalizing).
3. download: the batch's output file is streamed with web RSS sampled meanwhile.
4. the --validate-lines input file's content is downloaded twice, web RSS sampled.

Web RSS is the sum over the uvicorn processes listening on --url's port (/proc), sampled every 50 ms;
reported as before, peak and after, in MiB.
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
from urllib.parse import urlsplit

import requests

from benchmarks.loadgen import CORPUS, HERE


def web_pids(port: int) -> list[int]:
    """The uvicorn processes serving `port` (the master and its workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"platform_.server" in cmdline and str(port).encode() in cmdline:
            pids.append(int(entry))
    children = []
    for pid in pids:
        try:
            children += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            pass
    return sorted(set(pids + children))


def rss_mib(pids: list[int]) -> float:
    total_kib = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except OSError:
            pass
    return total_kib / 1024


class RssSampler:
    """Samples the web processes' RSS in a thread while a `with` block runs."""

    def __init__(self, port: int, every_s: float = 0.05) -> None:
        self.pids, self.every_s = web_pids(port), every_s
        self.samples: list[float] = []
        self._stop = threading.Event()

    def __enter__(self) -> RssSampler:
        self.before = rss_mib(self.pids)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(rss_mib(self.pids))
            self._stop.wait(self.every_s)

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()
        self.after = rss_mib(self.pids)

    def report(self) -> dict:
        return {
            "processes": len(self.pids),
            "before_mib": round(self.before, 1),
            "peak_mib": round(max(self.samples, default=self.before), 1),
            "after_mib": round(self.after, 1),
        }


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(CORPUS) for _ in range(count)]


def request_lines(items: list[str], model: str) -> bytes:
    return "".join(
        json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": t}}
        )
        + "\n"
        for i, t in enumerate(items)
    ).encode()


def as_csv(items: list[str]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "text"])
    writer.writerows([f"r{i}", t] for i, t in enumerate(items))
    return out.getvalue().encode()


class Api:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.headers = url.rstrip("/"), {"Authorization": f"Bearer {token}"}

    def upload_file(self, data: bytes) -> dict:
        response = requests.post(
            f"{self.url}/v1/files",
            files={"file": ("requests.jsonl", data)},
            data={"purpose": "batch"},
            headers=self.headers,
            timeout=600,
        )
        response.raise_for_status()
        return response.json()

    def create_batch(self, file_id: str) -> dict:
        body = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
        response = requests.post(f"{self.url}/v1/batches", json=body, headers=self.headers, timeout=600)
        response.raise_for_status()
        return response.json()

    def batch(self, batch_id: str) -> dict:
        return requests.get(f"{self.url}/v1/batches/{batch_id}", headers=self.headers, timeout=30).json()

    def job(self, job_id: int) -> dict:
        return requests.get(f"{self.url}/api/v1/jobs/{job_id}", headers=self.headers, timeout=30).json()

    def wait(self, get, done, timeout_s: float, poll_s: float = 0.05) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = get()
            if done(value):
                return value
            time.sleep(poll_s)
        raise SystemExit(f"timed out after {timeout_s} s: {value}")


def rate(job: dict) -> float:
    started, finished = datetime.fromisoformat(job["started_at"]), datetime.fromisoformat(job["finished_at"])
    return job["done_rows"] / max((finished - started).total_seconds(), 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("PLATFORM_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--token", default=os.environ.get("PLATFORM_TOKEN", ""))
    parser.add_argument("--validate-lines", type=int, default=100_000)
    parser.add_argument("--run-lines", type=int, default=5_000)
    parser.add_argument("--model", default="embedding")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out", default=str(HERE / "out" / "batch_api.json"))
    args = parser.parse_args()
    api = Api(args.url, args.token)
    port = urlsplit(args.url).port or 80
    report: dict = {"url": args.url, "model": args.model}

    # 1. validation of a big file, and the web's memory while it uploads
    data = request_lines(texts(args.validate_lines, 1), args.model)
    with RssSampler(port) as upload_rss:
        started = time.perf_counter()
        uploaded = api.upload_file(data)
        upload_s = time.perf_counter() - started
    created_at = time.perf_counter()
    batch = api.create_batch(uploaded["id"])
    create_s = time.perf_counter() - created_at
    seen = api.wait(lambda: api.batch(batch["id"]), lambda b: b["status"] != "validating", args.timeout_s)
    in_progress_s = time.perf_counter() - created_at
    requests.post(f"{api.url}/v1/batches/{batch['id']}/cancel", headers=api.headers, timeout=60)
    report["validation"] = {
        "lines": args.validate_lines,
        "file_mib": round(len(data) / 2**20, 1),
        "upload_s": round(upload_s, 2),
        "upload_web_rss": upload_rss.report(),
        "create_answer_s": round(create_s, 2),
        "status_after": seen["status"],
        "creation_to_in_progress_s": round(in_progress_s, 2),
    }
    print("1. validation:", report["validation"], flush=True)
    api.wait(lambda: api.batch(batch["id"]), lambda b: b["status"] in ("cancelled", "failed"), args.timeout_s, 0.5)

    # 2. the same rows as a batch and as a CSV job
    items = texts(args.run_lines, 2)
    batch = api.create_batch(api.upload_file(request_lines(items, args.model))["id"])
    done = api.wait(
        lambda: api.batch(batch["id"]), lambda b: b["status"] in ("completed", "failed"), args.timeout_s, 0.5
    )
    batch_job = api.job(done["job_id"])
    finalizing_s = done["completed_at"] - datetime.fromisoformat(batch_job["finished_at"]).timestamp()
    response = requests.post(
        f"{api.url}/api/v1/jobs",
        files={"file": ("rows.csv", as_csv(items), "text/csv")},
        data={"text_column": "text", "id_column": "id", "model": args.model},
        headers=api.headers,
        timeout=600,
    )
    response.raise_for_status()
    job = api.wait(
        lambda: api.job(response.json()["id"]),
        lambda j: j["status"] in ("succeeded", "partial", "failed"),
        args.timeout_s,
        0.5,
    )
    report["throughput"] = {
        "lines": args.run_lines,
        "batch_rows_per_s": round(rate(batch_job), 1),
        "csv_job_rows_per_s": round(rate(job), 1),
        "ratio": round(rate(batch_job) / rate(job), 3),
        "finalizing_s": round(finalizing_s, 2),
        "output_file_mib": None,
    }
    print("2. throughput:", report["throughput"], flush=True)

    # 3. the output file's download, and the web's memory meanwhile
    with RssSampler(port) as download_rss:
        started = time.perf_counter()
        got = 0
        with requests.get(
            f"{api.url}/v1/files/{done['output_file_id']}/content", headers=api.headers, stream=True, timeout=600
        ) as stream:
            for block in stream.iter_content(1 << 20):
                got += len(block)
        download_s = time.perf_counter() - started
    report["throughput"]["output_file_mib"] = round(got / 2**20, 1)
    report["download"] = {
        "mib": round(got / 2**20, 1),
        "seconds": round(download_s, 2),
        "web_rss": download_rss.report(),
    }
    print("3. download:", report["download"], flush=True)

    # 4. the big input file's content, twice (memory must not grow with the file's size)
    report["input_download"] = []
    for _ in range(2):
        with RssSampler(port) as input_rss:
            got = 0
            with requests.get(
                f"{api.url}/v1/files/{uploaded['id']}/content", headers=api.headers, stream=True, timeout=600
            ) as stream:
                for block in stream.iter_content(1 << 20):
                    got += len(block)
        report["input_download"].append({"mib": round(got / 2**20, 1), "web_rss": input_rss.report()})
    print("4. input file download:", report["input_download"], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
