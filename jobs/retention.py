"""Retention: ended jobs are deleted, with their rows, chunks and stored upload, JOBS_RESULT_TTL_DAYS after they end.

Runs in the offline worker's main process as a Periodic thread every JOBS_EXPIRE_INTERVAL_S (jobs/tasks.py),
like the reconciler: a Celery task would wait behind long offline batches in the pool. One DELETE of
a million-row job would hold its locks and fill the WAL for minutes, so a job's rows go in batches of
`batch` rows, each its own short transaction, and the job row goes last (its chunks and any upload
parts, a handful, with it by cascade).

Each batch locks the job row and checks it is still ended and past its TTL: a job whose failed rows
are retried while it is being deleted (requeue_failed takes the same lock) stops being deleted at
once, though it keeps only the rows not yet deleted. Only a retry of a job older than the TTL, in the
seconds its deletion runs, can meet this.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs import files
from jobs.models import TERMINAL, Job, JobRow, StoredFile

logger = logging.getLogger(__name__)
# The Periodic's name: its lock is `periodic:<name>:lock` (platform_/periodic.py).
EXPIRER = "jobs-expirer"
# Rows deleted per statement: about a tenth of a second of work for PostgreSQL.
BATCH_ROWS = 5_000


def expired(now: datetime, ttl_days: int):
    """Jobs that ended more than ttl_days before `now` (live jobs have no finished_at and never match)."""
    return Job.objects.filter(status__in=TERMINAL, finished_at__lt=now - timedelta(days=ttl_days))


def expire_jobs(now: datetime, ttl_days: int, batch: int = BATCH_ROWS) -> int:
    """Delete the jobs that ended more than `ttl_days` days before `now`, `batch` rows per statement;
    returns how many jobs were deleted. ttl_days <= 0 keeps every job."""
    if ttl_days <= 0:
        return 0
    deleted_jobs = deleted_rows = 0
    for job_id in expired(now, ttl_days).order_by("finished_at").values_list("pk", flat=True):
        rows = _delete_job(job_id, now, ttl_days, batch)
        if rows is not None:
            deleted_jobs += 1
            deleted_rows += rows
    if deleted_jobs:
        logger.info("retention: deleted %d jobs (%d rows) ended over %d days ago", deleted_jobs, deleted_rows, ttl_days)
    return deleted_jobs


def _delete_job(job_id: int, now: datetime, ttl_days: int, batch: int) -> int | None:
    """Delete one job in batches; the rows deleted, or None if the job came back to life meanwhile."""
    rows = 0
    while True:
        with transaction.atomic():
            if not expired(now, ttl_days).select_for_update().filter(pk=job_id).exists():
                return None
            ids = list(JobRow.objects.filter(job_id=job_id).values_list("pk", flat=True)[:batch])
            if not ids:
                Job.objects.filter(pk=job_id).delete()  # chunks and upload parts by cascade
                return rows
            JobRow.objects.filter(pk__in=ids).delete()
            rows += len(ids)


def expire_files(now: datetime) -> int:
    """Delete the uploaded files (OpenAI Files API) past their `expires_at`, a file at a time; how many."""
    deleted = 0
    for file_id in files.expired_uploads(now).values_list("pk", flat=True):
        deleted += StoredFile.objects.filter(pk=file_id).delete()[0] > 0
    if deleted:
        logger.info("retention: deleted %d uploaded files past their expiry", deleted)
    return deleted


def run() -> int:
    """One periodic run with the settings' TTL."""
    now = timezone.now()
    expire_files(now)
    return expire_jobs(now, settings.JOBS_RESULT_TTL_DAYS)
