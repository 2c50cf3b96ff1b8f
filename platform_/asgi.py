"""ASGI entry point: the web tier runs under uvicorn so predict calls wait on Redis without a thread each.

Predict calls take a lean path: Django's handler with no middleware. Under ASGI every classic
(sync) middleware costs a hop to a per-request thread and back, twice, and on a 2-core machine that
was about a fifth of the web tier's CPU per prediction. The predict view does for itself the little
the middleware did for it (authentication from a token or a session, nosniff header). Everything
else (admin, docs, the rest of the API) goes through the full stack.
"""

from __future__ import annotations

import os
import re

from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings")
django_application = get_asgi_application()

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


async def application(scope, receive, send) -> None:
    if scope["type"] == "http" and _PREDICT_PATH.match(scope["path"]):
        await predict_application(scope, receive, send)
    else:
        await django_application(scope, receive, send)
