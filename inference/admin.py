"""The admin's inference pages: the slow-request log (read-only, times to the second, stage durations to
0.1 ms), and model versions and deployments with promote, canary and rollback actions (issue 21)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.http import HttpRequest
from django.utils import timezone

from inference import deployments
from inference.deployments import DeploymentError
from inference.models import ModelDeployment, ModelVersion, SlowRequest


def _ms_column(field: str):
    @admin.display(description=field.removesuffix("_ms").replace("_", " ") + " ms", ordering=field)
    def column(self, row: SlowRequest) -> str:
        value = getattr(row, field)
        return "–" if value is None else f"{value:.1f}"

    return column


@admin.register(SlowRequest)
class SlowRequestAdmin(admin.ModelAdmin):
    list_display = [
        "created", "request_id", "model", "status", "inputs", "total", "queue_wait", "batch_wait", "pass_wait",
        "inference", "postprocess", "batch_size", "worker",
    ]  # fmt: skip
    list_filter = ["model", "status", "created_at"]
    search_fields = ["request_id", "worker"]
    date_hierarchy = "created_at"
    fields = [
        "created", "request_id", "model", "status", "inputs", "input_chars", "total", "admission", "queue_wait",
        "batch_wait", "pass_wait", "inference", "postprocess", "batch_size", "worker",
    ]  # fmt: skip
    readonly_fields = fields

    total = _ms_column("total_ms")
    admission = _ms_column("admission_ms")
    queue_wait = _ms_column("queue_wait_ms")
    batch_wait = _ms_column("batch_wait_ms")
    pass_wait = _ms_column("pass_wait_ms")
    inference = _ms_column("inference_ms")
    postprocess = _ms_column("postprocess_ms")

    @admin.display(description="created", ordering="created_at")
    def created(self, row: SlowRequest) -> str:
        return timezone.localtime(row.created_at).strftime("%Y-%m-%d %H:%M:%S")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: SlowRequest | None = None) -> bool:
        return False


def _run(modeladmin: admin.ModelAdmin, request: HttpRequest, change, what: str) -> None:
    try:
        state = change()
    except DeploymentError as error:
        modeladmin.message_user(request, str(error), messages.ERROR)
        return
    modeladmin.message_user(request, f"{what}: {state.model} active {state.active}, target {state.target or '-'}")


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    """Every version the models file names: promote one (load, then switch), or give it a canary share."""

    list_display = ["model", "version", "status", "sha256_short", "path", "activated_at", "updated_at", "error"]
    list_filter = ["model", "status"]
    readonly_fields = [f.name for f in ModelVersion._meta.fields]
    actions = ["promote", "canary_10", "clear_canary"]

    @admin.display(description="sha256")
    def sha256_short(self, row: ModelVersion) -> str:
        return row.sha256[:12]

    def get_queryset(self, request: HttpRequest):
        deployments.ensure_versions()  # the file's versions are listed before any was promoted
        return super().get_queryset(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # versions come from the models file

    @admin.action(description="Promote the selected version (load beside the active one, then switch)")
    def promote(self, request: HttpRequest, queryset) -> None:
        for row in queryset:
            _run(
                self,
                request,
                lambda row=row: deployments.promote(row.model, row.version, request.user.username),
                "promoted",
            )

    @admin.action(description="Give the selected version a 10%% canary of its model's callers")
    def canary_10(self, request: HttpRequest, queryset) -> None:
        for row in queryset:
            change = lambda row=row: deployments.set_canary(row.model, row.version, 10.0, request.user.username)  # noqa: E731
            _run(self, request, change, "canary set")

    @admin.action(description="End the canary of the selected versions' models")
    def clear_canary(self, request: HttpRequest, queryset) -> None:
        for model in sorted({row.model for row in queryset}):
            _run(
                self,
                request,
                lambda model=model: deployments.clear_canary(model, request.user.username),
                "canary ended",
            )


@admin.register(ModelDeployment)
class ModelDeploymentAdmin(admin.ModelAdmin):
    """Which version of each model serves; changed only through the actions (the same functions as the API)."""

    list_display = ["model", "active", "target", "previous", "canary", "canary_percent", "canary_ready", "changed_at", "changed_by"]  # fmt: skip
    readonly_fields = [f.name for f in ModelDeployment._meta.fields]
    actions = ["roll_back"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Roll back: promote the previous version")
    def roll_back(self, request: HttpRequest, queryset) -> None:
        for row in queryset:
            if not row.previous:
                self.message_user(request, f"{row.model} has no previous version", messages.WARNING)
                continue
            change = lambda row=row: deployments.promote(row.model, row.previous, request.user.username)  # noqa: E731
            _run(self, request, change, "rolled back")
