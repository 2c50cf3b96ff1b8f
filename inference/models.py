"""The online path keeps one table: slow requests, for the article's closing tip (bounded retention)."""

from __future__ import annotations

from django.db import models


class SlowRequest(models.Model):
    """An online request slower than SLOW_REQUEST_MS (or one that hit its deadline), with where its time went."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    request_id = models.CharField(max_length=128, db_index=True)
    model = models.CharField(max_length=100, db_index=True)
    status = models.PositiveSmallIntegerField()
    inputs = models.PositiveIntegerField(help_text="texts in the request")
    input_chars = models.PositiveIntegerField()
    admission_ms = models.FloatField(null=True)
    queue_wait_ms = models.FloatField(null=True)
    batch_wait_ms = models.FloatField(null=True)
    inference_ms = models.FloatField(null=True)
    postprocess_ms = models.FloatField(null=True)
    # Behind the earlier passes of its own dispatch (issue 23); null on rows logged before it was measured.
    pass_wait_ms = models.FloatField(null=True)
    total_ms = models.FloatField(db_index=True)
    batch_size = models.PositiveIntegerField(null=True)
    worker = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.total_ms:.0f} ms"


class VersionStatus(models.TextChoices):
    """Where a model version stands. `failed`: its files did not match its checksum (or did not load)."""

    AVAILABLE = "available"  # named by the models file, not serving
    LOADING = "loading"  # promoted: children load it beside the active one; the switch waits for all
    ACTIVE = "active"
    CANARY = "canary"
    RETIRED = "retired"  # was active, replaced by a promote (still loaded until it drains)
    FAILED = "failed"


class ModelVersion(models.Model):
    """One version of a served model, as the models file names it, and what became of it."""

    model = models.CharField(max_length=100)
    version = models.CharField(max_length=32)
    path = models.CharField(max_length=1000, blank=True)
    # The declared checksum, or the one recorded at its first load (docs/operations.md says which).
    sha256 = models.CharField(max_length=64, blank=True)
    status = models.CharField(max_length=10, choices=VersionStatus.choices, default=VersionStatus.AVAILABLE)
    error = models.CharField(max_length=500, blank=True, help_text="why it failed, when it did")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    activated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["model", "version"]
        constraints = [models.UniqueConstraint(fields=["model", "version"], name="unique_model_version")]

    def __str__(self) -> str:
        return f"{self.model}@{self.version} ({self.status})"


class ModelDeployment(models.Model):
    """Which versions of a model serve: the record of truth the Redis mirror copies (inference/deployments.py)."""

    model = models.CharField(max_length=100, unique=True)
    active = models.CharField(max_length=32)
    target = models.CharField(max_length=32, blank=True, help_text="promoted, loading; switched to when loaded")
    previous = models.CharField(max_length=32, blank=True, help_text="what a rollback promotes")
    canary = models.CharField(max_length=32, blank=True)
    canary_percent = models.FloatField(default=0.0)
    canary_ready = models.BooleanField(default=False, help_text="every child has the canary loaded")
    changed_at = models.DateTimeField()
    changed_by = models.CharField(max_length=150, blank=True)

    class Meta:
        ordering = ["model"]

    def __str__(self) -> str:
        return f"{self.model}: {self.active}" + (f" -> {self.target}" if self.target else "")
