"""Rows for in-process tests: a job with a few classified rows, some of them low-confidence."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.utils import timezone

from jobs.models import Chunk, ChunkStatus, Job, JobRow, JobStatus, RowStatus


def user(username: str, *, staff: bool = False):
    return get_user_model().objects.create_user(
        username, password="pw-for-tests-123", is_staff=staff, is_superuser=staff
    )


def job_with_rows(owner, *, status: str = JobStatus.SUCCEEDED, labels=("billing", "shipping", "technical", "billing")):
    job = Job.objects.create(owner=owner, model="router", text_column="text", filename="t.csv", status=status,
                             started_at=timezone.now(), total_rows=len(labels))  # fmt: skip
    for index, label in enumerate(labels):
        score = 0.3 if index % 2 else 0.8
        JobRow.objects.create(
            job=job, index=index, text=f"text {index}", status=RowStatus.DONE, label=label, score=score,
            low_confidence=score < 0.4, output={"label": label, "score": score}, attempts=1,
        )  # fmt: skip
    Chunk.objects.create(job=job, first_index=0, end_index=len(labels), status=ChunkStatus.DONE)
    job.refresh_counts()
    return job


def fail_at_run_time(job_id: int, indices, error: str = "inference failed: CUDA out of memory") -> None:
    """Rows of an ended job as if they had failed at run time, as the runner writes a batch whose model raised
    (jobs/runner.py, fail_the_rest: status, error, one attempt), and the job's counts, status and message as its
    end would have set them. A real worker only fails rows this way on a fault no test upload can cause; a
    row's text is kept, so an empty one fails again when retried (the runner checks a retried row's input)."""
    job = Job.objects.get(pk=job_id)
    job.rows.filter(index__in=list(indices)).update(
        status=RowStatus.FAILED, error=error, input_error=False, attempts=1, label="", score=None, output=None,
        low_confidence=False,
    )  # fmt: skip
    # Counted here, not by refresh_counts: that would also rate the ended job's rows over the time until now.
    done = job.rows.filter(status=RowStatus.DONE).count()
    failed = job.rows.filter(status=RowStatus.FAILED).count()
    status = JobStatus.SUCCEEDED if not failed else JobStatus.PARTIAL if done else JobStatus.FAILED
    error = f"{failed} of {job.total_rows} rows failed" if failed else ""
    Job.objects.filter(pk=job_id).update(status=status, done_rows=done, failed_rows=failed, error=error)
