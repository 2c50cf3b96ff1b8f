"""Web pages for offline jobs: the list with the upload form, one job's progress, labels and rows, and
the Cancel / Retry-failed buttons (the same lifecycle calls as the API's actions).

The list and the job's summary card refresh themselves by fetching small HTML fragments rendered from
the same templates as the full page, so a page never shows two versions of the same numbers.
"""

from __future__ import annotations

import math
from datetime import datetime
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Page, Paginator
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.defaultfilters import pluralize
from django.utils import timezone
from django.utils.functional import SimpleLazyObject
from django.utils.text import capfirst
from django.views.decorators.http import require_POST, require_safe

from inference.core.registry import get_registry
from jobs import export, lifecycle, quotas, scheduler
from jobs.api.throttles import JobCreateThrottle, RetryThrottle, refusal, refused_wait_s
from jobs.api.views import create_from_upload
from jobs.display import (
    NO_RATE_YET,
    ahead_texts,
    answer_html,
    duration_text,
    headings,
    score_meaning,
    snippet_html,
    time_left_text,
)
from jobs.fairshare import band_rank
from jobs.forms import UploadForm
from jobs.ingest import IngestError
from jobs.models import Job, RowStatus
from jobs.permissions import Access, allows, reaches_others, visible_jobs

JOBS_PER_PAGE = 25
ROWS_PER_PAGE = 50
# The admin's row list, filtered to one job's low-confidence rows (jobs/admin.py's list_filter names).
REVIEW_URL = "/admin/jobs/jobrow/?job__id__exact={pk}&low_confidence__exact=1"


def describe(job: Job, user, now: datetime | None = None) -> Job:
    """Add what the templates show beside the stored fields: bar widths, elapsed, where the job stands in
    the offline backlog (while it waits or runs) and its time left, which buttons and rows `user` may use."""
    now = now or timezone.now()
    total = job.total_rows or 0
    job.done_pct = 100.0 * job.done_rows / total if total else 0.0
    job.failed_pct = 100.0 * job.failed_rows / total if total else 0.0
    job.reading_pct = 100.0 * job.ingest_progress
    job.remaining_rows = max(total - job.done_rows - job.failed_rows, 0)
    elapsed_s = job.elapsed_s(now)
    job.elapsed_text = "not started" if elapsed_s is None else duration_text(elapsed_s)
    # None unless queued or running: a job being read has no chunks yet, an ended one none left.
    job.standing = scheduler.standing_of(job)
    job.eta_text = time_left_text(job, job.standing)
    job.eta_unknown = job.eta_text == NO_RATE_YET
    if job.standing is not None:
        job.chunks_ahead_text, job.rows_ahead_text = ahead_texts(job.standing)
    # "question: q, context: passage" for tasks with several input fields, in the task's order.
    job.columns_text = (
        ", ".join(f"{f}: {c}" for f, c in lifecycle.job_columns(job).items()) if job.input_columns else ""
    )
    may_change = allows(user, job, Access.CHANGE)
    job.can_cancel = may_change and not job.is_terminal
    job.can_retry = may_change and job.retryable
    # Which failed rows a retry would run and why the others would fail again: counted only where a page shows
    # it (the job's summary), not for each job of the list.
    job.retry = SimpleLazyObject(lambda: lifecycle.retry_offer(job))
    job.can_see_rows = allows(user, job, Access.ROWS)
    return job


def _paged(items: QuerySet, request: HttpRequest, per_page: int) -> tuple[Page, str]:
    """One page of `items` (?page=, out-of-range pages clamp), and the query string of the other parameters."""
    page = Paginator(items, per_page).get_page(request.GET.get("page"))
    others = urlencode([(k, v) for k, v in request.GET.items() if k not in ("page", "fragment")])
    return page, others


def _job_page(request: HttpRequest) -> tuple[Page, str]:
    page, others = _paged(visible_jobs(request.user), request, JOBS_PER_PAGE)
    now = timezone.now()
    for job in page:
        describe(job, request.user, now)
    return page, others


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    """The upload form and the user's jobs (everyone's for staff allowed to view them), newest first, paged."""
    # Counted before the body is read, as the API's throttle is: bad uploads count too.
    wait_s = refused_wait_s(JobCreateThrottle, request) if request.method == "POST" else None
    form = UploadForm(request.POST or None, request.FILES or None)
    _offer_allowed_priorities(form, request.user)
    status = 200
    if wait_s is not None:
        form.is_valid()  # bound, so the page shows the fields as sent; its own errors would only distract
        form.errors.clear()
        form.add_error(None, refusal(JobCreateThrottle(), wait_s))
        status = 429
    elif request.method == "POST" and form.is_valid():
        try:
            job = create_from_upload(request.user, form.cleaned_data, form.cleaned_data["file"])
        except IngestError as error:
            form.add_ingest_error(error)
            status = error.status
        else:
            messages.success(request, f"Job {job.pk} created.")  # what it is doing, the summary says (and keeps saying)
            return redirect("jobs:detail", pk=job.pk)
    elif request.method == "POST":
        status = 400
    page, others = _job_page(request)
    # Errors on fields (marked beside them), as opposed to a refusal of the whole upload (a quota).
    field_errors = any(name != "__all__" for name in form.errors) if form.is_bound else False
    context = {
        "form": form,
        "page": page,
        "others": others,
        "live": _any_live(page),
        "field_errors": field_errors,
        "sees_all": reaches_others(request.user, Access.VIEW),
    }
    response = render(request, "jobs/list.html", context, status=status)
    if wait_s is not None:
        response["Retry-After"] = str(math.ceil(wait_s))
    return response


