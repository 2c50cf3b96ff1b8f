"""What offline jobs tell observability: the offline queue's gauges, a rule, the dashboard's job list and
offline work per user and priority, and the per-user /metrics families.

Registered in JobsConfig.ready(). The database is the truth about chunks, so the gauges count rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jobs.keys import (
    OFFLINE_QUEUED_ROWS_PREFIX,
    OFFLINE_USER_ROWS_PREFIX,
    offline_queued_rows_field,
    user_and_priority,
)
from observability.diagnosis import Finding, Snapshot
from observability.keys import GAUGES_KEY

# The dashboard's rows/s per user and priority: over the last minute, as its other offline rate.
USER_RATE_WINDOW_S = 60


def offline_rate_per_s(client=None, window_s: int = 60) -> float:
    """Rows per second the offline workers write while they work: the last minute's rows over the seconds
    in which any were written. A mean over the whole minute would read low after an idle spell and
    make every ETA too long; this is what the pool does when it has work, which a waiting job will."""
    from observability.metrics import read_seconds
    from platform_.redis import get_redis

    try:
        seconds = read_seconds(client or get_redis(), window_s)
    except Exception:  # an ETA is a courtesy: no Redis, no ETA
        return 0.0
    rows = [sum(v for k, v in second.items() if k.startswith("orows|")) for second in seconds]
    busy = [r for r in rows if r > 0]
    return sum(busy) / len(busy) if busy else 0.0


def queued_rows_by_user() -> dict[tuple[str, str], tuple[int, int]]:
    """(username, priority) -> (live jobs, their rows not yet done or failed), for every owner with a job
    queued or running. Jobs still being read are not counted: their rows do not wait for a worker yet."""
    from django.db.models import Count, F, Sum

    from jobs.models import RUNNABLE, Job

    groups = (
        Job.objects.filter(status__in=RUNNABLE)
        .values("owner__username", "priority")
        .annotate(jobs=Count("pk"), rows=Sum(F("total_rows") - F("done_rows") - F("failed_rows")))
    )
    return {(g["owner__username"], g["priority"]): (g["jobs"], max(int(g["rows"] or 0), 0)) for g in groups}


def gauges(client) -> dict[str, float]:
    """Offline chunks queued and running; rows queued per user and priority (users with live jobs only)."""
    from jobs.models import Chunk, ChunkStatus

    per_user = {offline_queued_rows_field(u, p): float(rows) for (u, p), (_, rows) in queued_rows_by_user().items()}
    # The latest-gauges hash keeps every field ever written: a user whose jobs all ended would go on
    # showing their last figure on /metrics. Their field goes instead, so the series ends with the work.
    stale = [f for f in client.hkeys(GAUGES_KEY) if f.startswith(OFFLINE_QUEUED_ROWS_PREFIX) and f not in per_user]
    if stale:
        client.hdel(GAUGES_KEY, *stale)
    return {
        "gauge|offline|waiting": Chunk.objects.filter(status=ChunkStatus.QUEUED).count(),
        "gauge|offline|in_flight": Chunk.objects.filter(status=ChunkStatus.RUNNING).count(),
        **per_user,
    }


def metric_families(totals: Mapping[str, float], gauges: Mapping[str, float]) -> Iterator[Metric]:
    """/metrics' per-user offline series: rows queued now (users with live jobs) and rows written ever."""
    queued = GaugeMetricFamily(
        "offline_queued_rows",
        "Rows of queued or running offline jobs not yet done or failed, per owner and priority (live jobs only).",
        labels=["user", "priority"],
    )
    written = CounterMetricFamily(
        "offline_user_rows_total", "Rows written by offline jobs, per owner and priority.", labels=["user", "priority"]
    )
    for family, source, prefix in (
        (queued, gauges, OFFLINE_QUEUED_ROWS_PREFIX),
        (written, totals, OFFLINE_USER_ROWS_PREFIX),
    ):
        for name, value in sorted(source.items()):
            labels = user_and_priority(name, prefix)
            if labels is not None:
                family.add_metric(list(labels), value)
        yield family


