"""A user's offline share and quotas: their weight, highest priority, and how much they may have queued.

Staff set them per user (UserShare, in the admin); everything unset falls back to the JOBS_DEFAULT_* /
JOBS_MAX_*_PER_USER settings. Quotas are checked when a job is created (its size is not known yet,
so against what the user already has) and again when its file has been read (its own rows counted).
A refusal is a 429 whose message names the quota, the user's use and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db.models import F, Sum

from jobs.fairshare import BANDS, band_rank
from jobs.ingest import IngestError, shown
from jobs.models import TERMINAL, Job, JobStatus, UserShare


@dataclass(frozen=True)
class Share:
    weight: float
    max_priority: str
    max_queued_rows: int
    max_unfinished_jobs: int


class QuotaExceeded(IngestError):
    """A quota would be passed: 429, with the quota's name as `code`."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message, status=429, field="quota")
        self.code = code


def share_of(user) -> Share:
    row = UserShare.objects.filter(user=user).first()
    max_priority = (row.max_priority if row else "") or settings.JOBS_DEFAULT_MAX_PRIORITY
    return Share(
        weight=row.weight if row else settings.JOBS_DEFAULT_WEIGHT,
        max_priority=max_priority if max_priority in BANDS else "normal",
        max_queued_rows=_or(row and row.max_queued_rows, settings.JOBS_MAX_QUEUED_ROWS_PER_USER),
        max_unfinished_jobs=_or(row and row.max_unfinished_jobs, settings.JOBS_MAX_UNFINISHED_JOBS_PER_USER),
    )


def _or(value: int | None, default: int) -> int:
    return default if value is None else int(value)


def check_priority(share: Share, priority: str) -> None:
    if priority not in BANDS:
        raise IngestError(f"unknown priority {shown(priority)}; one of: {', '.join(BANDS)}", field="priority")
    if band_rank(priority) < band_rank(share.max_priority):
        raise IngestError(
            f"priority {priority!r} is above your highest allowed priority ({share.max_priority!r}); "
            "use that or lower, or ask staff to raise it",
            field="priority",
        )


def queued_rows(user, exclude_job_id: int | None = None) -> int:
    """Rows of the user's live jobs not yet done or failed (rows read so far for jobs still being read)."""
    live = Job.objects.filter(owner=user).exclude(status__in=TERMINAL)
    if exclude_job_id is not None:
        live = live.exclude(pk=exclude_job_id)
    running = live.exclude(status__in=[JobStatus.INGESTING, JobStatus.PENDING]).aggregate(
        rows=Sum(F("total_rows") - F("done_rows") - F("failed_rows"))
    )["rows"]
    reading = live.filter(status__in=[JobStatus.INGESTING, JobStatus.PENDING]).aggregate(rows=Sum("ingested_rows"))[
        "rows"
    ]
    return int(running or 0) + int(reading or 0)


def check_new_job(user, share: Share) -> None:
    """Refuse a new job while the user is at a quota (429, naming it)."""
    unfinished = Job.objects.filter(owner=user).exclude(status__in=TERMINAL).count()
    if unfinished >= share.max_unfinished_jobs:
        raise QuotaExceeded(
            f"quota of unfinished jobs reached: you have {unfinished} jobs not yet ended and may have at most "
            f"{share.max_unfinished_jobs}; wait until one ends, or cancel one, then upload again",
            code="quota_unfinished_jobs",
        )
    queued = queued_rows(user)
    if queued >= share.max_queued_rows:
        raise QuotaExceeded(
            f"quota of queued rows reached: you have {queued} rows waiting or running and may have at most "
            f"{share.max_queued_rows}; wait until some are done, or cancel a job, then upload again",
            code="quota_queued_rows",
        )


def check_ingested(job: Job, total_rows: int) -> None:
    """A file read whole: refuse it if its rows take its owner past the queued-rows quota.

    Called in the transaction that queues the job: the owner's live jobs are locked first, so two of
    their files read at once are checked one after the other (each seeing the other's rows), not both
    against the rows the other had read so far.
    """
    list(
        Job.objects.select_for_update().filter(owner=job.owner).exclude(status__in=TERMINAL).order_by("pk").values("pk")
    )
    share = share_of(job.owner)
    others = queued_rows(job.owner, exclude_job_id=job.pk)
    if others + total_rows > share.max_queued_rows:
        raise QuotaExceeded(
            f"quota of queued rows: this file has {total_rows} rows and you had {others} rows waiting or running; "
            f"together they pass your quota of {share.max_queued_rows}: split the file, or upload it once "
            "your other jobs are done",
            code="quota_queued_rows",
        )
