"""OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`) over the platform's offline jobs.

An OpenAI client pointed at the platform (`OpenAI(base_url="<host>/v1", api_key=<API token>)`) uploads a
JSONL file of requests, creates a batch from it, polls it and downloads its output file, as it would
from OpenAI. The batch runs as a job (jobs/batches.py says how); these views only wire HTTP to
jobs/files.py and jobs/batches.py, and answer errors in OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`), which OpenAI's clients turn into typed exceptions.

Everything is owner-only: another user's file or batch is a 404, as one that does not exist, for staff
too: these APIs are an account's own, as on OpenAI; staff allowed to see others' jobs reach a batch's job
through /api/v1/jobs (jobs/permissions.py).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import SuspiciousOperation
from django.db import transaction
from django.db.models import QuerySet
from django.http import JsonResponse, StreamingHttpResponse
from django.urls import path
from django.utils import timezone
from django.utils.http import content_disposition_header
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.views import APIView

from inference.web.api.openai_compat import OpenAIError, openai_error
from inference.web.validation import parse_json_body
from jobs import batches, files
from jobs.api.throttles import JobCreateThrottle, throttled
from jobs.api.views import job_create_refusal
from jobs.batches import id_like
from jobs.callbacks import CallbackRefused, check_destination
from jobs.ingest import IngestError, storable
from jobs.models import Batch, CallbackSecret, FilePurpose, StoredFile
from platform_.db import lock_user
from platform_.errors import ApiError
from platform_.streams import streaming_response

# OpenAI's bounds on `expires_after.seconds` (one hour to thirty days).
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)
LIST_LIMIT = (1, 100)


def _invalid(message: str, param: str | None = None, code: str = "invalid_value", status: int = 400) -> OpenAIError:
    return OpenAIError(status, code, message, param=param)


def _not_found(kind: str, public_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, "not_found", f"No such {kind} object: {public_id[:80]}", param=param)


class BoundedJSONParser(JSONParser):
    """JSON bodies checked as predict's are (depth and number limits: 400, never a RecursionError's 500)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return parse_json_body(
                "application/json",
                stream.read() if stream is not None else b"",
                max_depth=settings.ONLINE_MAX_JSON_DEPTH,
                max_number_digits=settings.ONLINE_MAX_NUMBER_DIGITS,
            )
        except ApiError as error:
            raise exceptions.ParseError(error.detail) from None


class OpenAIView(APIView):
    """An APIView whose every error (DRF's own included: 401, 415, 429, parse errors) is in OpenAI's shape."""

    def perform_content_negotiation(self, request: Request, force: bool = False):
        # OpenAI's client asks for `application/binary` (file content) or `application/json`; these views
        # answer with Django responses of their own type, so DRF's renderers must not refuse the Accept (406).
        return super().perform_content_negotiation(request, force=True)

    def throttled(self, request: Request, wait: float | None) -> None:
        # The same message as the jobs API's (what, the rate, when), not DRF's "Request was throttled."
        raise throttled(next(iter(self.get_throttles()), None), wait)

    def handle_exception(self, exc: Exception) -> Any:
        if isinstance(exc, OpenAIError):
            return exc.response()
        if isinstance(exc, SuspiciousOperation):  # too many form fields or files: Django would answer HTML
            return _invalid(f"the request was refused: {exc}", None, "invalid_request").response()
        if isinstance(exc, exceptions.APIException):
            headers = {}
            if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
                headers["Retry-After"] = str(math.ceil(exc.wait))
            if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
                headers["WWW-Authenticate"] = "Bearer"
            codes = exc.get_codes()
            code = codes if isinstance(codes, str) else "invalid_request"
            return openai_error(ApiError(exc.status_code, code, _text(exc.detail), headers=headers)).response()
        return super().handle_exception(exc)


def _text(detail: Any) -> str:
    if isinstance(detail, dict):
        return "; ".join(f"{key}: {_text(value)}" for key, value in detail.items())
    if isinstance(detail, list):
        return "; ".join(_text(item) for item in detail)
    return str(detail)


def _page(items: QuerySet, request: Request, to_object) -> JsonResponse:
    """OpenAI's cursor page: `after` (an id of the previous page's last item) and `limit` (1 to 100, default 20)."""
    try:
        limit = int(request.query_params.get("limit", 20))
    except ValueError:
        raise _invalid("`limit` must be a whole number from 1 to 100", "limit") from None
    if not LIST_LIMIT[0] <= limit <= LIST_LIMIT[1]:
        raise _invalid("`limit` must be a whole number from 1 to 100", "limit")
    after = request.query_params.get("after")
    if after:
        cursor = items.filter(public_id=after).values_list("pk", flat=True).first() if id_like(after) else None
        if cursor is None:
            raise _invalid(f"`after` is not an id in this list: {after[:80]}", "after")
        items = items.filter(pk__lt=cursor)
    page = list(items.order_by("-pk")[: limit + 1])
    data = [to_object(item) for item in page[:limit]]
    return JsonResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(page) > limit,
        }
    )


