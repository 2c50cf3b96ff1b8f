"""The slow-request log in the admin: read-only, times to the second, stage durations to 0.1 ms."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone

from inference.models import SlowRequest


def _ms_column(field: str):
    @admin.display(description=field.removesuffix("_ms").replace("_", " ") + " ms", ordering=field)
    def column(self, row: SlowRequest) -> str:
        value = getattr(row, field)
        return "–" if value is None else f"{value:.1f}"

    return column


@admin.register(SlowRequest)
class SlowRequestAdmin(admin.ModelAdmin):
    list_display = [
        "created", "request_id", "model", "status", "inputs", "total", "queue_wait", "batch_wait", "inference",
        "postprocess", "batch_size", "worker",
    ]  # fmt: skip
    list_filter = ["model", "status", "created_at"]
    search_fields = ["request_id", "worker"]
    date_hierarchy = "created_at"
    fields = [
        "created", "request_id", "model", "status", "inputs", "input_chars", "total", "admission", "queue_wait",
        "batch_wait", "inference", "postprocess", "batch_size", "worker",
    ]  # fmt: skip
    readonly_fields = fields

    total = _ms_column("total_ms")
    admission = _ms_column("admission_ms")
    queue_wait = _ms_column("queue_wait_ms")
    batch_wait = _ms_column("batch_wait_ms")
    inference = _ms_column("inference_ms")
    postprocess = _ms_column("postprocess_ms")

    @admin.display(description="created", ordering="created_at")
    def created(self, row: SlowRequest) -> str:
        return timezone.localtime(row.created_at).strftime("%Y-%m-%d %H:%M:%S")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: SlowRequest | None = None) -> bool:
        return False