def _offer_allowed_priorities(form: UploadForm, user) -> None:
    """Only the priorities the user may ask for (their share's highest and below): one they may not would
    only be refused once the file is chosen and sent."""
    highest = quotas.share_of(user).max_priority
    field = form.fields["priority"]
    field.choices = [(value, label) for value, label in field.choices if band_rank(value) >= band_rank(highest)]


@login_required
@require_safe  # GET, and HEAD for monitors
def job_list_rows(request: HttpRequest) -> HttpResponse:
    """The job table's rows alone, for the list page to refresh itself."""
    page, others = _job_page(request)
    return render(request, "jobs/_job_rows.html", {"page": page, "others": others, "live": _any_live(page)})


def _any_live(page: Page) -> bool:
    return any(not job.is_terminal for job in page)


def label_summary(job: Job) -> list[dict]:
    """Rows done per predicted label, with how many of them are low-confidence; most frequent first."""
    return list(
        job.rows.filter(status=RowStatus.DONE)
        .values("label")
        .annotate(rows=Count("pk"), low=Count("pk", filter=Q(low_confidence=True)))
        .order_by("-rows", "label")
    )


# The row filters offered above the table, as the query parameters jobs/export.py's filtered_rows reads.
ROW_FILTERS = [
    ("All rows", {}),
    ("Failed", {"status": RowStatus.FAILED}),
    ("Low confidence", {"low_confidence": "1"}),
    ("Pending", {"status": RowStatus.PENDING}),
]


@login_required
@require_safe  # GET, and HEAD for monitors
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One job: summary card (refreshing while it runs), labels, and its rows a page at a time."""
    job = describe(get_object_or_404(visible_jobs(request.user), pk=pk), request.user)
    params = {k: v for k, v in request.GET.items() if k in ("status", "label", "low_confidence") and v}
    # Without the rows permission (another user's job), the page is the summary card alone.
    shown = export.filtered_rows(job, params) if job.can_see_rows else job.rows.none()
    rows, others = _paged(shown, request, ROWS_PER_PAGE)
    for row in rows:  # answers and entities, read from the stored output (jobs/display.py)
        row.answer_shown, row.snippet = answer_html(row), snippet_html(row)
    labels = label_summary(job) if job.can_see_rows else []
    spec = get_registry().get(job.model)
    filters = [(name, urlencode(query), query == params) for name, query in ROW_FILTERS]
    context = {
        "job": job,
        "task": spec.task if spec else "",
        "score": score_meaning(spec.task if spec else ""),
        "headings": headings(spec.task if spec else ""),
        "rows": rows,
        "others": others,
        # Question-answering, entities and embeddings answer no label: the labels card would only count "(none)".
        "labelled": any(item["label"] for item in labels),
        "labels": labels,
        "low_rows": sum(item["low"] for item in labels),
        "review_url": REVIEW_URL.format(pk=job.pk),
        "filters": filters,
        "label_filter": params.get("label", ""),
    }
    return render(request, "jobs/detail.html", context)


@login_required
@require_safe  # GET, and HEAD for monitors
def job_summary(request: HttpRequest, pk: int) -> HttpResponse:
    """The job's summary card alone, for the detail page to refresh itself while the job runs."""
    job = describe(get_object_or_404(visible_jobs(request.user), pk=pk), request.user)
    return render(request, "jobs/_summary.html", {"job": job})


@login_required
@require_POST
def job_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    """The Cancel button: rows done so far are kept, the rest are not run (lifecycle.cancel, as the API)."""
    job = get_object_or_404(visible_jobs(request.user, Access.CHANGE), pk=pk)
    if lifecycle.cancel(job):
        messages.success(request, f"Job {job.pk} cancelled: {job.done_rows} rows done are kept, the rest will not run.")
    else:
        messages.error(request, f"Job {job.pk} had already ended ({job.get_status_display()}); nothing to cancel.")
    return redirect("jobs:detail", pk=job.pk)


@login_required
@require_POST
def job_retry(request: HttpRequest, pk: int) -> HttpResponse:
    """The Retry button: the rows of an ended job that failed at run time run again (lifecycle.retry_failed, as
    the API), within the same per-user rate as the API's retry; rows that failed because of their input stay."""
    job = get_object_or_404(visible_jobs(request.user, Access.CHANGE), pk=pk)
    if (wait_s := refused_wait_s(RetryThrottle, request)) is not None:
        messages.error(request, f"Job {job.pk} was not retried: {refusal(RetryThrottle(), wait_s)}.")
    elif not job.is_terminal:
        messages.error(request, f"Job {job.pk} is still {job.get_status_display()}; retry it once it has ended.")
    elif requeued := lifecycle.retry_failed(job):
        job.refresh_from_db()
        left = lifecycle.retry_offer(job).input_note
        messages.success(
            request,
            f"Job {job.pk}: {requeued} failed row{pluralize(requeued)} queued again." + (f" {left}." if left else ""),
        )
    else:
        job.refresh_from_db()
        messages.error(request, f"{capfirst(lifecycle.no_retry_reason(job, lifecycle.retry_offer(job)))}.")
    return redirect("jobs:detail", pk=job.pk)
