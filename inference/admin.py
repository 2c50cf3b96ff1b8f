from django.contrib import admin

from inference.models import SlowRequest


@admin.register(SlowRequest)
class SlowRequestAdmin(admin.ModelAdmin):
    list_display = [
        "created_at", "request_id", "model", "status", "inputs", "total_ms", "queue_wait_ms", "batch_wait_ms",
        "inference_ms", "postprocess_ms", "batch_size", "worker",
    ]  # fmt: skip
    list_filter = ["model", "status", "created_at"]
    search_fields = ["request_id", "worker"]
    date_hierarchy = "created_at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
