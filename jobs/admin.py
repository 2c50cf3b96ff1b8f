"""Job review for admins: jobs with progress and actions, rows filterable for low-confidence review."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from jobs import export, lifecycle
from jobs.models import Job, JobRow


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "filename",
        "status",
        "progress_bar",
        "model",
        "owner",
        "rows_per_s_shown",
        "created_at",
        "rows_link",
    ]
    list_filter = ["status", "model", "owner", "created_at"]
    search_fields = ["filename", "owner__username", "error"]
    date_hierarchy = "created_at"
    readonly_fields = [f.name for f in Job._meta.fields]
    actions = ["cancel_jobs", "retry_failed_rows", "export_results"]

    @admin.display(description="progress")
    def progress_bar(self, job: Job) -> str:
        pct = round(job.progress * 100)
        return format_html(
            '<div style="width:8em;background:#eee;border-radius:3px"><div style="width:{}%;background:#3a7;height:.7em;border-radius:3px"></div></div>{} / {}',
            pct,
            job.done_rows + job.failed_rows,
            job.total_rows,
        )

    @admin.display(description="rows/s", ordering="rows_per_s")
    def rows_per_s_shown(self, job: Job) -> str:
        return f"{job.rows_per_s:.1f}"

    @admin.display(description="rows")
    def rows_link(self, job: Job) -> str:
        url = reverse("admin:jobs_jobrow_changelist") + f"?job__id__exact={job.pk}"
        low = reverse("admin:jobs_jobrow_changelist") + f"?job__id__exact={job.pk}&low_confidence__exact=1"
        return format_html('<a href="{}">all</a> · <a href="{}">low confidence</a>', url, low)

    @admin.action(description="Cancel selected jobs (keeps rows done so far)")
    def cancel_jobs(self, request, queryset: QuerySet[Job]) -> None:
        cancelled = sum(lifecycle.cancel(job) for job in queryset)
        self.message_user(request, f"{cancelled} job(s) cancelled")

    @admin.action(description="Retry failed rows of selected jobs")
    def retry_failed_rows(self, request, queryset: QuerySet[Job]) -> None:
        rows = sum(lifecycle.retry_failed(job) for job in queryset)
        self.message_user(request, f"{rows} failed row(s) queued again", messages.SUCCESS if rows else messages.WARNING)

    @admin.action(description="Export results of selected jobs (CSV)")
    def export_results(self, request, queryset: QuerySet[Job]):
        return export.csv_response(JobRow.objects.filter(job__in=queryset), "jobs-results.csv")

    def has_add_permission(self, request) -> bool:
        return False  # jobs are made by uploading a CSV (API or /jobs/)


@admin.register(JobRow)
class JobRowAdmin(admin.ModelAdmin):
    list_display = [
        "job",
        "index",
        "short_text",
        "status",
        "label",
        "score",
        "low_confidence",
        "corrected_label",
        "reviewed_by",
    ]
    list_display_links = ["index"]
    list_editable = ["corrected_label"]
    list_filter = ["status", "low_confidence", "label", ("reviewed_by", admin.EmptyFieldListFilter), "job"]
    search_fields = ["text", "external_id", "label", "corrected_label"]
    list_select_related = ["job", "reviewed_by"]
    readonly_fields = [
        "job",
        "index",
        "external_id",
        "text",
        "status",
        "label",
        "score",
        "output",
        "error",
        "attempts",
        "low_confidence",
        "reviewed_by",
        "reviewed_at",
    ]
    fields = [*readonly_fields, "corrected_label"]
    actions = ["mark_reviewed"]

    @admin.display(description="text")
    def short_text(self, row: JobRow) -> str:
        return row.text if len(row.text) <= 80 else row.text[:77] + "..."

    def save_model(self, request, obj: JobRow, form, change: bool) -> None:
        if "corrected_label" in form.changed_data:
            obj.reviewed_by, obj.reviewed_at = request.user, timezone.now()
        super().save_model(request, obj, form, change)

    @admin.action(description="Mark selected rows reviewed (the model's label stands)")
    def mark_reviewed(self, request, queryset: QuerySet[JobRow]) -> None:
        updated = queryset.update(reviewed_by=request.user, reviewed_at=timezone.now())
        self.message_user(request, f"{updated} row(s) marked reviewed")

    def has_add_permission(self, request) -> bool:
        return False
