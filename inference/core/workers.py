"""What worker children tell the rest of the platform through Redis: that they are alive, and what they did.

Web processes read this to answer /ready and /models and to estimate the drain rate for admission.
Per-second buckets expire by themselves, so nothing here grows without bound.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from inference.core import gpu
from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY, rate_key, stats_key
from observability import metrics
from platform_.redis import Increments

BUCKET_TTL_S = 15 * 60


@dataclass
class WorkerState:
    """This child's identity and what it is doing; the heartbeat publishes it."""

    queue: str
    models: list[str]
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # The main process that dispatches to this child (prefork: the parent).
    dispatcher: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getppid()}")
    state: str = "idle"
    batches: int = 0
    started_at: float = field(default_factory=time.time)
    # Where this child's models run ("cpu", "cuda:1"): set by runtime.load before the state is built.
    device: str = field(default_factory=gpu.loaded_device)
    # model -> versions loaded and warm here (inference/child/versions.py); a swap waits for every child.
    versions: dict[str, list[str]] = field(default_factory=dict)
    # "model@version" -> {"error", "changed_at"}: a version this child refused to load (checksum mismatch,
    # load error) for the deployment changed at `changed_at`; an older deployment's refusals are history.
    version_errors: dict[str, dict[str, Any]] = field(default_factory=dict)
    # model -> the deployment change (its changed_at) the version keeper has acted on: `versions` is what
    # this child holds after that change. A switch counts only children that have seen it, so a child
    # that unloaded the old version just before a rollback is not taken as still holding it.
    versions_seen: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> str:
        return json.dumps({**self.__dict__, "pid": os.getpid(), "ts": time.time(), **_resources()})


_process: Any = None


def _resources() -> dict[str, Any]:
    """This process's CPU (percent of one core since the last beat) and memory, and its GPU's use and
    memory from NVML, with `gpu` saying which GPU or why there are no GPU figures (inference/core/gpu.py)."""
    global _process
    import psutil

    if _process is None or _process.pid != os.getpid():
        _process = psutil.Process()
    return {
        "cpu_pct": _process.cpu_percent(None),
        "rss_mb": _process.memory_info().rss / 2**20,
        **gpu.heartbeat_fields(),
    }


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
    tokens: int = 0,
    expired: int = 0,
    failed: int = 0,
    pass_sizes: list[int] | None = None,
    inference_s: float = 0.0,
    max_batch_size: int = 1,
    batch: bool = True,
    pipe: redis.client.Pipeline | None = None,
) -> None:
    """Count one batch: lifetime totals, the per-second bucket admission reads the drain rate from
    (requests, tokens and busy child-seconds), and the shared metrics (batch sizes and fill,
    inference time), in one round trip. `batch=False` counts requests dropped before dispatch.
    With `pipe`, the commands are queued on it for the caller to execute with its own."""
    now_s = int(time.time())
    counters = Increments()
    totals = {"requests_done": done, "texts_done": texts, "expired_skipped": expired, "failed": failed}
    for name, value in totals.items():
        if value:
            counters.hincrby(stats_key(model), name, value)
    if pass_sizes:
        counters.hincrby(stats_key(model), "forward_passes", len(pass_sizes))
        counters.hincrby(stats_key(model), "forward_texts", sum(pass_sizes))
        metrics.write_pipeline(counters, metrics.batch_fields(model, pass_sizes, max_batch_size, inference_s))
    if batch:
        counters.hincrby(stats_key(model), "batches", 1)
    if busy_s > 0:
        bucket = rate_key(model, now_s)
        counters.hincrby(bucket, "done", done)
        counters.hincrby(bucket, "tokens", tokens)
        counters.hincrbyfloat(bucket, "busy_s", busy_s)
        counters.expire(bucket, BUCKET_TTL_S)
    if pipe is None:
        pipe = client.pipeline(transaction=False)
        counters.queue_on(pipe)
        pipe.execute()
    else:
        counters.queue_on(pipe)


_dispatcher_beat: Any = None  # the timer entry of this process's dispatcher heartbeat


def dispatcher_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def start_dispatcher_heartbeat(timer: Any, queue: str) -> None:
    """Beat from the worker main process's own event loop (its kombu timer), so the beats stop when
    that loop stops dispatching: SIGSTOP, a wedged consumer, a dead broker connection."""
    from django.conf import settings

    from platform_.redis import get_redis

    global _dispatcher_beat
    if _dispatcher_beat is not None:
        try:
            _dispatcher_beat.cancel()  # the old timer's entry, if that timer still runs it
        except Exception:
            pass
    client, me = get_redis(), dispatcher_id()

    def beat() -> None:
        try:
            now = time.time()
            client.hset(DISPATCHERS_KEY, me, json.dumps({"queue": queue, "ts": now}))
            if random.random() < 0.01:  # now and then, forget dispatchers gone for an hour
                stale = [k for k, v in client.hgetall(DISPATCHERS_KEY).items() if now - json.loads(v)["ts"] > 3600]
                if stale:
                    client.hdel(DISPATCHERS_KEY, *stale)
        except redis.RedisError:
            pass  # readers see this dispatcher as stale until Redis answers again

    beat()
    _dispatcher_beat = timer.call_repeatedly(settings.DISPATCHER_HEARTBEAT_S, beat)


def live_dispatchers(raw: dict[str, str], interval_s: float, now: float | None = None) -> set[str]:
    """Dispatchers whose last beat is fresh (three missed beats and one counts as stopped)."""
    now = time.time() if now is None else now
    return {key for key, value in raw.items() if now - json.loads(value)["ts"] <= 3 * interval_s}


def alive_workers(raw: dict[str, str], interval_s: float, now: float | None = None) -> list[dict[str, Any]]:
    """Entries whose last beat is fresh: three missed beats and a child counts as gone."""
    now = time.time() if now is None else now
    alive = []
    for value in raw.values():
        entry = json.loads(value)
        if now - entry["ts"] <= 3 * interval_s:
            alive.append(entry)
    return alive


def serving_workers(
    children_raw: dict[str, str],
    dispatchers_raw: dict[str, str],
    interval_s: float,
    dispatcher_interval_s: float,
    now: float | None = None,
) -> list[dict[str, Any]]:
    """Children alive whose dispatcher is alive too: the ones that will actually receive work."""
    live = live_dispatchers(dispatchers_raw, dispatcher_interval_s, now)
    return [w for w in alive_workers(children_raw, interval_s, now) if w.get("dispatcher") in live]


def drain_rate_per_s(buckets: list[dict[str, str]], children: int, unit: str = "done") -> float | None:
    """Requests (`unit="done"`) or tokens (`unit="tokens"`) per second the serving children can clear.

    Measured per busy child-second, times the children alive: unlike completions per wall second,
    this does not read low just because traffic was light a moment ago. In tokens it does not
    collapse after a burst of heavy requests either, as requests per second did.
    """
    done = sum(float(b.get(unit, 0)) for b in buckets)
    busy_s = sum(float(b.get("busy_s", 0.0)) for b in buckets)
    if done == 0 or busy_s <= 0 or children <= 0:
        return None
    return done / busy_s * children
