"""One error shape for the whole API: {"detail": <message a person can act on>, "code": <machine-readable>};
and the error handlers that give people the product's styled 400/403/404/500 pages instead (templates/).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from django.conf import settings
from django.core.exceptions import (
    DisallowedHost,
    RequestDataTooBig,
    SuspiciousOperation,
    TooManyFieldsSent,
    TooManyFilesSent,
)
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpResponse, HttpResponseBadRequest, HttpResponseServerError, JsonResponse
from django.template import loader
from django.views import csrf, defaults
from rest_framework import exceptions
from rest_framework.views import exception_handler as drf_exception_handler


class ApiError(Exception):
    """An error answered as JSON with its own status, code and optional headers (used by async views)."""

    def __init__(
        self, status: int, code: str, detail: str, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail
        self.headers = headers or {}
        self.extra = extra

    def response(self) -> JsonResponse:
        response = JsonResponse({"detail": self.detail, "code": self.code, **self.extra}, status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response


def _flatten(detail: Any, prefix: str = "") -> list[str]:
    if isinstance(detail, dict):
        return [
            msg
            for key, value in detail.items()
            for msg in _flatten(value, f"{prefix}{key}: " if key != "non_field_errors" else prefix)
        ]
    if isinstance(detail, list):
        return [msg for item in detail for msg in _flatten(item, prefix)]
    return [f"{prefix}{detail}"]


def exception_handler(exc: Exception, context: dict[str, Any]) -> Any:
    """DRF's handler, with validation errors flattened into one readable `detail` (fields kept in `errors`)."""
    if isinstance(exc, ApiError):  # raised by a DRF view as the async views raise it: the same answer
        return exc.response()
    if isinstance(exc, Http404):  # DRF answers it, but without our `code`: make it the API's own 404
        exc = exceptions.NotFound(str(exc) or "not found")
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = {"detail": "; ".join(_flatten(exc.detail)), "code": "invalid", "errors": exc.detail}
    elif isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        response.data = {"detail": str(exc.detail), "code": codes if isinstance(codes, str) else "error"}
    return response


def is_api_path(path: str) -> bool:
    """Paths whose clients are programs: their errors are JSON in the API's shape, never an HTML page."""
    return path.startswith(("/api/", "/v1/", "/metrics/")) or path == "/metrics"


def api_error_response(path: str, status: int, code: str, detail: str, openai_type: str) -> JsonResponse | None:
    """An error as the API path answers it: OpenAI's shape on /v1/ (its compatible endpoints), the
    platform's {"detail", "code"} elsewhere under the API; None for a page (a person gets HTML)."""
    if path.startswith("/v1/"):
        error = {"message": detail, "type": openai_type, "param": None, "code": code}
        return JsonResponse({"error": error}, status=status)
    if is_api_path(path):
        return JsonResponse({"detail": detail, "code": code}, status=status)
    return None


def _bad_request_answer(exception: Exception | None) -> tuple[int, str, str]:
    """(status, code, detail) for what Django refused before any view could (its SuspiciousOperations)."""
    if isinstance(exception, TooManyFieldsSent):
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
        return 400, "too_many_fields", f"the form or query string has more than {limit} fields"
    if isinstance(exception, TooManyFilesSent):
        return 400, "too_many_files", f"the form has more than {settings.DATA_UPLOAD_MAX_NUMBER_FILES} files"
    if isinstance(exception, RequestDataTooBig):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return 413, "payload_too_large", f"the form's fields (files aside) are larger than {limit} bytes"
    if isinstance(exception, DisallowedHost):
        return 400, "disallowed_host", str(exception)
    if isinstance(exception, SuspiciousOperation):  # a malformed multipart form, a bad file name, ...
        return 400, "bad_request", f"the request was refused: {exception}"
    return 400, "bad_request", "the request could not be read"


def json_400(request: Any, exception: Exception | None = None) -> Any:
    """handler400: what Django refuses itself (more form fields than DATA_UPLOAD_MAX_NUMBER_FIELDS, a
    foreign Host, ...) answered as JSON naming the problem on API paths (its own HTML page otherwise),
    and with the product's styled 400 page (templates/400.html) for people."""
    status, code, detail = _bad_request_answer(exception)
    if (answer := api_error_response(request.path, status, code, detail, "invalid_request_error")) is not None:
        return answer
    try:
        return defaults.bad_request(request, exception)
    except Exception:  # a request Django refused may be what the page cannot render: never a 500 for it
        logging.getLogger(__name__).exception("the 400 page could not be rendered")
        return HttpResponseBadRequest(f"Bad request: {detail}.\n", content_type="text/plain")