# --- files ---------------------------------------------------------------------------------------


def file_object(stored: StoredFile) -> dict[str, Any]:
    return {
        "id": stored.public_id,
        "object": "file",
        "bytes": stored.bytes,
        "created_at": int(stored.created_at.timestamp()),
        "expires_at": int(stored.expires_at.timestamp()) if stored.expires_at else None,
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
        "status_details": None,
    }


def visible_files(user) -> QuerySet[StoredFile]:
    return files.visible(user)


def _expires_at(data: Any) -> Any:
    """`expires_after[anchor]=created_at` and `expires_after[seconds]` (form fields, as OpenAI's client sends
    them); without them an upload lasts the platform's retention (JOBS_RESULT_TTL_DAYS)."""
    anchor = data.get("expires_after[anchor]")
    seconds = data.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        days = settings.JOBS_RESULT_TTL_DAYS
        return timezone.now() + timedelta(days=days) if days > 0 else None
    if anchor != "created_at":
        raise _invalid("`expires_after[anchor]` must be created_at", "expires_after.anchor")
    try:
        value = int(seconds)
    except (TypeError, ValueError):
        value = -1
    if not EXPIRES_AFTER_S[0] <= value <= EXPIRES_AFTER_S[1]:
        raise _invalid(
            f"`expires_after[seconds]` must be from {EXPIRES_AFTER_S[0]} to {EXPIRES_AFTER_S[1]}",
            "expires_after.seconds",
        )
    return timezone.now() + timedelta(seconds=value)


@extend_schema(exclude=True)  # OpenAI's API, documented by OpenAI and in docs/api.md
class FilesView(OpenAIView):
    """POST /v1/files (multipart: `file`, `purpose=batch`), GET /v1/files."""

    parser_classes = [MultiPartParser, FormParser]

    def get_throttles(self):
        return [JobCreateThrottle()] if self.request.method == "POST" else []

    def post(self, request: Request) -> JsonResponse:
        upload = request.FILES.get("file")
        if upload is None:
            raise _invalid("you must provide a `file` (multipart/form-data)", "file", "missing_required_parameter")
        purpose = request.data.get("purpose")
        if purpose != FilePurpose.BATCH:
            raise _invalid(
                f"`purpose` must be 'batch' (the only purpose served here), got {str(purpose)[:40]!r}", "purpose"
            )
        if upload.size > settings.JOBS_MAX_UPLOAD_BYTES:
            raise _invalid(
                f"the file is {upload.size} bytes; the limit is {settings.JOBS_MAX_UPLOAD_BYTES} bytes",
                "file",
                "file_too_large",
                status=413,
            )
        expires_at = _expires_at(request.data)
        with transaction.atomic():
            # The user's row locked: two uploads at once cannot both pass the count.
            lock_user(request.user)
            kept = visible_files(request.user).filter(purpose=FilePurpose.BATCH).count()
            if kept >= settings.JOBS_MAX_FILES_PER_USER:
                raise _invalid(
                    f"you keep {kept} uploaded files, the limit per user; delete some (DELETE /v1/files/<id>)",
                    "file",
                    "quota_files",
                    status=429,
                )
            name = storable(upload.name or "upload.jsonl")
            stored = files.store_upload(request.user, purpose, name, upload.open("rb"), expires_at)
        return JsonResponse(file_object(stored))

    def get(self, request: Request) -> JsonResponse:
        items = visible_files(request.user)
        if purpose := request.query_params.get("purpose"):
            if purpose not in FilePurpose.values:
                raise _invalid(f"`purpose` must be one of {', '.join(FilePurpose.values)}", "purpose")
            items = items.filter(purpose=purpose)
        return _page(items, request, file_object)


def _file(request: Request, file_id: str) -> StoredFile:
    stored = visible_files(request.user).filter(public_id=file_id).first() if id_like(file_id) else None
    if stored is None:
        raise _not_found("File", file_id)
    return stored


@extend_schema(exclude=True)  # OpenAI's API, documented by OpenAI and in docs/api.md
class FileView(OpenAIView):
    """GET /v1/files/{id}, DELETE /v1/files/{id}."""

    def get(self, request: Request, file_id: str) -> JsonResponse:
        return JsonResponse(file_object(_file(request, file_id)))

    def delete(self, request: Request, file_id: str) -> JsonResponse:
        stored = _file(request, file_id)
        stored.delete()  # its parts by cascade; a batch made from it keeps its own rows
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})


@extend_schema(exclude=True)  # OpenAI's API, documented by OpenAI and in docs/api.md
class FileContentView(OpenAIView):
    """GET /v1/files/{id}/content: the bytes, streamed a stored slice at a time."""

    def get(self, request: Request, file_id: str) -> StreamingHttpResponse:
        stored = _file(request, file_id)
        response = streaming_response(request, files.content(stored), "application/octet-stream")
        response["Content-Length"] = str(stored.bytes)
        response["Content-Disposition"] = content_disposition_header(True, stored.filename)
        return response


