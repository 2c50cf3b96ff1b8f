"""Web pages for offline jobs: list and upload, and one job's progress and results."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from jobs.api.views import create_from_upload, visible_jobs
from jobs.forms import UploadForm
from jobs.ingest import IngestError


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    form = UploadForm(request.POST or None, request.FILES or None)
    status = 200
    if request.method == "POST" and form.is_valid():
        try:
            job = create_from_upload(request.user, form.cleaned_data, form.cleaned_data["file"])
        except IngestError as error:
            form.add_error("file", error.message)
            status = error.status
        else:
            return redirect("jobs:detail", pk=job.pk)
    elif request.method == "POST":
        status = 400
    jobs = visible_jobs(request.user)[:50]
    return render(request, "jobs/list.html", {"form": form, "jobs": jobs}, status=status)


@login_required
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    job = get_object_or_404(visible_jobs(request.user), pk=pk)
    rows = job.rows.order_by("index")[:20]
    return render(request, "jobs/detail.html", {"job": job, "rows": rows})
