"""Offline jobs: the job row is the record of truth; Redis only carries chunk ids to workers."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Count, Q
from django.utils import timezone


class JobStatus(models.TextChoices):
    PENDING = "pending"
    INGESTING = "ingesting"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    PARTIAL = "partial", "succeeded with failed rows"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = (JobStatus.SUCCEEDED, JobStatus.PARTIAL, JobStatus.FAILED, JobStatus.CANCELLED)


class Job(models.Model):
    """One uploaded CSV run through one model."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    model = models.CharField(max_length=100)
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.PENDING, db_index=True)
    filename = models.CharField(max_length=255, blank=True)
    text_column = models.CharField(max_length=255)
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
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.model}, {self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def progress(self) -> float:
        """Fraction of rows finished, done or failed."""
        return (self.done_rows + self.failed_rows) / self.total_rows if self.total_rows else 0.0

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
        now = timezone.now()
        elapsed_s = (now - self.started_at).total_seconds() if self.started_at else 0.0
        rate = counts["done"] / elapsed_s if elapsed_s > 0 else 0.0
        Job.objects.filter(pk=self.pk).update(done_rows=counts["done"], failed_rows=counts["failed"], rows_per_s=rate)
        self.done_rows, self.failed_rows, self.rows_per_s = counts["done"], counts["failed"], rate


class RowStatus(models.TextChoices):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobRow(models.Model):
    """One input line: its text, the model's answer, and what a reviewer made of it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="rows")
    index = models.PositiveIntegerField(help_text="0-based position among the file's data rows")
    external_id = models.CharField(max_length=255, blank=True)
    text = models.TextField()
    status = models.CharField(max_length=10, choices=RowStatus.choices, default=RowStatus.PENDING)
    label = models.CharField(max_length=100, blank=True, db_index=True)
    score = models.FloatField(null=True, blank=True)
    output = models.JSONField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    low_confidence = models.BooleanField(default=False, db_index=True)
    corrected_label = models.CharField(max_length=100, blank=True)
    reviewed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="reviewed_rows"
    )
    reviewed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "index"]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="unique_row_index_per_job")]
        indexes = [models.Index(fields=["job", "status"])]

    def __str__(self) -> str:
        return f"row {self.index} of job {self.job_id}"


class ChunkStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


class Chunk(models.Model):
    """A range of rows that travels to a worker as one message: progress, retries and redelivery are per chunk."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="chunks")
    first_index = models.PositiveIntegerField()
    end_index = models.PositiveIntegerField(help_text="exclusive")
    status = models.CharField(max_length=10, choices=ChunkStatus.choices, default=ChunkStatus.QUEUED, db_index=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    enqueued_at = models.DateTimeField(null=True, blank=True)
    # Touched whenever a worker makes progress on the chunk; the reconciler re-enqueues chunks
    # that are queued or running with no progress for longer than JOBS_STALL_S.
    progress_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["job", "first_index"]

    def __str__(self) -> str:
        return f"rows {self.first_index}-{self.end_index - 1} of job {self.job_id}"

    @property
    def size(self) -> int:
        return self.end_index - self.first_index
