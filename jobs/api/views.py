"""Offline jobs API: upload (CSV or JSON lines), list, detail, results (JSON pages, streamed CSV or JSON lines),
cancel, retry."""

from __future__ import annotations

from django.conf import settings
from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions, mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.pagination import PageNumberPagination
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.credentials import JOBS_WRITE
from accounts.scopes import require_model
from inference.core.registry import get_registry
from jobs import export, lifecycle
from jobs.api.serializers import JobCreateSerializer, JobSerializer, RowSerializer
from jobs.api.throttles import JobCreateThrottle, ListThrottle, ResultsThrottle, RetryThrottle, throttled
from jobs.ingest import IngestError, column_fields
from jobs.models import FileFormat, Job, Priority
from jobs.permissions import Access, visible_jobs
from jobs.quotas import QuotaExceeded


class PayloadTooLarge(exceptions.APIException):
    status_code = 413
    default_code = "payload_too_large"


class QuotaRefused(exceptions.APIException):
    """A user's quota (jobs/quotas.py) would be passed: 429 without Retry-After (it depends on the user's
    own jobs ending, which the message says)."""

    status_code = 429
    default_code = "quota_exceeded"


class Conflict(exceptions.APIException):
    status_code = 409
    default_code = "conflict"


class JobPages(PageNumberPagination):
    """The job list a page at a time: unpaged, a user with thousands of jobs got megabytes per call."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 200


class RowPages(PageNumberPagination):
    page_size_query_param = "page_size"
    max_page_size = 1000

    @property
    def page_size(self) -> int:  # read at request time, so settings overrides apply
        return settings.JOBS_RESULTS_PAGE_SIZE


def job_create_refusal(error: IngestError) -> exceptions.APIException:
    """The API's answer to a job (or batch) that cannot be created: 413, a quota's 429, 429 or 400."""
    if error.status == 413:
        return PayloadTooLarge(error.message)
    if isinstance(error, QuotaExceeded):
        return QuotaRefused(error.message, error.code)
    if error.status == 429:
        return exceptions.Throttled(detail=error.message)
    return exceptions.ValidationError({error.field: [error.message]})


def format_of(filename: str) -> str:
    """The upload's format when the form does not say: JSON lines for .jsonl and .ndjson files, else CSV."""
    return FileFormat.JSONL if filename.lower().endswith((".jsonl", ".ndjson")) else FileFormat.CSV


def create_from_upload(user, data: dict, upload, api_key_id: int | None = None) -> Job:
    """Shared by the API and the web form: size check, then the file's start; IngestError carries the status.

    The job comes back `ingesting`: the rest of the file is read by an offline worker.
    """
    if upload.size > settings.JOBS_MAX_UPLOAD_BYTES:
        raise IngestError(
            f"the file is {upload.size} bytes; the limit is {settings.JOBS_MAX_UPLOAD_BYTES} bytes", status=413
        )
    delimiter = {"comma": ",", "semicolon": ";", "tab": "\t"}.get(data.get("delimiter") or "")
    return lifecycle.create_job(
        owner=user,
        model=data.get("model") or get_registry().default,
        upload=upload.open("rb"),
        filename=upload.name or "",
        text_column=data.get("text_column") or "",
        columns={name: data.get(name) or "" for name in column_fields() if name != "text_column"},
        id_column=data.get("id_column") or "",
        encoding=data.get("encoding") or "utf-8",
        delimiter=delimiter,
        file_format=data.get("file_format") or format_of(upload.name or ""),
        callback_url=data.get("callback_url") or "",
        priority=data.get("priority") or Priority.NORMAL,
        api_key_id=api_key_id,
    )


class JobViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Offline CSV jobs of the calling user (and others' where the admin's permissions allow: jobs/permissions.py)."""

    serializer_class = JobSerializer
    pagination_class = JobPages
    # For the schema generator only (it types the path's id from the model); requests use get_queryset().
    queryset = Job.objects.none()
    # Uploads are multipart; a JSON body gets 415. cancel and retry read no body.
    parser_classes = [MultiPartParser, FormParser]

    # What each action does to a job, for jobs/permissions.py: another user's job the caller may not
    # reach this way is a 404.
    ACCESS = {
        "results": Access.ROWS,
        "results_csv": Access.ROWS,
        "results_jsonl": Access.ROWS,
        "cancel": Access.CHANGE,
        "retry": Access.CHANGE,
    }

    def get_queryset(self) -> QuerySet[Job]:
        return visible_jobs(self.request.user, self.ACCESS.get(self.action, Access.VIEW))

    def get_throttles(self):
        # Uploads, results, listing and retries cost the server work; polling one job is cheap and stays free.
        throttles = {
            "create": [JobCreateThrottle],
            "list": [ListThrottle],
            "results": [ResultsThrottle],
            "results_csv": [ResultsThrottle],
            "results_jsonl": [ResultsThrottle],
            "retry": [RetryThrottle],
        }
        return [throttle() for throttle in throttles.get(self.action, [])]

    def throttled(self, request: Request, wait: float | None) -> None:
        raise throttled(next(iter(self.get_throttles()), None), wait)

    @extend_schema(request={"multipart/form-data": JobCreateSerializer}, responses={202: JobSerializer})
    def create(self, request: Request, *args, **kwargs) -> Response:
        # Bodies far over the limit never get here: platform_/asgi.py refuses them from Content-Length.
        form = JobCreateSerializer(data=request.data, context={"request": request})
        form.is_valid(raise_exception=True)
        # An API key's model allow-list holds for its jobs as for its online calls.
        require_model(request, JOBS_WRITE, form.validated_data.get("model") or get_registry().default)
        try:
            job = create_from_upload(
                request.user, form.validated_data, form.validated_data["file"], getattr(request.auth, "key_id", None)
            )
        except IngestError as error:
            raise job_create_refusal(error) from None
        # 202: the file's start is checked; the rest is read by a worker (status `ingesting`, then queued).
        return Response(JobSerializer(job, context={"request": request}).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        responses=RowSerializer(many=True),
        parameters=[
            OpenApiParameter("status", str, description="done, failed, pending or cancelled"),
            OpenApiParameter("low_confidence", bool),
            OpenApiParameter("label", str),
        ],
    )
    # pagination_class only tells the schema that the rows come in pages (the view paginates itself).
    @action(detail=True, methods=["get"], pagination_class=RowPages)
    def results(self, request: Request, pk: str | None = None) -> Response:
        rows = export.filtered_rows(self.get_object(), request.query_params)
        pages = RowPages()
        page = pages.paginate_queryset(rows, request, view=self)
        return pages.get_paginated_response(RowSerializer(page, many=True).data)

    @extend_schema(responses={(200, "text/csv"): str})
    @action(detail=True, methods=["get"], url_path="results.csv", url_name="results-csv")
    def results_csv(self, request: Request, pk: str | None = None) -> StreamingHttpResponse:
        job = self.get_object()
        return export.response(request, job.rows.all(), f"job-{job.pk}-results", export.WRITERS["csv"])

    @extend_schema(responses={(200, "application/jsonl"): str})
    @action(detail=True, methods=["get"], url_path="results.jsonl", url_name="results-jsonl")
    def results_jsonl(self, request: Request, pk: str | None = None) -> StreamingHttpResponse:
        """The rows as JSON lines: one object per row with its raw input and the model's output."""
        job = self.get_object()
        return export.response(request, job.rows.all(), f"job-{job.pk}-results", export.WRITERS["jsonl"])

    @extend_schema(request=None, responses={200: JobSerializer, 409: OpenApiResponse(description="the job has ended")})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        job = self.get_object()
        if not lifecycle.cancel(job):
            raise Conflict(f"job {job.pk} has already ended ({job.status}); nothing to cancel")
        job.refresh_from_db()
        return Response(JobSerializer(job, context={"request": request}).data)

    @extend_schema(
        request=None,
        responses={
            200: JobSerializer,
            409: OpenApiResponse(
                description="the job has not ended, is a batch, or has no row a retry could help: `conflict`, or "
                "`rows_failed_on_input` when its failed rows all failed because of their input (fix the file)"
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str | None = None) -> Response:
        """Run the rows of an ended job that failed at run time again (JOBS_RETRY_RATE per user); rows that
        failed because of their input (empty, too long) would fail again and are left, counted in
        `input_failed_rows`. The job ends again, and its callback announces that end only if its outcome
        changed (jobs/callbacks.py, schedule)."""
        job = self.get_object()
        if not job.is_terminal:
            raise Conflict(f"job {job.pk} is still {job.status}; retry it once it has ended")
        if job.file_format == FileFormat.BATCH:
            raise Conflict(
                f"job {job.pk} is a batch: its output and error files are final; submit its failed lines as a new batch"
            )
        requeued = lifecycle.retry_failed(job)
        job.refresh_from_db()
        offer = lifecycle.retry_offer(job)  # after the retry: the failed rows it left
        if not requeued:
            code = "rows_failed_on_input" if offer.input_rows and job.is_terminal else "conflict"
            raise Conflict(lifecycle.no_retry_reason(job, offer), code)
        data = JobSerializer(job, context={"request": request}).data
        return Response({**data, "requeued_rows": requeued, "input_failed_rows": offer.input_rows})
