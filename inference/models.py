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
    total_ms = models.FloatField(db_index=True)
    batch_size = models.PositiveIntegerField(null=True)
    worker = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.total_ms:.0f} ms"