def offline_stalled(s: Snapshot) -> Finding | None:
    """Chunks queued and no offline child alive to take them: jobs wait for a worker, not for compute."""
    waiting = s.gauges.get("gauge|offline|waiting", 0.0)
    workers = s.gauges.get("gauge|workers|offline")
    if waiting <= 0 or workers is None or workers > 0:
        return None
    return Finding(
        "offline_stalled",
        "offline jobs queued with no offline worker",
        f"{waiting:.0f} chunks queued, 0 offline worker children alive",
        "start the offline worker (celery -Q offline); its chunks are kept and run once it is up",
    )


def user_rates_per_s(client, now: float, window_s: int = USER_RATE_WINDOW_S) -> dict[tuple[str, str], float]:
    """(username, priority) -> rows per second written over the window (its mean, idle seconds included)."""
    from observability.metrics import read_seconds

    totals: dict[tuple[str, str], float] = {}
    for second in read_seconds(client, window_s, now):
        for name, value in second.items():
            key = user_and_priority(name, OFFLINE_USER_ROWS_PREFIX)
            if key is not None:
                totals[key] = totals.get(key, 0.0) + value
    return {key: rows / window_s for key, rows in totals.items()}


def offline_users(client, now: float) -> list[dict[str, Any]]:
    """Offline work per user and priority: live jobs, rows queued, rows/s over the last minute. A user
    whose jobs ended within the minute is listed too, with nothing queued, while the rate still counts them."""
    from jobs.fairshare import BANDS

    queued = queued_rows_by_user()
    rates = user_rates_per_s(client, now)
    # Highest priority first (as they are served), then by user; a band no longer configured last.
    order = {band: rank for rank, band in enumerate(BANDS)}
    keys = sorted(set(queued) | set(rates), key=lambda k: (order.get(k[1], len(BANDS)), k[0]))
    return [
        {
            "user": user,
            "priority": priority,
            "jobs": queued.get((user, priority), (0, 0))[0],
            "rows_queued": queued.get((user, priority), (0, 0))[1],
            "rows_per_s": round(rates.get((user, priority), 0.0), 1),
        }
        for user, priority in keys
    ]


def dashboard_section(client, now: float) -> dict[str, Any]:
    """Jobs queued or running (newest first, 20 at most) with where each stands; offline work per user."""
    from jobs.models import Job, JobStatus
    from jobs.scheduler import standing_of

    running = Job.objects.filter(status__in=[JobStatus.QUEUED, JobStatus.RUNNING]).select_related("owner")[:20]
    jobs = []
    for j in running:
        standing = standing_of(j)
        jobs.append(
            {
                "id": j.pk,
                "filename": j.filename,
                "model": j.model,
                "owner": j.owner.username,
                "priority": j.priority,
                "status": j.status,
                "done": j.done_rows + j.failed_rows,  # rows run, failed included
                "failed": j.failed_rows,
                "total": j.total_rows,
                "progress_pct": round(j.progress * 100, 1),
                "rows_per_s": round(j.rows_per_s, 1),
                # Where it stands under the current shares (jobs/scheduler.py), not its own rate alone.
                "eta_s": None if standing is None or standing.eta_s is None else round(standing.eta_s),
                "chunks_ahead": None if standing is None else standing.chunks_ahead,
                "rows_ahead": None if standing is None else standing.rows_ahead,
                "waiting_reason": "" if standing is None else standing.waiting_reason,
            }
        )
    # The rates end at the last complete second, as the dashboard's own (the current one is still filling).
    return {"jobs": jobs, "offline_users": offline_users(client, now - 1)}


def dashboard_for(data: dict[str, Any], user) -> dict[str, Any]:
    """Staff without the admin's permission to view jobs see their own jobs only on the dashboard (the
    same rule as every jobs path: jobs/permissions.py); the totals stay."""
    from jobs.permissions import Access, reaches_others

    if reaches_others(user, Access.VIEW):
        return data
    jobs = data.get("jobs", [])
    data["jobs"] = [job for job in jobs if job["owner"] == user.username]
    data["offline_users"] = [row for row in data.get("offline_users", []) if row["user"] == user.username]
    data["jobs_hidden"] = len(jobs) - len(data["jobs"])
    return data
