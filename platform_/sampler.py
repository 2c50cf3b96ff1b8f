"""Once a second, writes the gauges no request carries: queue depths, workers alive, worker memory.

Runs in every Celery worker's main process (platform_/periodic.py, started in inference/tasks.py);
a Redis lock makes one sample per second whichever workers are up. Queue depth is the first warning of a jam,
so it is sampled even when nobody watches the dashboard.
"""

from __future__ import annotations

import time

from django.conf import settings

from inference.admission import backlog_tokens_key, last_rate_key, queue_purge
from inference.queues import online_queues, predicted_wait_s
from inference.registry import get_registry
from inference.workers import WORKERS_KEY, alive_workers
from platform_.metrics import GAUGES_KEY, HISTORY_S, second_key
from platform_.redis import get_redis

# A queue with work and no child to do it predicts an infinite wait; a gauge holds a number.
PREDICTED_WAIT_CAP_S = 3600.0


def queue_depths(client) -> dict[str, float]:
    """Online: waiting in the broker vs admitted in total, per model queue and summed; offline: chunks
    queued vs running (the database is the truth)."""
    from jobs.models import Chunk, ChunkStatus

    now = time.time()
    queues = online_queues(get_registry())
    models = [model for group in queues.values() for model in group]
    pipe = client.pipeline(transaction=False)
    for name in queues:
        pipe.llen(name)
    for model in models:
        # Expired entries go with their tokens: removed from the sorted set alone, their tokens would
        # stay counted in the backlog for good and admission would refuse more and more.
        queue_purge(pipe, model, now)
    for model in models:
        pipe.hget(backlog_tokens_key(model), "all")
        pipe.get(last_rate_key(model))
    replies = iter(pipe.execute())
    waiting = {name: next(replies) for name in queues}
    admitted = {model: next(replies) for model in models}
    tokens, rates = {}, {}
    for model in models:
        tokens[model], rate = float(next(replies) or 0), next(replies)
        rates[model] = float(rate) if rate else None
    children = serving_children(client, queues)
    gauges: dict[str, float] = {}
    for name, group in queues.items():
        gauges[f"gauge|{name}|waiting"] = waiting[name]
        gauges[f"gauge|{name}|in_flight"] = max(0, sum(admitted[m] for m in group) - waiting[name])
        wait_s = predicted_wait_s({m: tokens[m] for m in group}, rates, children[name])
        if wait_s is not None:
            gauges[f"gauge|{name}|predicted_wait_s"] = min(wait_s, PREDICTED_WAIT_CAP_S)
    offline_waiting = Chunk.objects.filter(status=ChunkStatus.QUEUED).count()
    offline_running = Chunk.objects.filter(status=ChunkStatus.RUNNING).count()
    return {
        "gauge|online|waiting": sum(waiting.values()),
        "gauge|online|in_flight": sum(gauges[f"gauge|{name}|in_flight"] for name in queues),
        **gauges,
        "gauge|offline|waiting": offline_waiting,
        "gauge|offline|in_flight": offline_running,
    }


def serving_children(client, queues: dict[str, list[str]]) -> dict[str, int]:
    """Online children alive per online queue (a child serves a queue when it loaded the queue's models)."""
    workers = alive_workers(client.hgetall(WORKERS_KEY), settings.WORKER_HEARTBEAT_S)
    online = [set(w["models"]) for w in workers if w["queue"] == "online"]
    return {name: sum(1 for loaded in online if set(group) <= loaded) for name, group in queues.items()}


def worker_gauges(client) -> dict[str, float]:
    workers = alive_workers(client.hgetall(WORKERS_KEY), settings.WORKER_HEARTBEAT_S)
    gauges: dict[str, float] = {}
    for name, count in serving_children(client, online_queues(get_registry())).items():
        gauges[f"gauge|workers|{name}"] = count
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
