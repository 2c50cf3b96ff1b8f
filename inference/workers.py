"""What worker children tell the rest of the platform through Redis: that they are alive, and what they did.

Web processes read this to answer /ready and /models and to estimate the drain rate for admission.
Per-second buckets expire by themselves, so nothing here grows without bound.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from platform_ import metrics

WORKERS_KEY = "inference:workers"
BUCKET_TTL_S = 15 * 60


def stats_key(model: str) -> str:
    return f"inference:stats:{model}"


def rate_key(model: str, second: int) -> str:
    return f"inference:rate:{model}:{second}"


@dataclass
class WorkerState:
    """This child's identity and what it is doing; the heartbeat publishes it."""

    queue: str
    models: list[str]
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    state: str = "idle"
    batches: int = 0
    started_at: float = field(default_factory=time.time)

    def as_json(self) -> str:
        return json.dumps({**self.__dict__, "pid": os.getpid(), "ts": time.time(), **_resources()})


_process: Any = None


def _resources() -> dict[str, float | None]:
    """This process's CPU (percent of one core since the last beat), memory and, with CUDA, GPU use."""
    global _process
    import psutil

    if _process is None or _process.pid != os.getpid():
        _process = psutil.Process()
    usage: dict[str, float | None] = {
        "cpu_pct": _process.cpu_percent(None),
        "rss_mb": _process.memory_info().rss / 2**20,
        "gpu_util_pct": None,
        "gpu_mem_mb": None,
    }
    torch = sys.modules.get("torch")  # only children that loaded a model have it; never import it here
    if torch is not None and torch.cuda.is_available():
        usage["gpu_mem_mb"] = torch.cuda.memory_allocated() / 2**20
        try:
            usage["gpu_util_pct"] = float(torch.cuda.utilization())  # needs NVML (the nvidia-ml-py package)
        except Exception:
            pass
    return usage


class Heartbeat:
    """A daemon thread that refreshes this child's entry every interval_s; start() and stop() bound its life."""

    def __init__(self, client: redis.Redis, state: WorkerState, interval_s: float) -> None:
        self.client = client
        self.state = state
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self.client.hset(WORKERS_KEY, self.state.worker_id, self.state.as_json())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except redis.RedisError:
                pass  # Redis away for a moment: the next beat tries again; readers see us as stale meanwhile.

    def stop(self) -> None:
        self._stop.set()
        try:
            self.client.hdel(WORKERS_KEY, self.state.worker_id)
        except redis.RedisError:
            pass


def record_batch(
    client: redis.Redis,
    model: str,
    *,
    done: int,
    texts: int,
    busy_s: float,
    expired: int = 0,
    failed: int = 0,
    pass_sizes: list[int] | None = None,
    inference_s: float = 0.0,
    max_batch_size: int = 1,
) -> None:
    """Count one batch: lifetime totals, the per-second bucket admission reads the drain rate from,
    and the shared metrics (batch sizes and fill, inference time), in one round trip."""
    now_s = int(time.time())
    pipe = client.pipeline(transaction=False)
    totals = {"requests_done": done, "texts_done": texts, "expired_skipped": expired, "failed": failed}
    for name, value in totals.items():
        if value:
            pipe.hincrby(stats_key(model), name, value)
    if pass_sizes:
        pipe.hincrby(stats_key(model), "forward_passes", len(pass_sizes))
        pipe.hincrby(stats_key(model), "forward_texts", sum(pass_sizes))
        metrics.write_pipeline(pipe, metrics.batch_fields(model, pass_sizes, max_batch_size, inference_s))
    pipe.hincrby(stats_key(model), "batches", 1)
    bucket = rate_key(model, now_s)
    pipe.hincrby(bucket, "done", done)
    pipe.hincrbyfloat(bucket, "busy_s", busy_s)
    pipe.expire(bucket, BUCKET_TTL_S)
    pipe.execute()


def alive_workers(raw: dict[str, str], interval_s: float, now: float | None = None) -> list[dict[str, Any]]:
    """Entries whose last beat is fresh: three missed beats and a child counts as gone."""
    now = time.time() if now is None else now
    alive = []
    for value in raw.values():
        entry = json.loads(value)
        if now - entry["ts"] <= 3 * interval_s:
            alive.append(entry)
    return alive


def drain_rate_per_s(buckets: list[dict[str, str]], children: int) -> float | None:
    """Requests per second the serving children can clear, from recent per-second buckets.

    Measured as requests per busy child-second, times the children alive: unlike completions per
    wall second, this does not read low just because traffic was light a moment ago.
    """
    done = sum(int(b.get("done", 0)) for b in buckets)
    busy_s = sum(float(b.get("busy_s", 0.0)) for b in buckets)
    if done == 0 or busy_s <= 0 or children <= 0:
        return None
    return done / busy_s * children
