"""Job review for admins: jobs with progress, standing and per-job actions, rows reviewed against the
model's labels, and each user's offline share.

On the job page only the priority is staff's to change (the scheduler reads it at its next pick);
every other field is written by the platform. What an operator does to a job goes through the same
lifecycle functions as the API: cancel, retry failed rows, export. Rows are reviewed in a narrow list
meant for a laptop screen, the corrected label picked from the model's own labels; saving a
correction records who made it and when. A user's weight, highest priority and quotas are set in
their offline share (UserShare); without one a user gets the JOBS_* defaults in settings.
"""

from __future__ import annotations

import json

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, StreamingHttpResponse
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.text import capfirst
from django.views.decorators.http import require_POST

from inference.core.labels import labels_for
from inference.core.registry import get_registry
from jobs import export, lifecycle, quotas, scheduler, versions
from jobs.batches import batch_object
from jobs.display import ahead_texts, answer_html, duration_text, input_html, score_meaning, task_of, time_left_text
from jobs.models import TERMINAL, Batch, CallbackSecret, Job, JobRow, JobStatus, RowStatus, UserShare

# One product: the admin is branded as the platform and links back to its pages (templates/admin/base_site.html).
admin.site.site_header = "Inference platform"
admin.site.site_title = "Inference platform admin"
admin.site.index_title = "Administration"
admin.site.site_url = "/jobs/"
# The app sidebar takes a third of a laptop screen and lists a handful of models the breadcrumbs already reach.
admin.site.enable_nav_sidebar = False

TEXT_SHOWN_CHARS = 160  # the text column's cut; the full text (up to TEXT_TITLE_CHARS) is on hover
TEXT_TITLE_CHARS = 2000
RECENT_JOBS_IN_FILTER = 10
NOT_STORED = "–"


def when(value) -> str:
    """A time to the second, in the server's zone (the admin's default format drops seconds)."""
    return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S") if value else NOT_STORED


def progress_html(job: Job) -> str:
    """Done rows green, failed rows red, with the counts: a bar that does not look fine when rows failed."""
    if job.status == JobStatus.INGESTING:
        return format_html(
            "reading the upload: {}% ({} rows so far)", f"{job.ingest_progress * 100:.0f}", f"{job.ingested_rows:,}"
        )
    total = job.total_rows or 0
    done_pct = 100 * job.done_rows / total if total else 0
    failed_pct = 100 * job.failed_rows / total if total else 0
    failed = format_html(', <span class="job-failed">{} failed</span>', job.failed_rows) if job.failed_rows else ""
    return format_html(
        '<div class="job-bar" title="{} done, {} failed of {}"><span class="job-bar-done" style="width:{}%"></span>'
        '<span class="job-bar-failed" style="width:{}%"></span></div>{} / {}{}',
        job.done_rows,
        job.failed_rows,
        total,
        f"{done_pct:.1f}",
        f"{failed_pct:.1f}",
        job.done_rows + job.failed_rows,
        total,
        failed,
    )


def rows_url(job_id: int, **filters: str) -> str:
    query = "&".join([f"job__id__exact={job_id}", *(f"{k}={v}" for k, v in filters.items())])
    return reverse("admin:jobs_jobrow_changelist") + "?" + query


