"""The staff dashboard: queue depth, latency, throughput, refusals, batches, workers, jobs, slow requests.

The page polls `data.json` every 2 s and draws its charts itself (no CDN: a user's network may not
reach one). Everything comes from the shared Redis metrics, the worker heartbeats and the database.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from inference.models import SlowRequest
from inference.queues import online_queues
from inference.registry import get_registry
from inference.workers import WORKERS_KEY, alive_workers
from jobs.models import Job, JobStatus
from platform_ import diagnosis, metrics
from platform_.redis import get_redis

SERIES_S = 15 * 60
SERIES_STEP_S = 5
FLOWER_NOTE = (
    "Flower shows every queue (Broker tab: each model's online queue and offline) and the workers, but not individual predictions or chunks: "
    "celery-batches runs a whole batch as one pool job and sends no per-task events. Per-request "
    "figures are here and in the slow-request log."
)


def _series(client, now: float) -> dict[str, list[float | None]]:
    models = get_registry().names()
    fields = [f"req|{m}|ok" for m in models]
    fields += [f"lat|{m}|total|{i}" for m in models for i in range(len(metrics.LATENCY_BUCKETS_S) + 1)]
    fields += ["gauge|online|waiting", "gauge|online|in_flight", "gauge|offline|waiting", "gauge|offline|in_flight"]
    seconds = metrics.read_seconds(client, SERIES_S, now, fields=fields)
    out: dict[str, list[float | None]] = {
        k: [] for k in ("t", "qps", "p50_ms", "p99_ms", "online_depth", "offline_depth")
    }
    start = int(now) - SERIES_S + 1
    for offset in range(0, SERIES_S, SERIES_STEP_S):
        chunk = seconds[offset : offset + SERIES_STEP_S]
        counts = [0.0] * (len(metrics.LATENCY_BUCKETS_S) + 1)
        ok = 0.0
        online: list[float] = []
        offline: list[float] = []
        for second in chunk:
            ok += sum(v for k, v in second.items() if k.startswith("req|"))
            for k, v in second.items():
                if k.startswith("lat|"):
                    counts[int(k.rsplit("|", 1)[1])] += v
            if "gauge|online|waiting" in second:
                online.append(second["gauge|online|waiting"] + second.get("gauge|online|in_flight", 0.0))
            if "gauge|offline|waiting" in second:
                offline.append(second["gauge|offline|waiting"] + second.get("gauge|offline|in_flight", 0.0))
        p50, p99 = metrics.histogram_percentile(counts, 50), metrics.histogram_percentile(counts, 99)
        out["t"].append(start + offset)
        out["qps"].append(round(ok / SERIES_STEP_S, 2))
        out["p50_ms"].append(None if p50 is None else round(p50 * 1000, 1))
        out["p99_ms"].append(None if p99 is None else round(p99 * 1000, 1))
        out["online_depth"].append(max(online) if online else None)
        out["offline_depth"].append(max(offline) if offline else None)
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def dashboard_data(client=None) -> dict[str, Any]:
    client = client or get_redis()
    now = time.time()
    gauges = {k: float(v) for k, v in client.hgetall(metrics.GAUGES_KEY).items()}
    snapshot = diagnosis.snapshot(client, window_s=60)
    findings = diagnosis.diagnose(snapshot)
    workers = alive_workers(client.hgetall(WORKERS_KEY), settings.WORKER_HEARTBEAT_S, now)
    running = Job.objects.filter(status__in=[JobStatus.QUEUED, JobStatus.RUNNING]).select_related("owner")[:20]
    slow = SlowRequest.objects.all()[:10]
    return {
        "now": now,
        "queues": {
            q: {"waiting": gauges.get(f"gauge|{q}|waiting", 0.0), "in_flight": gauges.get(f"gauge|{q}|in_flight", 0.0)}
            for q in ("online", "offline")
        },
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
        "sampled_s_ago": round(now - gauges["sampled_at"], 1) if "sampled_at" in gauges else None,
        "online": {
            "qps": round(snapshot.ok_per_s, 2),
            "p50_ms": _ms(snapshot.p50_s),
            "p95_ms": _ms(snapshot.p95_s),
            "p99_ms": _ms(snapshot.p99_s),
            "refusals_per_s": {k: round(v, 2) for k, v in snapshot.refusals_per_s.items()},
            "timeouts_per_s": round(snapshot.timeouts_per_s, 2),
            "mean_batch_size": None if snapshot.mean_batch_size is None else round(snapshot.mean_batch_size, 2),
            "mean_fill_pct": None if snapshot.mean_fill is None else round(snapshot.mean_fill * 100, 1),
            "offline_rows_per_s": round(snapshot.offline_rows_per_s, 1),
        },
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
            }
            for w in sorted(workers, key=lambda w: (w["queue"], w["worker_id"]))
        ],
        "jobs": [
            {
                "id": j.pk,
                "filename": j.filename,
                "model": j.model,
                "owner": j.owner.username,
                "status": j.status,
                "done": j.done_rows + j.failed_rows,
                "total": j.total_rows,
                "progress_pct": round(j.progress * 100, 1),
                "rows_per_s": round(j.rows_per_s, 1),
                "eta_s": None if j.eta_s is None else round(j.eta_s),
            }
            for j in running
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
            for r in slow
        ],
        "series": _series(client, now),
        "verdict": {
            "text": diagnosis.report(snapshot),
            "findings": [f.__dict__ for f in findings],
        },
        "flower_note": FLOWER_NOTE,
    }


@staff_member_required
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard.html", {"flower_url": settings.FLOWER_URL, "flower_note": FLOWER_NOTE})


@staff_member_required
def dashboard_json(request: HttpRequest) -> JsonResponse:
    return JsonResponse(dashboard_data())
