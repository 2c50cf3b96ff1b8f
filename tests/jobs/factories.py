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
