"""The reconciler: the database says what should be running; Redis may have lost the messages.

Runs periodically in the offline worker's main process (jobs/tasks.py) and on demand with
`python manage.py reconcile_jobs`. A worker killed mid-batch or mid-ingest, or a Redis restart that
lost its lists, delays a job by about JOBS_STALL_S but does not lose it; redelivered duplicates are
harmless because a chunk (and an ingest) is claimed before it runs and job counters are recounted
from the rows.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from jobs import callbacks, lifecycle, scheduler
from jobs.models import TERMINAL, Chunk, ChunkStatus, Job, JobStatus

logger = logging.getLogger(__name__)
# An ingest that stalls this many times (its worker killed each time, e.g. out of memory) fails its job.
MAX_INGEST_ATTEMPTS = 3


def reconcile(stall_s: float | None = None) -> dict[str, int]:
    """Re-enqueue stalled chunks, ingests and callbacks, fail hopeless ingests, finish jobs with nothing left;
    returns counts."""
    stall_s = settings.JOBS_STALL_S if stall_s is None else stall_s
    now = timezone.now()
    stale = now - timedelta(seconds=stall_s)
    counts = {"running_requeued": 0, "queued_requeued": 0, "ingests_requeued": 0, "ingests_failed": 0}
    counts["jobs_finished"] = 0

    # A running chunk whose worker went silent: its child died or its message was lost mid-run. It goes
    # back to the scheduler, which sends it again in its turn.
    silent = list(Chunk.objects.filter(status=ChunkStatus.RUNNING, progress_at__lt=stale).values_list("pk", flat=True))
    Chunk.objects.requeue(silent, message_kept=False)
    counts["running_requeued"] = len(silent)

    # Sent chunks are claimed within a few chunks' time (only JOBS_PREFETCH_CHUNKS per child are sent
    # ahead): one sent stall_s ago and still unclaimed lost its message (a Redis restart, a worker
    # frozen with it prefetched). Taken back, it is sent again; a late original is then a duplicate
    # that its claim makes harmless.
    lost = list(Chunk.objects.filter(status=ChunkStatus.QUEUED, dispatched_at__lt=stale).values_list("pk", flat=True))
    counts["queued_requeued"] = Chunk.objects.take_back(lost)
    counts["chunks_sent"] = scheduler.refill()

    flowing = (
        Chunk.objects.filter(progress_at__gte=stale).exists()
        or Job.objects.filter(
            status=JobStatus.INGESTING, ingest_claimed_at__isnull=False, ingest_progress_at__gte=stale
        ).exists()
    )
    requeued, failed = _reconcile_ingests(stale, flowing)
    counts["ingests_requeued"], counts["ingests_failed"] = requeued, failed

    unfinished = Job.objects.exclude(status__in=[*TERMINAL, JobStatus.INGESTING, JobStatus.PENDING]).exclude(
        chunks__status__in=[ChunkStatus.QUEUED, ChunkStatus.RUNNING]
    )
    for job in unfinished:
        job.finish()
        counts["jobs_finished"] += 1
    counts["callbacks_resent"] = callbacks.resend_lost(now, stall_s)
    if any(counts.values()):
        logger.info("reconciler: %s", counts)
    return counts


def _reconcile_ingests(stale, flowing: bool) -> tuple[int, int]:
    """Ingests silent for stall_s: queued again while their upload is stored, else failed. (requeued, failed)

    A claimed ingest that went silent lost its worker. An unclaimed one may only be waiting behind
    other work, so, like queued chunks, it is sent again only when nothing is flowing.
    """
    requeued = failed = 0
    for job in Job.objects.filter(status=JobStatus.INGESTING, ingest_progress_at__lt=stale):
        claimed = job.ingest_claimed_at is not None
        if not claimed and flowing:
            continue
        if not lifecycle.upload_stored(job):
            failed += job.fail("ingest was interrupted and the upload is gone; upload the file again")
        elif claimed and job.ingest_attempts >= MAX_INGEST_ATTEMPTS:
            failed += job.fail(
                f"reading the file stopped {job.ingest_attempts} times without finishing (the worker was lost); "
                "upload it again, perhaps split into smaller files"
            )
        elif job.requeue_ingest():
            lifecycle.enqueue_ingest(job.pk)
            requeued += 1
    return requeued, failed
