"""What happens to a job between upload and its end: create, enqueue, cancel, retry, finish."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import IO

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from jobs.ingest import IngestLimits, check_encoding, ingest
from jobs.models import TERMINAL, Chunk, ChunkStatus, Job, JobRow, JobStatus, RowStatus


def ingest_limits() -> IngestLimits:
    return IngestLimits(
        max_rows=settings.JOBS_MAX_ROWS,
        max_text_chars=settings.JOBS_MAX_TEXT_CHARS,
        batch_rows=settings.JOBS_INGEST_BATCH_ROWS,
        chunk_rows=settings.JOBS_CHUNK_ROWS,
    )


def create_job(
    *,
    owner,
    model: str,
    upload: IO[bytes],
    filename: str,
    text_column: str,
    id_column: str = "",
    encoding: str = "utf-8",
    delimiter: str | None = None,
) -> Job:
    """Read the CSV into a new job and queue its chunks; on a bad file raise IngestError and leave nothing."""
    job = Job.objects.create(
        owner=owner,
        model=model,
        filename=filename[:255],
        text_column=text_column,
        id_column=id_column,
        encoding=check_encoding(encoding),
        status=JobStatus.INGESTING,
    )
    try:
        chunks = ingest(job, upload, delimiter=delimiter, limits=ingest_limits())
    except BaseException:  # IngestError above all, but nothing half-made survives any failure
        job.delete()
        raise
    enqueue(chunks)
    return job


def enqueue(chunks: Iterable[Chunk]) -> None:
    """Send chunk ids to the offline queue once the transaction that made them visible has committed."""
    from jobs.tasks import run_chunk  # the task module imports this one

    payload = [{"chunk_id": c.pk, "model": c.job.model, "rows": c.size} for c in chunks]

    def send() -> None:
        for kwargs in payload:
            run_chunk.apply_async(kwargs=kwargs)

    transaction.on_commit(send)


def cancel(job: Job) -> bool:
    """Stop a job: remaining chunks are not run, rows done so far are kept. False if it had already ended."""
    with transaction.atomic():
        updated = (
            Job.objects.filter(pk=job.pk)
            .exclude(status__in=TERMINAL)
            .update(status=JobStatus.CANCELLED, finished_at=timezone.now())
        )
        if not updated:
            return False
        job.chunks.exclude(status=ChunkStatus.DONE).update(status=ChunkStatus.CANCELLED)
        job.rows.filter(status=RowStatus.PENDING).update(status=RowStatus.CANCELLED)
    job.refresh_from_db()
    job.refresh_counts()
    return True


def retry_failed(job: Job) -> int:
    """Re-run only the failed rows of an ended job; returns how many rows were queued again."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job.pk)
        if not job.is_terminal:
            return 0
        failed = list(job.rows.filter(status=RowStatus.FAILED).values_list("index", flat=True))
        if not failed:
            return 0
        job.rows.filter(status=RowStatus.FAILED).update(status=RowStatus.PENDING, error="")
        # Chunks are contiguous ranges sorted by first index: find each failed row's chunk by bisection
        # rather than one OR-ed range condition per row (a query that grows with the failures).
        all_chunks = list(job.chunks.order_by("first_index"))
        starts = [c.first_index for c in all_chunks]
        chunks = [all_chunks[i] for i in sorted({bisect.bisect_right(starts, index) - 1 for index in failed})]
        Chunk.objects.filter(pk__in=[c.pk for c in chunks]).update(
            status=ChunkStatus.QUEUED, enqueued_at=timezone.now(), progress_at=None
        )
        job.status, job.finished_at, job.error = JobStatus.QUEUED, None, ""
        job.save(update_fields=["status", "finished_at", "error"])
        job.refresh_counts()
        enqueue(chunks)
    return len(failed)


def finish_if_done(job_id: int) -> None:
    """Give a job its terminal status once no chunk is left to run."""
    job = Job.objects.get(pk=job_id)
    if job.is_terminal or job.chunks.filter(status__in=[ChunkStatus.QUEUED, ChunkStatus.RUNNING]).exists():
        return
    job.refresh_counts()
    if job.failed_rows == 0:
        status = JobStatus.SUCCEEDED
    elif job.done_rows == 0:
        status = JobStatus.FAILED
    else:
        status = JobStatus.PARTIAL
    error = f"{job.failed_rows} of {job.total_rows} rows failed" if job.failed_rows else ""
    Job.objects.filter(pk=job.pk).exclude(status__in=TERMINAL).update(
        status=status, finished_at=timezone.now(), error=error
    )


def mark_started(job_ids: Iterable[int]) -> None:
    ids = list(job_ids)
    Job.objects.filter(pk__in=ids, started_at__isnull=True).update(started_at=timezone.now())
    Job.objects.filter(pk__in=ids, status=JobStatus.QUEUED).update(status=JobStatus.RUNNING)


def rows_of(chunks: Iterable[Chunk]) -> Q:
    """A filter for the rows of these chunks."""
    q = Q(pk__in=[])
    for chunk in chunks:
        q |= Q(job_id=chunk.job_id, index__gte=chunk.first_index, index__lt=chunk.end_index)
    return q


def pending_rows(chunks: list[Chunk]) -> list[JobRow]:
    return list(JobRow.objects.filter(rows_of(chunks), status=RowStatus.PENDING).only("pk", "job_id", "index", "text"))