# The Retry button's title while a job is live (or a batch, whose files are final).
NO_RETRY = "only an ended job with failed rows can be retried (not a batch)"
# What staff may change on a job; every other field is the platform's.
EDITABLE_JOB_FIELDS = ("priority",)


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "filename",
        "batch_ref",
        "status",
        "priority",
        "progress_bar",
        "model",
        "owner",
        "rows_per_s_shown",
        "created",
        "rows_link",
    ]
    list_filter = ["status", "priority", "file_format", "model", "owner", "created_at"]
    # Staff raise or lower a job from the list too; each change is saved alone (save_model).
    list_editable = ["priority"]
    search_fields = ["filename", "owner__username", "error", "batch__public_id"]
    date_hierarchy = "created_at"
    list_select_related = ["owner", "batch"]
    empty_value_display = NOT_STORED
    actions = ["cancel_jobs", "retry_failed_rows", "export_results"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "filename",
                    "model",
                    # Pinned when the job was created (issue 21); the "Move ... to model version" actions change it.
                    "model_version",
                    "owner",
                    "priority",
                    "status",
                    "standing",
                    "progress_bar",
                    "retry_shown",
                    "label_summary",
                    "error",
                    "error_details",
                ]
            },
        ),
        # A job created by POST /v1/batches: what the OpenAI Batch API shows of it (jobs/batches.py).
        ("Batch", {"fields": ["batch_summary"]}),
        ("Timing", {"fields": ["created", "started", "finished", "elapsed", "rows_per_s_shown", "eta"]}),
        (
            "Upload",
            {
                "fields": [
                    "file_format",
                    "text_column",
                    "input_columns",
                    "id_column",
                    "encoding",
                    "delimiter",
                    "upload_size",
                    "ingested_rows",
                ]
            },
        ),
        (
            "Ingest bookkeeping",
            {"classes": ["collapse"], "fields": ["ingest_attempts", "ingest_claimed", "ingest_progress"]},
        ),
        # The callback's record (jobs/callbacks.py): where the summary goes, and how the last attempt went.
        (
            "Callback",
            {
                "fields": [
                    "callback_url",
                    "callback_status",
                    "callback_attempts",
                    "callback_last_status",
                    "callback_last_error",
                    "callback_last_at",
                ]
            },
        ),
    ]
    readonly_fields = [
        *(f.name for f in Job._meta.fields if f.name not in EDITABLE_JOB_FIELDS),
        "standing",
        "batch_summary",
        "progress_bar",
        "retry_shown",
        "label_summary",
        "created",
        "started",
        "finished",
        "elapsed",
        "rows_per_s_shown",
        "eta",
        "upload_size",
        "ingest_claimed",
        "ingest_progress",
    ]

    # Columns and read-only fields ---------------------------------------------------------------

    @admin.display(description="batch", ordering="batch__public_id")
    def batch_ref(self, job: Job) -> str:
        batch = getattr(job, "batch", None)
        return batch.public_id if batch else ""

    @admin.display(description="batch")
    def batch_summary(self, job: Job) -> str:
        batch = Batch.objects.filter(job=job).select_related("job", "input_file", "output_file", "error_file").first()
        if batch is None:
            return "not a batch"
        shown = batch_object(batch)
        files = ", ".join(
            f"{name} {shown[key]}"
            for name, key in (("input", "input_file_id"), ("output", "output_file_id"), ("errors", "error_file_id"))
            if shown[key]
        )
        counts = shown["request_counts"]
        return (
            f"{batch.public_id} · {shown['status']} · {batch.endpoint} · {counts['completed']} of {counts['total']} "
            f"requests completed, {counts['failed']} failed · files: {files or 'none yet'}"
        )

    @admin.display(description="progress")
    def progress_bar(self, job: Job) -> str:
        return progress_html(job)

    @admin.display(description="retry")
    def retry_shown(self, job: Job) -> str:
        """Which failed rows a retry runs again, and why the others would only fail again (as the job's page says)."""
        offer = lifecycle.retry_offer(job)
        if not job.is_terminal or not (offer.rows or offer.input_rows):
            return NOT_STORED
        parts = [f"{offer.rows} row(s) failed at run time: a retry runs them again"] if offer.rows else []
        return "; ".join([*parts, *([offer.input_note] if offer.input_rows else [])])

    @admin.display(description="rows/s", ordering="rows_per_s")
    def rows_per_s_shown(self, job: Job) -> str:
        return f"{job.rows_per_s:.1f}"

    @admin.display(description="created", ordering="created_at")
    def created(self, job: Job) -> str:
        return when(job.created_at)

    @admin.display(description="started")
    def started(self, job: Job) -> str:
        return when(job.started_at)

    @admin.display(description="finished")
    def finished(self, job: Job) -> str:
        return when(job.finished_at)

    @admin.display(description="elapsed")
    def elapsed(self, job: Job) -> str:
        elapsed_s = job.elapsed_s()
        return NOT_STORED if elapsed_s is None else duration_text(elapsed_s)

    @admin.display(description="time left")
    def eta(self, job: Job) -> str:
        return time_left_text(job, scheduler.standing_of(job))

    @admin.display(description="where it stands")
    def standing(self, job: Job) -> str:
        """Its place in the offline backlog under the current shares, as the job page shows it."""
        place = scheduler.standing_of(job)
        if place is None:  # neither queued nor running: being read, or ended
            return NOT_STORED
        chunks, rows = ahead_texts(place)
        reason = place.waiting_reason or "nothing waits before it"
        return f"{reason} · {chunks} of other jobs before its next one · {rows} of other jobs before it ends"

    @admin.display(description="upload")
    def upload_size(self, job: Job) -> str:
        return f"{job.upload_bytes / 1e6:.1f} MB" if job.upload_bytes >= 100_000 else f"{job.upload_bytes:,} bytes"

    @admin.display(description="ingest claimed")
    def ingest_claimed(self, job: Job) -> str:
        return when(job.ingest_claimed_at)

    @admin.display(description="ingest last progress")
    def ingest_progress(self, job: Job) -> str:
        return when(job.ingest_progress_at)

    @admin.display(description="labels")
    def label_summary(self, job: Job) -> str:
        counts = job.rows.filter(status=RowStatus.DONE).values("label").annotate(n=Count("pk")).order_by("-n", "label")
        low = job.rows.filter(low_confidence=True).count()
        if not counts:
            return NOT_STORED
        labels = format_html_join(
            " · ",
            '<a href="{}">{}</a> {}',
            # Question-answering and extraction rows have no label: named, not an empty link.
            ((rows_url(job.pk, label=c["label"]), c["label"] or "no label", c["n"]) for c in counts),
        )
        return format_html(
            '{} — <a href="{}">{} low-confidence row(s) to review</a>',
            labels,
            rows_url(job.pk, low_confidence__exact="1"),
            low,
        )

    @admin.display(description="rows")
    def rows_link(self, job: Job) -> str:
        return format_html(
            '<a href="{}">all</a> · <a href="{}">low confidence</a>',
            rows_url(job.pk),
            rows_url(job.pk, low_confidence__exact="1"),
        )

    # Permissions: jobs are made by uploading a CSV and written only by the platform ------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        """A live job's priority may change; an ended job's page is read-only (no Save over nothing to change)."""
        if obj is not None and obj.is_terminal:
            return False
        return super().has_change_permission(request, obj)

    def formfield_for_dbfield(self, db_field, request: HttpRequest, **kwargs):
        field = super().formfield_for_dbfield(db_field, request, **kwargs)
        if db_field.name == "priority" and field is not None:
            field.help_text = (
                "higher is served first; the scheduler goes by it from its next pick (chunks already sent to "
                "the workers keep their place); the owner's own limit does not apply to staff"
            )
        return field

    def save_model(self, request: HttpRequest, obj: Job, form, change: bool) -> None:
        """Write the priority alone: the rest of the row was read when the form was, and workers have
        moved it on since (a whole-row save would write back an old status and counts)."""
        changed = [name for name in form.changed_data if name in EDITABLE_JOB_FIELDS]
        if changed:
            obj.save(update_fields=changed)

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Cancel, retry and export: for those the model permissions would let change jobs."""
        return request.user.has_perm("jobs.change_job")

    # Bulk actions on the list -------------------------------------------------------------------

    @admin.action(description="Cancel selected jobs (keeps rows done so far)", permissions=["operate"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        cancelled = sum(lifecycle.cancel(job) for job in queryset)
        self.message_user(request, f"{cancelled} job(s) cancelled")

    @admin.action(description="Retry rows of selected jobs that failed at run time", permissions=["operate"])
    def retry_failed_rows(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        rows = left = 0
        for job in queryset:
            if job.retryable:  # the rows its retry leaves: failed because of their input (empty text, ...)
                left += lifecycle.retry_offer(job).input_rows
            rows += lifecycle.retry_failed(job)
        note = f"; {left} row(s) that failed because of their input were left: fix the file and upload it again"
        self.message_user(
            request,
            f"{rows} failed row(s) queued again{note if left else ''}",
            messages.SUCCESS if rows else messages.WARNING,
        )

    def get_actions(self, request: HttpRequest):
        """The declared actions, plus one per model version: move the selected unfinished jobs to it (their
        rows still to run use it; rows done keep the version they ran on). Issue 21: a job keeps its
        pinned version to the end unless staff move it."""
        actions = super().get_actions(request)
        if not self.has_operate_permission(request):
            return actions
        registry = get_registry()
        names = sorted({v for model in registry.names() for v in registry.versions_of(model)})
        for version in names:

            def move(modeladmin, request, queryset, version=version):
                moved = versions.move(list(queryset), version)
                modeladmin.message_user(request, f"{moved} job(s) moved to model version {version}")

            name = f"move_to_version_{version}"
            actions[name] = (move, name, f"Move selected unfinished jobs to model version {version}")
        return actions

    @admin.action(description="Export results of selected jobs (CSV)", permissions=["operate"])
    def export_results(self, request: HttpRequest, queryset: QuerySet[Job]) -> StreamingHttpResponse:
        return export.csv_response(request, JobRow.objects.filter(job__in=queryset), "jobs-results.csv")

    # Per-job buttons on the job page (templates/admin/jobs/job/change_form.html) ---------------

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            # POST only, and admin_view adds the CSRF check: a link or a prefetch cannot cancel a job.
            path("<int:job_id>/cancel/", view(require_POST(self.cancel_view)), name="jobs_job_cancel"),
            path("<int:job_id>/retry/", view(require_POST(self.retry_view)), name="jobs_job_retry"),
            path("<int:job_id>/export.csv", view(self.export_view), name="jobs_job_export"),
            *super().get_urls(),
        ]

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context=None):
        job = self.get_object(request, object_id)
        if job is not None:
            extra_context = {**(extra_context or {}), "job_tools": self._tools(request, job)}
        return super().change_view(request, object_id, form_url, extra_context)

    def _tools(self, request: HttpRequest, job: Job) -> dict:
        allowed = self.has_operate_permission(request)
        offer = lifecycle.retry_offer(job)
        return {
            "can_operate": allowed,
            "can_cancel": allowed and not job.is_terminal,
            "can_retry": allowed and job.retryable and offer.rows > 0,
            "retry_rows": offer.rows,
            # Why the Retry button is off, in its title.
            "no_retry": lifecycle.no_retry_reason(job, offer) if job.retryable else NO_RETRY,
            "rows_url": rows_url(job.pk),
            "low_confidence_url": rows_url(job.pk, low_confidence__exact="1"),
            "low_confidence_rows": job.rows.filter(low_confidence=True).count(),
            "page_url": reverse("jobs:detail", args=[job.pk]),
        }

    def _operated_job(self, request: HttpRequest, job_id: int) -> Job:
        if not self.has_operate_permission(request):
            raise PermissionDenied
        return get_object_or_404(Job, pk=job_id)

    def _back_to(self, job: Job) -> HttpResponseRedirect:
        return HttpResponseRedirect(reverse("admin:jobs_job_change", args=[job.pk]))

    def cancel_view(self, request: HttpRequest, job_id: int) -> HttpResponse:
        job = self._operated_job(request, job_id)
        if lifecycle.cancel(job):
            self.message_user(request, f"Job {job.pk} cancelled; the {job.done_rows} row(s) done so far are kept.")
        else:
            self.message_user(
                request, f"Job {job.pk} had already ended ({job.status}); nothing to cancel.", messages.WARNING
            )
        return self._back_to(job)

    def retry_view(self, request: HttpRequest, job_id: int) -> HttpResponse:
        job = self._operated_job(request, job_id)
        if not job.is_terminal:
            self.message_user(
                request, f"Job {job.pk} is still {job.status}; retry it once it has ended.", messages.WARNING
            )
            return self._back_to(job)
        requeued = lifecycle.retry_failed(job)
        job.refresh_from_db()
        offer = lifecycle.retry_offer(job)  # after the retry: the rows it left
        if requeued:
            left = f" {offer.input_note}." if offer.input_rows else ""
            self.message_user(request, f"{requeued} failed row(s) of job {job.pk} queued again.{left}")
        else:
            self.message_user(request, f"{capfirst(lifecycle.no_retry_reason(job, offer))}.", messages.WARNING)
        return self._back_to(job)

    def export_view(self, request: HttpRequest, job_id: int) -> StreamingHttpResponse:
        job = self._operated_job(request, job_id)
        return export.csv_response(request, job.rows.all(), f"job-{job.pk}-results.csv")


# Row review ----------------------------------------------------------------------------------


def correction_choices(row: JobRow) -> list[tuple[str, str]]:
    """The empty choice, then the model's labels (and a stored correction the model no longer has, so it is not lost)."""
    labels = labels_for(row.job.model) if row.job_id else []
    if row.corrected_label and row.corrected_label not in labels:
        labels = [*labels, row.corrected_label]
    return [("", "—"), *((label, label) for label in labels)]