def json_403(request: Any, exception: Exception | None = None) -> Any:
    """handler403: JSON for API paths; the product's styled 403 page (templates/403.html) for people."""
    if is_api_path(request.path):
        return JsonResponse(
            {"detail": "you do not have permission to do this", "code": "permission_denied"}, status=403
        )
    return defaults.permission_denied(request, exception)


def json_404(request: Any, exception: Exception | None = None) -> Any:
    """handler404: API clients get JSON for an unknown URL; people get the styled page with navigation."""
    if is_api_path(request.path):
        return JsonResponse({"detail": f"no such endpoint: {request.path}", "code": "not_found"}, status=404)
    return defaults.page_not_found(request, exception)


# Retry-After of a 503 for a database that is busy (the web's connection pool stayed full) or down.
DATABASE_RETRY_AFTER_S = 5


DATABASE_DETAIL = "the database is busy or unreachable; nothing already accepted was lost; try again shortly"


def database_unavailable_error() -> ApiError:
    """The same 503 for code that runs before Django's handlers (the ASGI body guard, the lean predict path)."""
    return ApiError(503, "database_unavailable", DATABASE_DETAIL, headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)})


def database_unavailable(request: Any) -> Any:
    """503 for a request that could not reach the database: JSON `database_unavailable` on API paths (in
    OpenAI's shape on /v1/), the styled 503 page for people; Retry-After either way."""
    detail = DATABASE_DETAIL
    response = api_error_response(request.path, 503, "database_unavailable", detail, "server_error")
    if response is None:
        try:
            response = HttpResponse(loader.render_to_string("503.html"), status=503)
        except Exception:
            response = HttpResponse(f"{detail}.\n", status=503, content_type="text/plain")
    response["Retry-After"] = str(DATABASE_RETRY_AFTER_S)
    return response


def json_500(request: Any) -> Any:
    """handler500: JSON for API paths; otherwise templates/500.html, rendered without the request (it may be
    what failed), and plain text if even that fails (a broken template must not hide the first error).

    A database that could not be reached (Django calls this while handling the exception) is a 503."""
    if isinstance(sys.exc_info()[1], OperationalError | InterfaceError):
        return database_unavailable(request)
    if (
        answer := api_error_response(request.path, 500, "server_error", "internal server error", "server_error")
    ) is not None:
        return answer
    try:
        return defaults.server_error(request)
    except Exception:
        logging.getLogger(__name__).exception("the 500 page could not be rendered")
        return HttpResponseServerError(
            "Server error: it was logged; try again in a moment.\n", content_type="text/plain"
        )


def csrf_failure(request: Any, reason: str = "") -> Any:
    """CSRF_FAILURE_VIEW: JSON for API paths; otherwise Django's view, which renders templates/403_csrf.html
    (the styled 403, with navigation; it never tells anyone to set DEBUG=True)."""
    if is_api_path(request.path):
        detail = f"CSRF check failed ({reason}); API clients should authenticate with a token, not a session cookie"
        return JsonResponse({"detail": detail, "code": "csrf_failed"}, status=403)
    return csrf.csrf_failure(request, reason)


# Django's security loggers for a client's oversized form: each logs its traceback at ERROR (about 2 KB).
_CLIENT_FORM_LOGGERS = frozenset(
    f"django.security.{name}" for name in ("TooManyFieldsSent", "TooManyFilesSent", "RequestDataTooBig")
)


class SkipExpectedRefusals(logging.Filter):
    """Drop django.request's log line for 503/504 answers: under overload they are the designed
    behaviour, counted in metrics; logging each one would make logging the bottleneck. Keep a
    client's oversized form to one line: the traceback says nothing about it, and a flood of such
    forms would otherwise write kilobytes per request."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in _CLIENT_FORM_LOGGERS:
            record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.WARNING, "WARNING"
            return True
        status = getattr(record, "status_code", None)
        return not (record.name == "django.request" and status in (503, 504))
