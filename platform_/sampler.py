"""Once a second, writes the gauges no request carries: queue depths, workers alive, worker memory.

Runs in every Celery worker's main process (platform_/periodic.py, started in inference/tasks.py);
a Redis lock makes one sample per second whichever workers are up. Queue depth is the first warning of a jam,
so it is sampled even when nobody watches the dashboard.
"""

from __future__ import annotations

import time

from django.conf import settings

from inference.admission import queue_purge
from inference.registry import get_registry
from inference.workers import WORKERS_KEY, alive_workers
from platform_.metrics import GAUGES_KEY, HISTORY_S, second_key
from platform_.redis import get_redis


def queue_depths(client) -> dict[str, float]:
    """Online: waiting in the broker vs admitted in total; offline: chunks queued vs running (the database is the truth)."""
    from jobs.models import Chunk, ChunkStatus

    now = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.llen("online")
    for name in get_registry().names():
        # Expired entries go with their tokens: removed from the sorted set alone, their tokens would
        # stay counted in the backlog for good and admission would refuse more and more.
        queue_purge(pipe, name, now)
    online_waiting, *rest = pipe.execute()
    admitted = sum(rest)
    offline_waiting = Chunk.objects.filter(status=ChunkStatus.QUEUED).count()
    offline_running = Chunk.objects.filter(status=ChunkStatus.RUNNING).count()
    return {
        "gauge|online|waiting": online_waiting,
        "gauge|online|in_flight": max(0, admitted - online_waiting),
        "gauge|offline|waiting": offline_waiting,
        "gauge|offline|in_flight": offline_running,
    }


def worker_gauges(client) -> dict[str, float]:
    workers = alive_workers(client.hgetall(WORKERS_KEY), settings.WORKER_HEARTBEAT_S)
    gauges: dict[str, float] = {}
    for queue in ("online", "offline"):
        children = [w for w in workers if w["queue"] == queue]
        gauges[f"gauge|workers|{queue}"] = len(children)
        gauges[f"gauge|rss_mb|{queue}"] = sum(w.get("rss_mb", 0.0) for w in children)
        gauges[f"gauge|cpu_pct|{queue}"] = sum(w.get("cpu_pct", 0.0) for w in children)
        gpu = [w["gpu_util_pct"] for w in children if w.get("gpu_util_pct") is not None]
        if gpu:
            gauges[f"gauge|gpu_util_pct|{queue}"] = sum(gpu) / len(gpu)
    return gauges


def sample_once(client=None) -> dict[str, float]:
    client = client or get_redis()
    gauges = {**queue_depths(client), **worker_gauges(client)}
    key = second_key(int(time.time()))
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, mapping=gauges)
    pipe.expire(key, HISTORY_S)
    pipe.hset(GAUGES_KEY, mapping={**gauges, "sampled_at": time.time()})
    pipe.execute()
    return gauges


def trim_slow_log(keep: int) -> int:
    """Bounded retention: keep the newest `keep` slow-request rows."""
    from inference.models import SlowRequest

    cutoff = SlowRequest.objects.order_by("-created_at").values_list("created_at", flat=True)[keep : keep + 1]
    if not cutoff:
        return 0
    return SlowRequest.objects.filter(created_at__lte=cutoff[0]).delete()[0]


_last_trim = 0.0


def sample_and_trim() -> None:
    """The sampler's tick: gauges every second, slow-log retention once a minute."""
    global _last_trim
    sample_once()
    if time.time() - _last_trim >= 60:
        _last_trim = time.time()
        trim_slow_log(settings.SLOW_REQUEST_KEEP)