class CorrectionForm(forms.ModelForm):
    """The corrected label as a select of the row's model's labels: a typo cannot become a label."""

    corrected_label = forms.ChoiceField(required=False, choices=[("", "—")], label="Corrected label")

    class Meta:
        model = JobRow
        fields = ["corrected_label"]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["corrected_label"]
        field.choices = correction_choices(self.instance)
        if self.instance.pk:  # the list shows 50 of these selects: each says which row it corrects (WCAG 4.1.2)
            field.widget.attrs["aria-label"] = f"Corrected label for row {self.instance.row_number}"


def runner_up(row: JobRow) -> tuple[str, float] | None:
    """The second-best label and its score from the stored output's `scores` (None when only the top label was stored)."""
    scores = row.output.get("scores") if isinstance(row.output, dict) else None
    if not isinstance(scores, dict) or len(scores) < 2:
        return None
    ranked = sorted(
        ((label, value) for label, value in scores.items() if isinstance(value, int | float)),
        key=lambda item: item[1],
        reverse=True,
    )
    return ranked[1] if len(ranked) >= 2 else None


class LabelFilter(admin.AllValuesFieldListFilter):
    """The model's labels, and rows without one (failed, or a task that answers no label) named as such:
    Django's own filter showed them as a link with no text."""

    def choices(self, changelist):
        for choice in super().choices(changelist):
            if choice["display"] == "":
                choice = {**choice, "display": "(no label)"}
            yield choice


