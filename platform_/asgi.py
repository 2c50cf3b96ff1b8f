"""ASGI entry point: the web tier runs under uvicorn so predict calls wait on Redis without a thread each.

Predict calls take a lean path: Django's handler with no middleware. Under ASGI every classic
(sync) middleware costs a hop to a per-request thread and back, twice, and on a 2-core machine that
was about a fifth of the web tier's CPU per prediction. The predict view does for itself the little
the middleware did for it (authentication from a token or a session, nosniff header). Everything
else (admin, docs, the rest of the API) goes through the full stack.
"""

from __future__ import annotations

import json
import os
import re

from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings")
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402  (after the app, which configures settings)

# Django spools a whole request body to disk before any view runs, so an oversized upload is
# refused here, from its Content-Length, before a byte of it is read. The largest legitimate
# body is a CSV at the upload limit plus the multipart form around it.
MAX_BODY_BYTES = settings.JOBS_MAX_UPLOAD_BYTES + 1024 * 1024

_PREDICT_PATH = re.compile(r"^/api/v1/models/[^/]+/predict$")


class NoMiddlewareASGIHandler(ASGIHandler):
    """Django's ASGI handler with an empty middleware chain (same URLs, same views)."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        get_response = self._get_response_async if is_async else self._get_response
        self._middleware_chain = convert_exception_to_response(get_response)


predict_application = NoMiddlewareASGIHandler()


def _content_length(scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


async def _too_large(send, length: int) -> None:
    body = json.dumps(
        {
            "detail": f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES} bytes",
            "code": "payload_too_large",
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def application(scope, receive, send) -> None:
    if scope["type"] == "http" and (length := _content_length(scope)) > MAX_BODY_BYTES:
        await _too_large(send, length)
    elif scope["type"] == "http" and _PREDICT_PATH.match(scope["path"]):
        await predict_application(scope, receive, send)
    else:
        await django_application(scope, receive, send)
