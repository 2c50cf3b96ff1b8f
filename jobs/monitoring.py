"""What offline jobs tell observability: the offline queue's gauges, a rule, the dashboard's job list.

Registered in JobsConfig.ready(). The database is the truth about chunks, so the gauges count rows.
"""

from __future__ import annotations

from typing import Any

from observability.diagnosis import Finding, Snapshot


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


def gauges(client) -> dict[str, float]:
    """Offline chunks queued and running."""
    from jobs.models import Chunk, ChunkStatus

    return {
        "gauge|offline|waiting": Chunk.objects.filter(status=ChunkStatus.QUEUED).count(),
        "gauge|offline|in_flight": Chunk.objects.filter(status=ChunkStatus.RUNNING).count(),
    }


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


def dashboard_section(client, now: float) -> dict[str, Any]:
    """Jobs queued or running, newest first (20 at most)."""
    from jobs.models import Job, JobStatus

    running = Job.objects.filter(status__in=[JobStatus.QUEUED, JobStatus.RUNNING]).select_related("owner")[:20]
    return {
        "jobs": [
            {
                "id": j.pk,
                "filename": j.filename,
                "model": j.model,
                "owner": j.owner.username,
                "status": j.status,
                "done": j.done_rows + j.failed_rows,  # rows run, failed included
                "failed": j.failed_rows,
                "total": j.total_rows,
                "progress_pct": round(j.progress * 100, 1),
                "rows_per_s": round(j.rows_per_s, 1),
                "eta_s": None if j.eta_s is None else round(j.eta_s),
            }
            for j in running
        ]
    }
