"""One error shape for the whole API: {"detail": <message a person can act on>, "code": <machine-readable>}."""

from __future__ import annotations

import logging
from typing import Any

from django.http import Http404, JsonResponse
from django.views import defaults
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


def json_404(request: Any, exception: Exception | None = None) -> Any:
    """API clients get JSON for an unknown URL; browsers get Django's page."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": f"no such endpoint: {request.path}", "code": "not_found"}, status=404)
    return defaults.page_not_found(request, exception)


def json_500(request: Any) -> Any:
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "internal server error", "code": "server_error"}, status=500)
    return defaults.server_error(request)


class SkipExpectedRefusals(logging.Filter):
    """Drop django.request's log line for 503/504 answers: under overload they are the designed
    behaviour, counted in metrics; logging each one would make logging the bottleneck."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        return not (record.name == "django.request" and status in (503, 504))
