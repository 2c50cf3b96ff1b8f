"""Load generators shared by the benchmarks: closed loop (N clients back to back) and open loop (a fixed arrival rate).

Payloads are drawn at random from benchmarks/corpus.txt (72 texts of 2 to 153 words): one repeated
payload would flatter the result, as the article warns. The generator measures its own CPU so a
report can say when the generator, not the server, was the limit.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
CORPUS = [line for line in (HERE / "corpus.txt").read_text().splitlines() if line.strip()]


@dataclass
class Result:
    status: int  # 0: no HTTP answer (connection error or client timeout)
    latency_s: float
    batch_size: int = 0
    retry_after: str | None = None


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_pct: float = 0.0  # of one core; Python clients share one GIL

    def ok(self) -> list[float]:
        return [r.latency_s for r in self.results if r.status == 200]

    def count(self, status: int) -> int:
        return sum(1 for r in self.results if r.status == status)

    def qps(self) -> float:
        return len(self.ok()) / self.wall_s if self.wall_s else 0.0

    def percentile_ms(self, pct: float) -> float | None:
        ok = sorted(self.ok())
        return ok[min(len(ok) - 1, int(round(pct / 100 * (len(ok) - 1))))] * 1000 if ok else None

    def mean_ms(self) -> float | None:
        ok = self.ok()
        return statistics.mean(ok) * 1000 if ok else None

    def mean_batch(self) -> float | None:
        sizes = [r.batch_size for r in self.results if r.status == 200 and r.batch_size]
        return statistics.mean(sizes) if sizes else None


def _call(session: requests.Session, url: str, headers: dict[str, str], text: str, timeout_s: float) -> Result:
    started = time.perf_counter()
    try:
        response = session.post(url, json={"inputs": [text]}, headers=headers, timeout=timeout_s)
    except requests.RequestException:
        return Result(0, time.perf_counter() - started)
    latency = time.perf_counter() - started
    batch = 0
    if response.status_code == 200:
        batch = (response.json().get("timing") or {}).get("batch_size", 0)
    return Result(response.status_code, latency, batch, response.headers.get("Retry-After"))


def closed_loop(
    url: str, headers: dict[str, str], clients: int, seconds: float, seed: int = 0, timeout_s: float = 30
) -> Run:
    """`clients` threads, each sending its next request as soon as the last one is answered."""
    run = Run()
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        session = requests.Session()
        while time.monotonic() < stop_at:
            result = _call(session, url, headers, rng.choice(CORPUS), timeout_s)
            with lock:
                run.results.append(result)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    cpu, started = time.process_time(), time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run.wall_s = time.monotonic() - started
    run.client_cpu_pct = (time.process_time() - cpu) / run.wall_s * 100
    return run


def open_loop(
    url: str, headers: dict[str, str], rate_per_s: float, seconds: float, seed: int = 0, timeout_s: float = 30
) -> Run:
    """Requests arrive at a fixed rate whatever the answers do: how overload really comes."""
    run = Run()
    lock = threading.Lock()
    rng = random.Random(seed)
    local = threading.local()

    def one(text: str) -> None:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        result = _call(local.session, url, headers, text, timeout_s)
        with lock:
            run.results.append(result)

    total = int(rate_per_s * seconds)
    cpu, started = time.process_time(), time.monotonic()
    with ThreadPoolExecutor(max_workers=min(512, max(16, int(rate_per_s * 4)))) as pool:
        for i in range(total):
            delay = started + i / rate_per_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, rng.choice(CORPUS))
    run.wall_s = time.monotonic() - started
    run.client_cpu_pct = (time.process_time() - cpu) / run.wall_s * 100
    return run