class RecentJobFilter(admin.RelatedFieldListFilter):
    """Only the latest jobs (and the one chosen): the full list would run down the page for ever."""

    def field_choices(self, field, request: HttpRequest, model_admin) -> list[tuple[int, str]]:
        jobs = list(Job.objects.order_by("-created_at")[:RECENT_JOBS_IN_FILTER])
        chosen = self.lookup_val[0] if self.lookup_val else None
        if chosen and str(chosen).isdigit() and all(str(job.pk) != str(chosen) for job in jobs):
            jobs += list(Job.objects.filter(pk=chosen))
        return [(job.pk, f"{job.pk} · {job.filename or job.model}") for job in jobs]


@admin.register(JobRow)
class JobRowAdmin(admin.ModelAdmin):
    # A list that fits 1,366 px beside its filters: the text takes the room, the rest is narrow.
    list_display = [
        "row_ref",
        "job_ref",
        "short_text",
        "predicted",
        "score_shown",
        "runner_up_shown",
        "corrected_label",
        "reviewer",
    ]
    list_display_links = ["row_ref"]
    list_editable = ["corrected_label"]
    list_filter = [
        "status",
        "low_confidence",
        ("label", LabelFilter),
        ("reviewed_by", admin.EmptyFieldListFilter),
        ("job", RecentJobFilter),
    ]
    search_fields = ["text", "external_id", "label", "corrected_label"]
    list_select_related = ["job", "reviewed_by"]
    list_per_page = 50
    empty_value_display = NOT_STORED
    ordering = ["-job", "index"]  # the latest job's rows first: that is the one being reviewed
    form = CorrectionForm
    # The text, the answer and the one editable field first; the bookkeeping below.
    fieldsets = [
        (None, {"fields": ["job", "text_full", "label", "score_shown", "runner_up_shown"]}),
        ("Review", {"fields": ["corrected_label", "reviewed_by", "reviewed"]}),
        (
            "Details",
            {
                "fields": [
                    "row_ref",
                    "external_id",
                    "status",
                    "error",
                    "failure",
                    "attempts",
                    "low_confidence_shown",
                    "output_shown",
                ]
            },
        ),
    ]
    readonly_fields = [
        "job",
        "row_ref",
        "external_id",
        "text_full",
        "status",
        "error",
        "attempts",
        "label",
        "score_shown",
        "runner_up_shown",
        "low_confidence_shown",
        "failure",
        "output_shown",
        "reviewed_by",
        "reviewed",
    ]
    actions = ["mark_reviewed"]

    def get_list_display(self, request: HttpRequest) -> list[str]:
        """Without the job column when the list is one job's rows (the filter already says which)."""
        if request.GET.get("job__id__exact"):
            return [name for name in self.list_display if name != "job_ref"]
        return list(self.list_display)

    def get_changelist_form(self, request: HttpRequest, **kwargs):
        return CorrectionForm

    def changelist_view(self, request: HttpRequest, extra_context=None):
        """A heading that says whose rows these are, instead of "Select job row to change"."""
        job_id = request.GET.get("job__id__exact", "")
        job = Job.objects.filter(pk=job_id).first() if job_id.isdigit() else None
        title = f"rows of job {job.pk} ({job.filename or job.model}, {job.model})" if job else "rows to review"
        low = request.GET.get("low_confidence__exact") == "1"
        title = f"Low-confidence {title}" if low else title[0].upper() + title[1:]
        # What the score column means for this job's model (a router's are similarities, not probabilities).
        meaning = score_meaning(task_of(job.model)) if job else None
        context = {"title": title, "score_meaning": meaning}
        return super().changelist_view(request, {**context, **(extra_context or {})})

    # Columns -----------------------------------------------------------------------------------

    @admin.display(description="row", ordering="index")
    def row_ref(self, row: JobRow) -> str:
        return f"#{row.row_number}"

    @admin.display(description="job", ordering="job")
    def job_ref(self, row: JobRow) -> str:
        return format_html('<a href="{}">{}</a>', reverse("admin:jobs_job_change", args=[row.job_id]), row.job_id)

    @admin.display(description="text")
    def short_text(self, row: JobRow) -> str:
        if not row.text.strip() and not row.inputs:  # a blank cell read as a missing column, or a layout fault
            return format_html('<span class="row-muted">{}</span>', "(empty)")
        shown = row.text if len(row.text) <= TEXT_SHOWN_CHARS else row.text[: TEXT_SHOWN_CHARS - 1] + "…"
        return format_html('<span class="row-text" title="{}">{}</span>', row.text[:TEXT_TITLE_CHARS], shown)

    @admin.display(description="input")
    def text_full(self, row: JobRow) -> str:
        return input_html(row)

    @admin.display(description="label / answer", ordering="label")
    def predicted(self, row: JobRow) -> str:
        if row.status != RowStatus.DONE:
            return format_html('<span class="row-status-{}" title="{}">{}</span>', row.status, row.error, row.status)
        return answer_html(row) or row.label

    @admin.display(description="score", ordering="score")
    def score_shown(self, row: JobRow) -> str:
        if row.score is None:
            return NOT_STORED
        meaning = score_meaning(task_of(row.job.model))
        if row.low_confidence:
            return format_html(
                '<span class="row-low" title="low confidence, flagged for review: {}">{} ⚑</span>',
                meaning.help,
                f"{row.score:.3f}",
            )
        return format_html('<span title="{}">{}</span>', meaning.help, f"{row.score:.3f}")

    @admin.display(description="failed by")
    def failure(self, row: JobRow) -> str:
        """Why a retry leaves this row or runs it again (lifecycle.retry_offer draws the same line)."""
        if row.status != RowStatus.FAILED:
            return NOT_STORED
        if row.input_error:
            return "its input: a retry leaves it (fix the file and upload it again)"
        return "the run: a retry runs it again"

    @admin.display(description="low confidence")
    def low_confidence_shown(self, row: JobRow) -> str:
        # Words, not the admin's green tick: a tick read as "fine" on the very rows that need a look.
        if not row.low_confidence:
            return "no"
        return format_html(
            '<span class="row-low">{}</span> {}', "yes ⚑", "(below the model's threshold: flagged for review)"
        )

    @admin.display(description="runner-up")
    def runner_up_shown(self, row: JobRow) -> str:
        second = runner_up(row)
        if second is None:
            output = row.output if isinstance(row.output, dict) else None
            if output is None:
                why = "no output yet"
            elif "label" in output:
                why = "not stored: this row's output has only the top label"
            else:
                why = "this task answers no labels"
            return format_html('<span title="{}">{}</span>', why, NOT_STORED)
        return format_html('{} <span class="row-muted">{}</span>', second[0], f"{second[1]:.3f}")

    @admin.display(description="reviewed by", ordering="reviewed_by__username")
    def reviewer(self, row: JobRow) -> str:
        if row.reviewed_by is None:
            return NOT_STORED
        return format_html('<span title="reviewed {}">{}</span>', when(row.reviewed_at), row.reviewed_by.get_username())

    @admin.display(description="reviewed at")
    def reviewed(self, row: JobRow) -> str:
        return when(row.reviewed_at)

    @admin.display(description="output")
    def output_shown(self, row: JobRow) -> str:
        if row.output is None:
            return NOT_STORED
        return format_html('<pre class="row-output">{}</pre>', json.dumps(row.output, indent=2, ensure_ascii=False))

    # Saving a correction records the reviewer ---------------------------------------------------

    def save_model(self, request: HttpRequest, obj: JobRow, form, change: bool) -> None:
        if "corrected_label" in form.changed_data:
            obj.reviewed_by, obj.reviewed_at = request.user, timezone.now()
        super().save_model(request, obj, form, change)

    @admin.action(description="Mark selected rows reviewed (the model's label stands)")
    def mark_reviewed(self, request: HttpRequest, queryset: QuerySet[JobRow]) -> None:
        updated = queryset.update(reviewed_by=request.user, reviewed_at=timezone.now())
        self.message_user(request, f"{updated} row(s) marked reviewed")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(CallbackSecret)
