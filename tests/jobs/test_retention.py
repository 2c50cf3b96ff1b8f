"""Retention: ended jobs past JOBS_RESULT_TTL_DAYS go with their rows, chunks and upload; nothing else does."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import pytest
from django.db import connection
from django.utils import timezone

from jobs import retention, tasks
from jobs.models import Chunk, Job, JobRow, JobStatus, UploadPart
from tests.jobs.factories import job_with_rows, user

pytestmark = pytest.mark.django_db

NOW = timezone.now()


def job_ended(owner, *, days_ago: float | None, status: str = JobStatus.SUCCEEDED, rows: int = 4) -> Job:
    """A job in `status`, ended `days_ago` days before NOW (None: not ended), with rows, a chunk and an upload part."""
    job = job_with_rows(owner, status=status, labels=["billing"] * rows)
    finished = NOW - timedelta(days=days_ago) if days_ago is not None else None
    Job.objects.filter(pk=job.pk).update(finished_at=finished, created_at=NOW - timedelta(days=60))
    UploadPart.objects.create(job=job, seq=0, data=b"key,text\n")
    return job


def alive(*jobs: Job) -> list[int]:
    return sorted(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("pk", flat=True))


def test_only_jobs_ended_before_the_ttl_are_deleted_with_everything_they_hold(caplog):
    owner = user("keeper")
    old = [
        job_ended(owner, days_ago=31),
        job_ended(owner, days_ago=45, status=JobStatus.FAILED),
        job_ended(owner, days_ago=90, status=JobStatus.CANCELLED),
        job_ended(owner, days_ago=30.01, status=JobStatus.PARTIAL),
    ]
    recent = job_ended(owner, days_ago=29.99)
    running = job_ended(owner, days_ago=None, status=JobStatus.RUNNING)  # created 60 days ago, still running
    queued = job_ended(owner, days_ago=None, status=JobStatus.QUEUED)
    # A live job with a stale finished_at (as after a retry, before the field is cleared) is never expired.
    stale = job_ended(owner, days_ago=40, status=JobStatus.RUNNING)

    with caplog.at_level(logging.INFO, logger="jobs.retention"):
        assert retention.expire_jobs(NOW, ttl_days=30, batch=3) == 4

    assert alive(*old) == []
    assert alive(recent, running, queued, stale) == sorted(j.pk for j in (recent, running, queued, stale))
    gone = [j.pk for j in old]
    for model in (JobRow, Chunk, UploadPart):
        assert not model.objects.filter(job_id__in=gone).exists(), model.__name__
    assert JobRow.objects.filter(job=recent).count() == 4
    assert UploadPart.objects.filter(job=running).exists()
    assert "deleted 4 jobs (16 rows)" in caplog.text


def test_a_large_job_goes_in_batches_of_rows():
    job = job_ended(user("big"), days_ago=40, rows=25)
    deletes: list[int] = []  # rows named by each DELETE of rows by id

    def count_deletes(execute, sql, params, many, context):
        if sql.startswith('DELETE FROM "jobs_jobrow" WHERE "jobs_jobrow"."id" IN'):
            deletes.append(len(params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count_deletes):
        assert retention.expire_jobs(NOW, ttl_days=30, batch=10) == 1
    assert deletes == [10, 10, 5], "25 rows in batches of 10: three statements, none holding the whole job"
    assert not Job.objects.filter(pk=job.pk).exists()


def test_zero_keeps_every_job():
    job = job_ended(user("forever"), days_ago=3650)
    assert retention.expire_jobs(NOW, ttl_days=0, batch=10) == 0
    assert Job.objects.filter(pk=job.pk).exists()


def test_a_job_retried_meanwhile_is_not_deleted(monkeypatch):
    """The check runs under the job's lock before each batch: a job back in the queue stops being deleted."""
    job = job_ended(user("retrier"), days_ago=40, status=JobStatus.PARTIAL, rows=6)
    real = retention._delete_job

    def retried_first(job_id: int, now: datetime, ttl_days: int, batch: int) -> int | None:
        Job.objects.filter(pk=job_id).update(status=JobStatus.QUEUED, finished_at=None)
        return real(job_id, now, ttl_days, batch)

    monkeypatch.setattr(retention, "_delete_job", retried_first)
    assert retention.expire_jobs(NOW, ttl_days=30, batch=2) == 0
    assert JobRow.objects.filter(job=job).count() == 6


def test_the_periodic_run_uses_the_settings(settings):
    settings.JOBS_RESULT_TTL_DAYS = 7
    old, recent = job_ended(user("a"), days_ago=8), job_ended(user("b"), days_ago=6)
    assert retention.run() == 1
    assert alive(old, recent) == [recent.pk]


def test_the_offline_worker_starts_the_expirer_only_with_a_ttl(settings, monkeypatch):
    started: list[tuple[str, float]] = []

    class FakePeriodic:
        def __init__(self, name: str, interval_s: float, work) -> None:
            started.append((name, interval_s))
            assert work is retention.run

        def start(self) -> None:
            pass

    monkeypatch.setattr(tasks, "Periodic", FakePeriodic)
    settings.JOBS_RESULT_TTL_DAYS = 0
    tasks._start_expirer()
    assert started == []
    settings.JOBS_RESULT_TTL_DAYS, settings.JOBS_EXPIRE_INTERVAL_S = 30, 600.0
    tasks._start_expirer()
    assert started == [(retention.EXPIRER, 600.0)]
