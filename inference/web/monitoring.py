"""What the online path tells observability: its gauges, its dashboard section, slow-log retention.

Registered in InferenceConfig.ready(); the sampler (observability/sampler.py) calls the gauges once
a second from a worker's main process, the dashboard calls the section on each poll.
"""

from __future__ import annotations

import json
import time
from typing import Any

from django.conf import settings

from inference.core import versions
from inference.core.backlog import queue_purge
from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY, backlog_tokens_key, last_rate_key
from inference.core.queues import online_queues, predicted_wait_s
from inference.core.registry import get_registry
from inference.core.workers import alive_workers, live_dispatchers
from observability.keys import GAUGES_KEY

# A queue with work and no child to do it predicts an infinite wait; a gauge holds a number.
PREDICTED_WAIT_CAP_S = 3600.0


def queue_depths(client) -> dict[str, float]:
    """Waiting in the broker vs admitted in total, per online model queue and summed, and the predicted wait."""
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
    return {
        "gauge|online|waiting": sum(waiting.values()),
        "gauge|online|in_flight": sum(gauges[f"gauge|{name}|in_flight"] for name in queues),
        **gauges,
    }


def serving_children(client, queues: dict[str, list[str]]) -> dict[str, int]:
    """Online children alive per online queue (a child serves a queue when it loaded the queue's models)."""
    workers = alive_workers(client.hgetall(WORKERS_KEY), settings.WORKER_HEARTBEAT_S)
    online = [set(w["models"]) for w in workers if w["queue"] == "online"]
    return {name: sum(1 for loaded in online if set(group) <= loaded) for name, group in queues.items()}


def worker_gauges(client) -> dict[str, float]:
    """Children alive, their memory, CPU and GPU use, per queue (online, offline) and per online queue."""
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


def gauges(client) -> dict[str, float]:
    return {**queue_depths(client), **worker_gauges(client)}


def trim_slow_log(keep: int | None = None) -> int:
    """Bounded retention: keep the newest `keep` slow-request rows (SLOW_REQUEST_KEEP)."""
    from inference.models import SlowRequest

    keep = settings.SLOW_REQUEST_KEEP if keep is None else keep
    cutoff = SlowRequest.objects.order_by("-created_at").values_list("created_at", flat=True)[keep : keep + 1]
    if not cutoff:
        return 0
    return SlowRequest.objects.filter(created_at__lte=cutoff[0]).delete()[0]


def celery_workers(client, children: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """The Celery workers alive (one per `celery worker` command: its main process, which dispatches to
    its pool children), with their queue and how many of the children alive are theirs.

    Flower's "Online workers" counts these, not the children that do the work; the dashboard shows both
    so the two can be compared (issue 24: Flower's 2 against the dashboard's 3).
    """
    raw = client.hgetall(DISPATCHERS_KEY)
    live = live_dispatchers(raw, settings.DISPATCHER_HEARTBEAT_S, now)
    return [
        {
            "id": key,
            "queue": json.loads(raw[key]).get("queue"),
            "processes": sum(1 for child in children if child.get("dispatcher") == key),
        }
        for key in sorted(live)
    ]


def version_roles(client) -> dict[str, dict[str, str]]:
    """{model: {version: role}} for the dashboard's Versions table (issue 21): `active`, `canary` (taking its
    share of callers) and `target` (being loaded to replace the active one), from the deployments' mirror
    in Redis (inference/core/versions.py), or the models file's entry version as active where it has none.
    """
    deployments = versions.deployments_from(client.hgetall(versions.DEPLOYMENTS_KEY), get_registry())
    roles: dict[str, dict[str, str]] = {}
    for model, deployment in deployments.items():
        marked = roles[model] = {deployment.active: "active"}
        if deployment.target and deployment.target != deployment.active:
            marked[deployment.target] = "target"
        if deployment.canary and deployment.canary != deployment.active:
            marked[deployment.canary] = "canary"
    return roles


def dashboard_section(client, now: float) -> dict[str, Any]:
    """Each online queue, every worker child (with its last heartbeat and start), the Celery workers
    those children belong to, the slow-request log."""
    from inference.models import SlowRequest

    gauges = {k: float(v) for k, v in client.hgetall(GAUGES_KEY).items()}
    workers = alive_workers(client.hgetall(WORKERS_KEY), settings.WORKER_HEARTBEAT_S, now)
    return {
        "celery_workers": celery_workers(client, workers, now),
        "online_queues": [
            {
                "name": name,
                "models": models,
                "waiting": gauges.get(f"gauge|{name}|waiting", 0.0),
                "in_flight": gauges.get(f"gauge|{name}|in_flight", 0.0),
                "children": gauges.get(f"gauge|workers|{name}", 0.0),
                "predicted_wait_s": gauges.get(f"gauge|{name}|predicted_wait_s"),
            }
            for name, models in online_queues(get_registry()).items()
        ],
        "workers": [
            {
                "id": w["worker_id"],
                "queue": w["queue"],
                "models": w["models"],
                "state": w["state"],
                "batches": w["batches"],
                "cpu_pct": round(w.get("cpu_pct", 0.0), 1),
                "rss_mb": round(w.get("rss_mb", 0.0)),
                "device": w.get("device"),
                "gpu": w.get("gpu"),
                "gpu_util_pct": w.get("gpu_util_pct"),
                "gpu_mem_mb": w.get("gpu_mem_mb"),
                "gpu_mem_total_mb": w.get("gpu_mem_total_mb"),
                "up_s": round(now - w["started_at"]),
                "started_at": round(w["started_at"], 3),
                "last_beat_s_ago": round(max(0.0, now - w["ts"]), 1),
            }
            for w in sorted(workers, key=lambda w: (w["queue"], w["worker_id"]))
        ],
        "slow": [
            {
                "at": r.created_at.isoformat(timespec="seconds"),
                "request_id": r.request_id,
                "model": r.model,
                "status": r.status,
                "total_ms": round(r.total_ms),
                "queue_wait_ms": r.queue_wait_ms,
                "inference_ms": r.inference_ms,
                "batch_size": r.batch_size,
            }
            for r in SlowRequest.objects.all()[:10]
        ],
    }