class CallbackSecretAdmin(admin.ModelAdmin):
    """Who has a callback secret and since when; the value is never shown (its owner rotates it by API)."""

    list_display = ["owner", "created_at"]
    fields = ["owner", "created_at"]
    readonly_fields = ["owner", "created_at"]
    search_fields = ["owner__username"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a secret made here would have to be shown here; POST /api/v1/callback-secret shows it once

    def has_change_permission(self, request: HttpRequest, obj: CallbackSecret | None = None) -> bool:
        return False  # deleting stays allowed: it revokes the secret (the next callback makes a new one)


# Offline shares -------------------------------------------------------------------------------


def _or_default(value: object, default: object) -> str:
    """A share's own value, or the settings default it falls back to when left empty."""
    if value in (None, ""):
        shown = f"{default:,}" if isinstance(default, int) else default
        return format_html(
            '<span class="row-muted" title="not set: the default in settings">default ({})</span>', shown
        )
    return f"{value:,}" if isinstance(value, int) else str(value)


@admin.register(UserShare)
class UserShareAdmin(admin.ModelAdmin):
    """Each user's share of the offline workers and quotas (jobs/quotas.py); users without one get the defaults."""

    list_display = [
        "user",
        "weight",
        "max_priority_shown",
        "max_queued_rows_shown",
        "max_unfinished_jobs_shown",
        "in_use",
    ]
    list_select_related = ["user"]
    search_fields = ["user__username"]
    autocomplete_fields = ["user"]
    ordering = ["user__username"]
    fields = ["user", "weight", "max_priority", "max_queued_rows", "max_unfinished_jobs"]

    # The settings each empty field falls back to, named in its help text on the form.
    DEFAULTS = {
        "max_priority": lambda: settings.JOBS_DEFAULT_MAX_PRIORITY,
        "max_queued_rows": lambda: f"{settings.JOBS_MAX_QUEUED_ROWS_PER_USER:,}",
        "max_unfinished_jobs": lambda: f"{settings.JOBS_MAX_UNFINISHED_JOBS_PER_USER:,}",
    }

    def formfield_for_dbfield(self, db_field, request: HttpRequest, **kwargs):
        field = super().formfield_for_dbfield(db_field, request, **kwargs)
        if field is not None and db_field.name in self.DEFAULTS:
            field.help_text = f"{field.help_text}; empty: {self.DEFAULTS[db_field.name]()} (settings)"
        return field

    @admin.display(description="highest priority", ordering="max_priority")
    def max_priority_shown(self, share: UserShare) -> str:
        return _or_default(share.max_priority, settings.JOBS_DEFAULT_MAX_PRIORITY)

    @admin.display(description="most queued rows", ordering="max_queued_rows")
    def max_queued_rows_shown(self, share: UserShare) -> str:
        return _or_default(share.max_queued_rows, settings.JOBS_MAX_QUEUED_ROWS_PER_USER)

    @admin.display(description="most unfinished jobs", ordering="max_unfinished_jobs")
    def max_unfinished_jobs_shown(self, share: UserShare) -> str:
        return _or_default(share.max_unfinished_jobs, settings.JOBS_MAX_UNFINISHED_JOBS_PER_USER)

    @admin.display(description="in use now")
    def in_use(self, share: UserShare) -> str:
        """What the quotas are checked against: the user's jobs not yet ended and their rows queued."""
        unfinished = Job.objects.filter(owner_id=share.user_id).exclude(status__in=TERMINAL).count()
        return f"{unfinished} job{'' if unfinished == 1 else 's'} · {quotas.queued_rows(share.user):,} rows"