# --- batches -------------------------------------------------------------------------------------

# OpenAI's fields, and the platform's callback_url. `output_expires_after` is refused by name: output files
# last as long as the batch's job (JOBS_RESULT_TTL_DAYS).
BATCH_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata", "callback_url")


def _batches(user) -> QuerySet[Batch]:
    return Batch.objects.filter(job__owner=user).select_related("job", "input_file", "output_file", "error_file")


def _batch(request: Request, batch_id: str) -> Batch:
    batch = _batches(request.user).filter(public_id=batch_id).first() if id_like(batch_id) else None
    if batch is None:
        raise _not_found("Batch", batch_id)
    return batch


def _callback_url(user, value: Any) -> str:
    """The platform's own extension (OpenAI's client: `extra_body={"callback_url": ...}`): where the batch's
    end is POSTed, signed, as a job's is."""
    if value in (None, ""):
        return ""
    if not isinstance(value, str) or len(value) > 2000:
        raise _invalid("`callback_url` must be a URL of at most 2000 characters", "callback_url")
    try:
        check_destination(value, allow_private=settings.JOBS_CALLBACK_ALLOW_PRIVATE)
    except CallbackRefused as refused:
        raise _invalid(str(refused), "callback_url") from None
    if not CallbackSecret.objects.filter(owner=user).exists():
        raise _invalid(
            "create your callback secret first (POST /api/v1/callback-secret; it is shown once)", "callback_url"
        )
    return value


@extend_schema(exclude=True)  # OpenAI's API, documented by OpenAI and in docs/api.md
class BatchesView(OpenAIView):
    """POST /v1/batches, GET /v1/batches."""

    parser_classes = [BoundedJSONParser]

    def get_throttles(self):
        return [JobCreateThrottle()] if self.request.method == "POST" else []

    def post(self, request: Request) -> JsonResponse:
        data = request.data
        if not isinstance(data, dict):
            raise _invalid("the body must be a JSON object")
        for name in data:
            if name not in BATCH_FIELDS:
                shown = name[:64]
                raise _invalid(f"Unrecognized request argument supplied: {shown}", shown, "unknown_parameter")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if name not in data:
                raise _invalid(f"you must provide `{name}`", name, "missing_required_parameter")
        try:
            batch = batches.create_batch(
                request.user,
                input_file_id=data["input_file_id"],
                endpoint=data["endpoint"],
                completion_window=data["completion_window"],
                metadata=data.get("metadata"),
                callback_url=_callback_url(request.user, data.get("callback_url")),
            )
        except batches.BatchRefused as refused:
            raise _invalid(refused.message, refused.param, refused.code, refused.status) from None
        except IngestError as error:  # a quota: 429 with the quota's code and what to do
            refusal = job_create_refusal(error)
            raise openai_error(ApiError(refusal.status_code, str(refusal.get_codes()), str(refusal.detail))) from None
        return JsonResponse(batches.batch_object(batch))

    def get(self, request: Request) -> JsonResponse:
        return _page(_batches(request.user), request, batches.batch_object)


@extend_schema(exclude=True)  # OpenAI's API, documented by OpenAI and in docs/api.md
class BatchView(OpenAIView):
    """GET /v1/batches/{id}."""

    def get(self, request: Request, batch_id: str) -> JsonResponse:
        return JsonResponse(batches.batch_object(_batch(request, batch_id)))


@extend_schema(exclude=True)  # OpenAI's API, documented by OpenAI and in docs/api.md
class BatchCancelView(OpenAIView):
    """POST /v1/batches/{id}/cancel: `cancelling` at once, `cancelled` once the lines done are written out."""

    parser_classes = [BoundedJSONParser]

    def post(self, request: Request, batch_id: str) -> JsonResponse:
        batch = _batch(request, batch_id)
        if batches.batch_status(batch) == "cancelling":  # asked again while it stops: the same answer
            return JsonResponse(batches.batch_object(batch))
        if not batches.cancel_batch(batch):
            raise _invalid(
                f"batch {batch_id} cannot be cancelled: it is {batches.batch_status(batch)}",
                None,
                "batch_not_cancellable",
                status=409,
            )
        return JsonResponse(batches.batch_object(_batch(request, batch_id)))


# Included under v1/ by platform_/urls.py, before the OpenAI-compatible embeddings' catch-all.
urlpatterns = [
    path("files", FilesView.as_view(), name="openai-files"),
    path("files/<str:file_id>", FileView.as_view(), name="openai-file"),
    path("files/<str:file_id>/content", FileContentView.as_view(), name="openai-file-content"),
    path("batches", BatchesView.as_view(), name="openai-batches"),
    path("batches/<str:batch_id>", BatchView.as_view(), name="openai-batch"),
    path("batches/<str:batch_id>/cancel", BatchCancelView.as_view(), name="openai-batch-cancel"),
]
