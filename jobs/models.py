"""Offline jobs: the job row is the record of truth; Redis only carries chunk and job ids to workers.

Job, chunk and row statuses change only through the transition methods here (as NetBox's
`Job.start()` / `Job.terminate()`): each is a conditional UPDATE, or a short transaction that locks
the job first, naming the states it may move from, so of two processes racing over a job exactly one
wins. Callers (ingest, lifecycle, runner, reconciler) decide when to move; these methods decide
whether the move still holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import timedelta

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import connection, models, transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from jobs.signals import job_ended


class JobStatus(models.TextChoices):
    PENDING = "pending"
    INGESTING = "ingesting"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    # Its label keeps the API's word, so that a person can match the page and the admin to the API.
    PARTIAL = "partial", "Partial (some rows failed)"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # A batch (jobs/batches.py) not finished within its completion window: rows done so far are kept.
    EXPIRED = "expired"


class FileFormat(models.TextChoices):
    """How a job's upload is read: one reader class each (jobs/readers.py)."""

    CSV = "csv", "CSV"
    JSONL = "jsonl", "JSON lines"
    # OpenAI Batch API request lines ({"custom_id", "method", "url", "body"}): the input file of a batch.
    BATCH = "batch", "OpenAI batch requests"


class CallbackStatus(models.TextChoices):
    PENDING = "pending"  # the job ended; delivery attempts are under way
    DELIVERED = "delivered"  # the receiver answered 2xx
    FAILED = "failed"  # every attempt failed, or the destination was refused


