"""ASGI entry point: the web tier runs under uvicorn so predict calls wait on Redis without a thread each.

Predict calls take a lean path (`LeanView`): the async view is called straight from ASGI. Django's
handler costs every request a fresh thread pool (its ThreadSensitiveContext), a thread for each of
the request_started / request_finished signals and one to close the response, plus a thread hop
per classic middleware. Profiled under overload (py-spy, docs/benchmarks.md), creating and joining
those threads was about a third of a web process's CPU. The predict view does for itself the little
the middleware did (authentication from a token or a session, the nosniff header), LeanView sets
Content-Length, and its rare database calls go through `platform_.db.run_db`, which opens and closes
connections as a request would. Everything else (admin, docs, the rest of the API) goes through the
full stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import re

from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse, JsonResponse

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings")
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402  (after the app, which configures settings)

from inference.api.views import early_refusal, predict_view  # noqa: E402

logger = logging.getLogger("django.request")

# Django spools a whole request body to disk before any view runs, so an oversized upload is
# refused here, from its Content-Length, before a byte of it is read. The largest legitimate
# body is a CSV at the upload limit plus the multipart form around it.
MAX_BODY_BYTES = settings.JOBS_MAX_UPLOAD_BYTES + 1024 * 1024

_PREDICT_PATH = re.compile(r"^/api/v1/models/(?P<name>[^/]+)/predict$")


class LeanView:
    """Serves one async Django view from ASGI with no handler, middleware, signals or threads around it.

    `early(headers, **view_kwargs)` may answer a POST from its headers alone, before its body is read.
    """

    def __init__(self, view, max_body_bytes: int, early=None) -> None:
        self.view, self.max_body_bytes, self.early = view, max_body_bytes, early

    async def __call__(self, scope, receive, send, **view_kwargs) -> None:
        if self.early is not None and scope["method"] == "POST":
            headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
            response = self.early(headers, **view_kwargs)
            if response is not None:
                await _send(send, response)  # the server discards the unread body
                return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the caller left before sending the whole body: nothing was admitted
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _send(send, _too_large_response(len(body), self.max_body_bytes))
                return
            if not message.get("more_body"):
                break
        request = ASGIRequest(scope, io.BytesIO(bytes(body)))
        # As Django's handler does: a caller that hangs up cancels its view, so it stops holding an
        # admission slot (the view releases it on the way out) and nobody waits on its answer.
        view = asyncio.ensure_future(self.view(request, **view_kwargs))
        disconnect = asyncio.ensure_future(receive())
        await asyncio.wait({view, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not view.done():
            view.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await view
            return
        disconnect.cancel()
        try:
            response = view.result()
        except Exception:  # what Django's handler would turn into its 500 page, as JSON here
            logger.exception("unhandled error in %s", scope["path"])
            response = JsonResponse({"detail": "internal server error", "code": "server_error"}, status=500)
        await _send(send, response)


async def _send(send, response: HttpResponse) -> None:
    # CommonMiddleware's header, which this path skips: without it the server frames the body as chunked.
    if not response.has_header("Content-Length"):
        response["Content-Length"] = str(len(response.content))
    headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.items()]
    headers += [(b"set-cookie", c.output(header="").strip().encode("latin-1")) for c in response.cookies.values()]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.content})


def _too_large_response(length: int, limit: int) -> HttpResponse:
    response = JsonResponse(
        {"detail": f"the request body is {length} bytes; the limit is {limit} bytes", "code": "payload_too_large"},
        status=413,
    )
    response["Connection"] = "close"
    return response


predict_application = LeanView(predict_view, settings.DATA_UPLOAD_MAX_MEMORY_SIZE, early=early_refusal)


def _content_length(scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


async def application(scope, receive, send) -> None:
    if scope["type"] == "http" and (length := _content_length(scope)) > MAX_BODY_BYTES:
        await _send(send, _too_large_response(length, MAX_BODY_BYTES))
    elif scope["type"] == "http" and (match := _PREDICT_PATH.match(scope["path"])):
        await predict_application(scope, receive, send, name=match["name"])
    else:
        await django_application(scope, receive, send)
