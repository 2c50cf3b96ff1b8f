"""The reconciler: the database says what should be running; Redis may have lost the messages.

Runs periodically in the offline worker's main process (jobs/tasks.py) and on demand with
`python manage.py reconcile_jobs`. A worker killed mid-batch, or a Redis restart that lost its lists,
delays a job by about JOBS_STALL_S but does not lose it; redelivered duplicates are harmless because a
chunk is claimed before it runs and job counters are recounted from the rows.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from jobs import lifecycle
from jobs.models import TERMINAL, Chunk, ChunkStatus, Job, JobStatus

logger = logging.getLogger(__name__)


def reconcile(stall_s: float | None = None) -> dict[str, int]:
    """Re-enqueue stalled chunks, fail interrupted ingests, finish jobs with nothing left; returns counts."""
    stall_s = settings.JOBS_STALL_S if stall_s is None else stall_s
    now = timezone.now()
    stale = now - timedelta(seconds=stall_s)
    counts = {"running_requeued": 0, "queued_requeued": 0, "ingests_failed": 0, "jobs_finished": 0}

    counts["ingests_failed"] = Job.objects.filter(
        status=JobStatus.INGESTING, created_at__lt=now - timedelta(seconds=settings.OFFLINE_TIME_LIMIT_S)
    ).update(status=JobStatus.FAILED, error="ingest was interrupted; upload the file again", finished_at=now)

    # A running chunk whose worker went silent: its child died or its message was lost mid-run.
    silent = list(Chunk.objects.filter(status=ChunkStatus.RUNNING, progress_at__lt=stale).select_related("job"))
    Chunk.objects.filter(pk__in=[c.pk for c in silent]).update(status=ChunkStatus.QUEUED, enqueued_at=now)
    counts["running_requeued"] = len(silent)

    # Queued chunks wait legitimately while the workers make progress elsewhere; when nothing has
    # progressed for stall_s, their messages are gone (or no worker runs), so send them again,
    # at most once per stall_s each.
    flowing = Chunk.objects.filter(progress_at__gte=stale).exists()
    waiting: list[Chunk] = []
    if not flowing:
        waiting = list(Chunk.objects.filter(status=ChunkStatus.QUEUED, enqueued_at__lt=stale).select_related("job"))
        Chunk.objects.filter(pk__in=[c.pk for c in waiting]).update(enqueued_at=now)
    counts["queued_requeued"] = len(waiting)
    lifecycle.enqueue(silent + waiting)

    unfinished = Job.objects.exclude(status__in=[*TERMINAL, JobStatus.INGESTING, JobStatus.PENDING]).exclude(
        chunks__status__in=[ChunkStatus.QUEUED, ChunkStatus.RUNNING]
    )
    for job in unfinished:
        lifecycle.finish_if_done(job.pk)
        counts["jobs_finished"] += 1
    if any(counts.values()):
        logger.info("reconciler: %s", counts)
    return counts