class Priority(models.TextChoices):
    """A job's band in the offline scheduler (jobs/fairshare.py): higher bands are served first."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


TERMINAL = (JobStatus.SUCCEEDED, JobStatus.PARTIAL, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED)
# Statuses in which a job's rows may still be written with results.
RUNNABLE = (JobStatus.QUEUED, JobStatus.RUNNING)


class Job(models.Model):
    """One uploaded file (CSV, JSON lines, or a batch's request lines) run through one model."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    # The API key the job was created with (None: a token, a session or the page): its rows are metered
    # against that key (accounts/usage.py). A deleted key leaves the job its owner's.
    api_key = models.ForeignKey(
        "accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs", editable=False
    )
    model = models.CharField(max_length=100)
    # The model version the job runs on to its end (issue 21): the active one when it was created, or the
    # one its upload pinned (`model@version`); staff may move it. Blank: a job from before versions, run
    # on whatever its worker's default version is.
    model_version = models.CharField(max_length=32, blank=True)
    priority = models.CharField(max_length=8, choices=Priority.choices, default=Priority.NORMAL, db_index=True)
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.PENDING, db_index=True)
    filename = models.CharField(max_length=255, blank=True)
    file_format = models.CharField(max_length=8, choices=FileFormat.choices, default=FileFormat.CSV)
    text_column = models.CharField(max_length=255, blank=True)
    # For tasks whose inputs have several fields (inference/core/task_io.py): input field -> CSV column,
    # e.g. {"question": "q", "context": "passage"}. Empty for text tasks, which read `text_column`.
    input_columns = models.JSONField(default=dict, blank=True)
    id_column = models.CharField(max_length=255, blank=True)
    encoding = models.CharField(max_length=40, default="utf-8")
    delimiter = models.CharField(max_length=4, default=",")
    total_rows = models.PositiveIntegerField(default=0)
    done_rows = models.PositiveIntegerField(default=0)
    failed_rows = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    rows_per_s = models.FloatField(default=0.0)
    # Seconds the job spent ended before a retry ran it again: not running, so neither in its elapsed time
    # nor in its rate (a retry had turned "1 s, 340.8 rows/s" into "2 min 15 s, 3.7 rows/s").
    paused_s = models.FloatField(default=0.0)
    error = models.TextField(blank=True)
    # What was wrong with the file, line by line, when it failed at ingest: [{"line", "code", "message",
    # "param"}] (a batch's `errors`); empty when the file was usable.
    error_details = models.JSONField(default=list, blank=True)
    # Ingest runs in an offline worker from the stored upload; these say how far it got.
    upload_bytes = models.PositiveBigIntegerField(default=0)
    ingested_bytes = models.PositiveBigIntegerField(default=0)
    ingested_rows = models.PositiveIntegerField(default=0)
    # Each claim of the ingest increments this; a worker writes only while it holds the latest claim,
    # so a slow worker whose ingest was given to another cannot write over it.
    ingest_attempts = models.PositiveSmallIntegerField(default=0)
    ingest_claimed_at = models.DateTimeField(null=True, blank=True)
    # Last sign of life of the ingest (created, enqueued, claimed, a batch of rows written): the
    # reconciler re-enqueues an ingest silent for JOBS_STALL_S.
    ingest_progress_at = models.DateTimeField(null=True, blank=True)
    # Where the job's summary is POSTed when it ends (jobs/callbacks.py), and how that went. The
    # delivery is retried by a Celery task; these fields are its record, shown in the admin.
    callback_url = models.URLField(max_length=2000, blank=True)
    callback_status = models.CharField(max_length=12, choices=CallbackStatus.choices, blank=True)
    callback_attempts = models.PositiveSmallIntegerField(default=0)
    callback_last_status = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="HTTP status of the last attempt (empty: no answer)"
    )
    callback_last_error = models.CharField(max_length=500, blank=True)
    callback_last_at = models.DateTimeField(null=True, blank=True)
    # The outcome (status and row counts) of the last end whose callback was delivered: an end that
    # repeats it (a retry whose rows all failed again) is not announced again (jobs/callbacks.py).
    callback_outcome = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.model}, {self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def retryable(self) -> bool:
        """Whether its failed rows may run again: an ended job's, not a batch's (its output files are final;
        a client resubmits the failed lines as a new batch)."""
        return self.is_terminal and self.failed_rows > 0 and self.file_format != FileFormat.BATCH

    def elapsed_s(self, now=None) -> float | None:
        """Seconds it has run: from its start to its end (or now), less the time it spent ended before a retry."""
        if not self.started_at:
            return None
        end = self.finished_at or now or timezone.now()
        return max((end - self.started_at).total_seconds() - self.paused_s, 0.0)

    @property
    def progress(self) -> float:
        """Fraction of rows finished, done or failed."""
        return (self.done_rows + self.failed_rows) / self.total_rows if self.total_rows else 0.0

    @property
    def ingest_progress(self) -> float:
        """Fraction of the upload read into rows (1.0 once ingest is over)."""
        if self.status != JobStatus.INGESTING:
            return 1.0
        return min(self.ingested_bytes / self.upload_bytes, 1.0) if self.upload_bytes else 0.0

    @property
    def eta_s(self) -> float | None:
        remaining = self.total_rows - self.done_rows - self.failed_rows
        if self.is_terminal or remaining <= 0:
            return 0.0 if self.is_terminal else None
        return remaining / self.rows_per_s if self.rows_per_s > 0 else None

    def refresh_counts(self) -> None:
        """Recount from the rows: counters are derived, so a redelivered chunk can never count a row twice."""
        counts = self.rows.aggregate(
            done=Count("pk", filter=Q(status=RowStatus.DONE)),
            failed=Count("pk", filter=Q(status=RowStatus.FAILED)),
        )
        elapsed_s = (timezone.now() - self.started_at).total_seconds() - self.paused_s if self.started_at else 0.0
        rate = counts["done"] / elapsed_s if elapsed_s > 0 else 0.0
        Job.objects.filter(pk=self.pk).update(done_rows=counts["done"], failed_rows=counts["failed"], rows_per_s=rate)
        self.done_rows, self.failed_rows, self.rows_per_s = counts["done"], counts["failed"], rate

    # Transitions -------------------------------------------------------------------------------

    def _move(self, allowed: Iterable[str], **fields) -> bool:
        """UPDATE this job WHERE its status is one of `allowed`; on success mirror the fields here."""
        moved = bool(Job.objects.filter(pk=self.pk, status__in=list(allowed)).update(**fields))
        if moved:
            for name, value in fields.items():
                setattr(self, name, value)
        return moved

    @classmethod
    def claim_ingest(cls, job_id: int, stall_s: float) -> Job | None:
        """Take the job's ingest unless a live worker holds it: unclaimed, or its holder silent for stall_s."""
        now = timezone.now()
        claimable = Q(ingest_claimed_at__isnull=True) | Q(ingest_progress_at__lt=now - timedelta(seconds=stall_s))
        taken = cls.objects.filter(claimable, pk=job_id, status=JobStatus.INGESTING).update(
            ingest_attempts=F("ingest_attempts") + 1, ingest_claimed_at=now, ingest_progress_at=now
        )
        return cls.objects.get(pk=job_id) if taken else None

    def record_ingest(self, rows: int, bytes_read: int) -> bool:
        """Note ingest progress; False when this worker should stop (cancelled, or the ingest was re-claimed)."""
        return bool(
            Job.objects.filter(pk=self.pk, status=JobStatus.INGESTING, ingest_attempts=self.ingest_attempts).update(
                ingested_rows=rows, ingested_bytes=bytes_read, ingest_progress_at=timezone.now()
            )
        )

    def queue(self, total_rows: int) -> bool:
        """INGESTING -> QUEUED once every row and chunk is written (by the worker holding the claim)."""
        moved = bool(
            Job.objects.filter(pk=self.pk, status=JobStatus.INGESTING, ingest_attempts=self.ingest_attempts).update(
                status=JobStatus.QUEUED,
                total_rows=total_rows,
                ingested_rows=total_rows,
                ingested_bytes=self.upload_bytes,
                ingest_progress_at=timezone.now(),
            )
        )
        if moved:
            self.status, self.total_rows, self.ingested_rows = JobStatus.QUEUED, total_rows, total_rows
        return moved

    def requeue_ingest(self) -> bool:
        """Let a new worker claim a stalled ingest (its message or its worker was lost)."""
        return self._move([JobStatus.INGESTING], ingest_claimed_at=None, ingest_progress_at=timezone.now())

    def fail(self, error: str, details: list[dict] | None = None) -> bool:
        """Any live status -> FAILED with a message for the uploader (the file turned out unusable), and
        its problems line by line when the reader listed them."""
        with transaction.atomic():
            moved = self._move(
                [s for s in JobStatus.values if s not in TERMINAL],
                status=JobStatus.FAILED,
                error=error,
                error_details=details or [],
                finished_at=timezone.now(),
            )
            if moved:
                self.upload_parts.all().delete()
                self._ended()
        return moved

    @classmethod
    def start(cls, job_ids: Iterable[int]) -> None:
        """QUEUED -> RUNNING when a worker first takes one of the job's chunks."""
        ids = list(job_ids)
        cls.objects.filter(pk__in=ids, started_at__isnull=True).update(started_at=timezone.now())
        cls.objects.filter(pk__in=ids, status=JobStatus.QUEUED).update(status=JobStatus.RUNNING)

    def cancel(self, status: str = JobStatus.CANCELLED) -> bool:
        """Stop the job: remaining chunks and rows are cancelled, rows done so far are kept. False if it had ended.

        The job row is locked first, and result writes lock it too (JobRow.objects.complete), so a pass
        that finishes after the cancel commits writes nothing: the export then equals the counts.
        `status`: EXPIRED for a batch stopped at the end of its completion window (`expire`).
        """
        with transaction.atomic():
            job = Job.objects.select_for_update().filter(pk=self.pk).exclude(status__in=TERMINAL).first()
            if job is None:
                return False
            now = timezone.now()
            Job.objects.filter(pk=self.pk).update(status=status, finished_at=now)
            self.chunks.exclude(status=ChunkStatus.DONE).update(status=ChunkStatus.CANCELLED)
            self.rows.filter(status=RowStatus.PENDING).update(status=RowStatus.CANCELLED)
            self.upload_parts.all().delete()  # an ingest in progress stops at its next read
        self.refresh_from_db()
        self.refresh_counts()
        self._ended()
        return True

    def expire(self) -> bool:
        """A batch past its completion window stops as a cancel does, its rows done so far kept, as EXPIRED."""
        return self.cancel(status=JobStatus.EXPIRED)

    def finish(self) -> bool:
        """QUEUED/RUNNING -> SUCCEEDED, PARTIAL or FAILED once no chunk is left to run."""
        if self.chunks.filter(status__in=[ChunkStatus.QUEUED, ChunkStatus.RUNNING]).exists():
            return False
        self.refresh_counts()
        if self.failed_rows == 0:
            status = JobStatus.SUCCEEDED
        elif self.done_rows == 0:
            status = JobStatus.FAILED
        else:
            status = JobStatus.PARTIAL
        error = f"{self.failed_rows} of {self.total_rows} rows failed" if self.failed_rows else ""
        moved = self._move(RUNNABLE, status=status, finished_at=timezone.now(), error=error)
        if moved:
            self._ended()
        return moved

    def _ended(self) -> None:
        """Every move into a terminal status calls this once, in the process whose UPDATE won:
        the one place that announces a job's end (jobs/signals.py says who listens)."""
        job_ended.send(sender=Job, job=self)

    def rows_to_retry(self) -> models.QuerySet[JobRow]:
        """Its failed rows that may succeed when run again: those that failed at run time (a worker or model
        error), not those that failed because of their input (JobRow.input_error), which would fail again."""
        return self.rows.filter(status=RowStatus.FAILED, input_error=False)

    def requeue_failed(self) -> tuple[int, list[Chunk]]:
        """An ended job's rows to retry (`rows_to_retry`) -> PENDING, their chunks -> QUEUED, the job -> QUEUED.

        Returns (rows requeued, chunks to enqueue); (0, []) if the job is live or has no row to retry.
        """
        import bisect

        with transaction.atomic():
            job = Job.objects.select_for_update().get(pk=self.pk)
            if not job.is_terminal or job.file_format == FileFormat.BATCH:
                return 0, []
            failed = list(job.rows_to_retry().values_list("index", flat=True))
            if not failed:
                return 0, []
            job.rows_to_retry().update(status=RowStatus.PENDING, error="")
            # Chunks are contiguous ranges sorted by first index: find each failed row's chunk by bisection
            # rather than one OR-ed range condition per row (a query that grows with the failures).
            all_chunks = list(job.chunks.order_by("first_index"))
            starts = [c.first_index for c in all_chunks]
            chunks = [all_chunks[i] for i in sorted({bisect.bisect_right(starts, index) - 1 for index in failed})]
            # Back to the scheduler (not sent yet): it sends them in their turn among other jobs' chunks.
            Chunk.objects.filter(pk__in=[c.pk for c in chunks]).update(
                status=ChunkStatus.QUEUED, enqueued_at=timezone.now(), progress_at=None, dispatched_at=None
            )
            # The callback record stays that of the last end until the job ends again: attempts still pending for
            # that end stop (they are claimed by its finished_at), and the next end is announced unless it
            # repeats the outcome already delivered (jobs/callbacks.py, schedule).
            ended_s = (timezone.now() - job.finished_at).total_seconds() if job.finished_at else 0.0
            Job.objects.filter(pk=job.pk).update(
                status=JobStatus.QUEUED, finished_at=None, error="", paused_s=F("paused_s") + max(ended_s, 0.0)
            )
            job.refresh_from_db(fields=["paused_s"])
            job.refresh_counts()
        self.refresh_from_db()
        return len(failed), chunks


class RowStatus(models.TextChoices):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobRowQuerySet(models.QuerySet):
    def _write(self, rows: list[JobRow], fields: list[str]) -> set[int]:
        """Write `fields` of those rows still PENDING whose job is still runnable; the ids of jobs that are not.

        One short transaction that locks the jobs (PostgreSQL: SELECT ... FOR UPDATE; SQLite: the
        IMMEDIATE transaction takes the database's write lock), against Job.cancel doing the same: a
        cancel that commits first wins, and one that commits after sees these rows done and counts them.
        """
        job_ids = {row.job_id for row in rows}
        if not job_ids:
            return set()
        with transaction.atomic():
            live = set(
                Job.objects.select_for_update()
                .filter(pk__in=job_ids, status__in=RUNNABLE)
                .order_by("pk")  # one lock order for every writer: no deadlocks between them
                .values_list("pk", flat=True)
            )
            writable = [row for row in rows if row.job_id in live]
            self._update_pending(writable, fields)
        return job_ids - live

    def _update_pending(self, rows: list[JobRow], fields: list[str]) -> None:
        """UPDATE each row WHERE it is still PENDING, as one executemany of a prepared statement.

        QuerySet.bulk_update builds a CASE WHEN expression per field per row in Python: about 1.5 ms
        a row, a tenth of an offline child's time beside forward passes of 13 ms a row. This is ~20 µs.
        """
        if not rows:
            return
        qn = connection.ops.quote_name
        meta = JobRow._meta
        columns = [meta.get_field(name) for name in fields]
        status = meta.get_field("status")
        sql = "UPDATE {} SET {} WHERE {} = %s AND {} = %s".format(
            qn(meta.db_table),
            ", ".join(f"{qn(field.column)} = %s" for field in columns),
            qn(meta.pk.column),
            qn(status.column),
        )
        params = [
            [field.get_db_prep_save(getattr(row, field.attname), connection) for field in columns]
            + [row.pk, RowStatus.PENDING.value]
            for row in rows
        ]
        with connection.cursor() as cursor:
            cursor.executemany(sql, params)

    def insert(self, rows: list[JobRow]) -> None:
        """Insert new rows as ingest reads them: PostgreSQL's COPY, else bulk_create.

        bulk_create renders an INSERT with every field of every row in Python (~130 µs a row on this
        project's CPU, most of a batch file's ingest); COPY streams the values, about a tenth of that.
        """
        if connection.vendor != "postgresql" or not rows:
            self.bulk_create(rows)
            return
        meta = JobRow._meta
        fields = [f for f in meta.concrete_fields if not f.primary_key]
        qn = connection.ops.quote_name
        sql = "COPY {} ({}) FROM STDIN".format(qn(meta.db_table), ", ".join(qn(f.column) for f in fields))
        with connection.cursor() as cursor, cursor.cursor.copy(sql) as copy:
            for row in rows:
                copy.write_row([_copy_value(f, getattr(row, f.attname)) for f in fields])

    def complete(self, rows: list[JobRow], fields: list[str]) -> set[int]:
        """PENDING -> DONE with the model's output (set on the objects); returns the jobs no longer running."""
        return self._write(rows, fields)

    def fail(self, rows: list[JobRow]) -> set[int]:
        """PENDING -> FAILED with the error set on each object; returns the jobs no longer running."""
        return self._write(rows, ["status", "error", "attempts", "input_error"])


def _copy_value(field: models.Field, value):
    """A field's value as COPY takes it: JSON as its text (json.dumps, as JSONField stores it), else as is."""
    if value is None:
        return None
    if isinstance(field, models.JSONField):
        return json.dumps(value)
    return value


class JobRow(models.Model):
    """One input line: its text, the model's answer, and what a reviewer made of it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="rows")
    index = models.PositiveIntegerField(help_text="0-based position among the file's data rows")
    external_id = models.CharField(max_length=255, blank=True)
    text = models.TextField()
    # The structured input of tasks with several input fields (e.g. {"question", "context"}); None
    # for text tasks, whose input is `text`.
    inputs = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=10, choices=RowStatus.choices, default=RowStatus.PENDING)
    label = models.CharField(max_length=100, blank=True, db_index=True)
    score = models.FloatField(null=True, blank=True)
    output = models.JSONField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    # Failed because of its input (empty, too long, a missing field), found when the file was read: a retry
    # would only fail it again, so retries leave it and the job's page says to fix the file instead. A row
    # that failed at run time (a worker or model error) keeps False and may be retried.
    # db_default too: during a rolling deploy, processes still on the previous code insert rows without it.
    input_error = models.BooleanField(default=False, db_default=False)
    # The model version that produced this row's output (blank until it ran).
    model_version = models.CharField(max_length=32, blank=True)
    # Tokens the model reads for this row, counted at ingest (what the fair share charges, and a batch
    # line's `usage`); 0 for a row that failed at ingest.
    tokens = models.PositiveIntegerField(default=0)
    attempts = models.PositiveSmallIntegerField(default=0)
    low_confidence = models.BooleanField(default=False, db_index=True)
    corrected_label = models.CharField(max_length=100, blank=True)
    reviewed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="reviewed_rows"
    )
    reviewed_at = models.DateTimeField(null=True, blank=True)

    objects = JobRowQuerySet.as_manager()

    class Meta:
        ordering = ["job", "index"]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="unique_row_index_per_job")]
        indexes = [models.Index(fields=["job", "status"])]

    def __str__(self) -> str:
        return f"row {self.row_number} of job {self.job_id}"

    @property
    def row_number(self) -> int:
        """The row's number as people and clients see it (page, admin, API `row`, exports): the file's
        first data row is row 1, as a spreadsheet counts below its header. `index` is its 0-based key."""
        return self.index + 1


class ChunkStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


class ChunkQuerySet(models.QuerySet):
    def claim(self, chunk_ids: list[int], stall_s: float) -> list[Chunk]:
        """QUEUED (or RUNNING but silent for stall_s: its worker died) -> RUNNING, one chunk at a time.

        A chunk claimed by someone else, done, cancelled, or of a cancelled job is skipped, so a
        redelivered duplicate message does nothing.
        """
        now = timezone.now()
        claimable = Q(status=ChunkStatus.QUEUED) | Q(
            status=ChunkStatus.RUNNING, progress_at__lt=now - timedelta(seconds=stall_s)
        )
        claimed = [
            chunk_id
            for chunk_id in chunk_ids
            if self.filter(claimable, pk=chunk_id)
            .exclude(job__status__in=[JobStatus.CANCELLED, JobStatus.EXPIRED])
            .update(status=ChunkStatus.RUNNING, progress_at=now, attempts=F("attempts") + 1)
        ]
        return list(self.filter(pk__in=claimed).select_related("job"))

    def touch(self, chunk_ids: list[int]) -> None:
        """A worker is still making progress on these running chunks."""
        self.filter(pk__in=chunk_ids, status=ChunkStatus.RUNNING).update(progress_at=timezone.now())

    def complete(self, chunk_ids: list[int]) -> None:
        """RUNNING -> DONE (a cancelled chunk stays cancelled)."""
        self.filter(pk__in=chunk_ids, status=ChunkStatus.RUNNING).update(
            status=ChunkStatus.DONE, progress_at=timezone.now()
        )

    def requeue(self, chunk_ids: list[int], *, message_kept: bool) -> None:
        """RUNNING -> QUEUED: the worker holding them died; claimable again at once.

        `message_kept`: their messages went back to the broker (a child lost under a live worker), so
        they stay sent; otherwise (the reconciler found them silent) they go back to the scheduler.
        """
        now = timezone.now()
        # A kept message counts as sent now: the reconciler takes back only chunks whose message is old.
        fields = {"status": ChunkStatus.QUEUED, "enqueued_at": now, "dispatched_at": now if message_kept else None}
        self.filter(pk__in=chunk_ids, status=ChunkStatus.RUNNING).update(**fields)

    def take_back(self, chunk_ids: list[int]) -> int:
        """QUEUED chunks sent long ago and never claimed (their message was lost) -> not sent: the scheduler
        sends them again in their turn."""
        return self.filter(pk__in=chunk_ids, status=ChunkStatus.QUEUED).update(dispatched_at=None)


class Chunk(models.Model):
    """A range of rows that travels to a worker as one message: progress, retries and redelivery are per chunk."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="chunks")
    first_index = models.PositiveIntegerField()
    end_index = models.PositiveIntegerField(help_text="exclusive")
    status = models.CharField(max_length=10, choices=ChunkStatus.choices, default=ChunkStatus.QUEUED, db_index=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    enqueued_at = models.DateTimeField(null=True, blank=True)
    # Set when the scheduler (jobs/scheduler.py) sends the chunk's message; empty while the chunk waits in
    # the database for its turn. Only a few chunks per offline child are sent ahead, so the broker never
    # holds a backlog in arrival order that the fair-share policy could not reorder.
    dispatched_at = models.DateTimeField(null=True, blank=True)
    # What the chunk costs the model in tokens (inference/core/tokens.py, as online admission prices a
    # request): the fair share charges each user for what their rows cost, not for how many there are.
    cost_tokens = models.PositiveBigIntegerField(default=0)
    # Touched whenever a worker makes progress on the chunk; the reconciler re-enqueues chunks
    # that are queued or running with no progress for longer than JOBS_STALL_S.
    progress_at = models.DateTimeField(null=True, blank=True, db_index=True)

    objects = ChunkQuerySet.as_manager()

    class Meta:
        ordering = ["job", "first_index"]
        indexes = [models.Index(fields=["status", "dispatched_at"])]

    def __str__(self) -> str:
        return f"rows {self.first_index}-{self.end_index - 1} of job {self.job_id}"

    @property
    def size(self) -> int:
        return self.end_index - self.first_index


class UserShare(models.Model):
    """A user's share of the offline workers and quotas, set by staff; a user without one gets the defaults
    in settings (JOBS_DEFAULT_*)."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="job_share")
    weight = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.01), MaxValueValidator(1000.0)],
        help_text="share of the offline workers against other users of the same priority (default 1)",
    )
    max_priority = models.CharField(
        max_length=8, choices=Priority.choices, blank=True, help_text="highest priority this user may ask for"
    )
    max_queued_rows = models.PositiveIntegerField(
        null=True, blank=True, help_text="most rows waiting or running at once (empty: the default)"
    )
    max_unfinished_jobs = models.PositiveIntegerField(
        null=True, blank=True, help_text="most jobs not yet ended at once (empty: the default)"
    )

    def __str__(self) -> str:
        return f"offline share of {self.user}"


class SchedulerState(models.Model):
    """The fair-share policy's memory (jobs/fairshare.ShareState as JSON), one row. Its row lock also makes
    one scheduler at a time hand out chunks, across every worker host."""

    state = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return "offline scheduler state"


class UploadPart(models.Model):
    """A slice of an uploaded CSV, kept until the job's ingest has read it.

    Stored in the database rather than on disk because web and workers may run on different hosts
    (docker-compose gives them no shared volume), and the database is already shared by all of them.
    Bounded by JOBS_MAX_UPLOAD_BYTES, and deleted once ingest ends, fails or the job is cancelled.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="upload_parts")
    seq = models.PositiveIntegerField()
    data = models.BinaryField()

    class Meta:
        ordering = ["job", "seq"]
        constraints = [models.UniqueConstraint(fields=["job", "seq"], name="unique_upload_part_per_job")]

    def __str__(self) -> str:
        return f"part {self.seq} of job {self.job_id}'s upload"


class CallbackSecret(models.Model):
    """A user's key for signing job callbacks (HMAC-SHA256). Shown once when created or rotated.

    Kept as given, not hashed: signing needs the key itself, as a webhook sender's does.
    """

    owner = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="callback_secret")
    secret = models.CharField(max_length=128)
    created_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"callback secret of {self.owner}"


class FilePurpose(models.TextChoices):
    """OpenAI's file purposes that this platform serves (jobs/files.py)."""

    BATCH = "batch"  # uploaded request lines, the input of a batch
    BATCH_OUTPUT = "batch_output"  # a batch's output or error file, written when the batch is finalized


class StoredFile(models.Model):
    """A file of the OpenAI Files API (`file-...`): its bytes are FileParts, written once, streamed out.

    Uploaded input files are the user's until deleted or expired; a batch's output and error files are
    written from its job's rows when the batch is finalized (jobs/batches.py) and go with the job.
    """

    public_id = models.CharField(max_length=40, unique=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="stored_files")
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField(default=0)
    lines = models.PositiveIntegerField(default=0, help_text="JSON lines in the file")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    expires_at = models.DateTimeField(null=True, blank=True, db_index=True)
    # The job whose output or errors this file holds (deleted with it); empty for uploads.
    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="result_files")

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.purpose}, {self.filename})"


class FilePart(models.Model):
    """A slice of a stored file, in order (in the database, as uploads are: every host reaches it)."""

    file = models.ForeignKey(StoredFile, on_delete=models.CASCADE, related_name="parts")
    seq = models.PositiveIntegerField()
    data = models.BinaryField()

    class Meta:
        ordering = ["file", "seq"]
        constraints = [models.UniqueConstraint(fields=["file", "seq"], name="unique_part_per_file")]

    def __str__(self) -> str:
        return f"part {self.seq} of {self.file_id}"


class Batch(models.Model):
    """What the OpenAI Batch API says about a job (`batch_...`): the job holds the rows and runs them as
    any job; this holds the batch's request, its files and the times of its OpenAI statuses."""

    public_id = models.CharField(max_length=40, unique=True)
    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="batch")
    endpoint = models.CharField(max_length=200)
    completion_window = models.CharField(max_length=8, default="24h")
    metadata = models.JSONField(null=True, blank=True)
    input_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="input_of"
    )
    output_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="output_of"
    )
    error_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="errors_of"
    )
    expires_at = models.DateTimeField(db_index=True)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    # When the output and error files were written: the batch is then completed, expired, cancelled or failed.
    finalized_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-pk"]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return f"{self.public_id} (job {self.job_id})"
