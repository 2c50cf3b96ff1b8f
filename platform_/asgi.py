"""ASGI entry point: the web tier runs under uvicorn so predict calls wait on Redis without a thread each.

Predict calls (and /v1/embeddings, predict in OpenAI's wire format) take a lean path (`LeanView`): the async view is called straight from ASGI. Django's
handler costs every request a fresh thread pool (its ThreadSensitiveContext), a thread for each of
the request_started / request_finished signals and one to close the response, plus a thread hop
per classic middleware. Profiled under overload (py-spy, docs/benchmarks.md), creating and joining
those threads was about a third of a web process's CPU. The predict view does for itself the little
the middleware did (authentication from a token or a session, the nosniff header), LeanView sets
Content-Length, and its rare database calls go through `platform_.db.run_db`, which opens and closes
connections as a request would. LeanView also checks the Host header against ALLOWED_HOSTS, as
Django's request.get_host() would. Everything else (admin, docs, the rest of the API) goes through
the full stack behind `BodyGuard` (platform_/bodies.py: body limits, chunked bodies, and credentials
checked before an upload is read).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
import logging
import os
import re

from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse, JsonResponse
from django.http.request import split_domain_port, validate_host

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_.settings.local")
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402  (after the app, which configures settings)
from django.utils.module_loading import import_string  # noqa: E402

# No persistent database connections in the web process. Under ASGI each request's sync work runs on a
# thread of its own (Django's ThreadSensitiveContext), and a connection kept for DB_CONN_MAX_AGE_S stays
# open with the thread's state after the request: a 30-way burst of uploads left 83 connections held
# and PostgreSQL refused every other client ("too many clients"). Django's docs say the same: disable
# persistent connections in async mode. The workers (one process per child) keep theirs.
#
# And a pool of at most WEB_DB_POOL_SIZE connections per web process (PostgreSQL): a request borrows one
# for its queries and gives it back. Without it each concurrent request held a connection of its own, and
# 150 concurrent sign-ins took PostgreSQL past max_connections (100): every other client, the workers
# included, was refused. A request that waits past WEB_DB_POOL_TIMEOUT_S for one gets 503
# database_unavailable (platform_/errors.py). Named in pg_stat_activity as platform-web:<pid>.
for _database in settings.DATABASES.values():
    _database["CONN_MAX_AGE"] = 0
    if _database["ENGINE"] == "django.db.backends.postgresql" and settings.WEB_DB_POOL_SIZE > 0:
        _database.setdefault("OPTIONS", {})["pool"] = {
            "min_size": 0,
            "max_size": settings.WEB_DB_POOL_SIZE,
            "timeout": settings.WEB_DB_POOL_TIMEOUT_S,
        }
        _database["OPTIONS"]["application_name"] = f"platform-web:{os.getpid()}"

from platform_.bodies import BodyGuard, declared_length, send_response, too_large  # noqa: E402

# The apps' entry points this wiring serves, named by dotted path as the URLconf names its includes:
# platform_ imports no app.
PREDICT_VIEW = "inference.web.api.views.predict_view"
PREDICT_EARLY_REFUSAL = "inference.web.api.views.early_refusal"
# OpenAI-compatible embeddings: predict under another wire format, so the same lean path (without the
# header-only early refusal: its model is named in the body).
EMBEDDINGS_VIEW = "inference.web.api.openai_compat.embeddings_view"
EMBEDDINGS_PATH = "/v1/embeddings"
UPLOAD_AUTH = "inference.web.api.auth"

logger = logging.getLogger("django.request")

_PREDICT_PATH = re.compile(r"^/api/v1/models/(?P<name>[^/]+)/predict$")


class LeanView:
    """Serves one async Django view from ASGI with no handler, middleware, signals or threads around it.

    `early(headers, **view_kwargs)` may answer a POST from its headers alone, before its body is read.
    """

    def __init__(self, view, max_body_bytes: int, early=None) -> None:
        self.view, self.max_body_bytes, self.early = view, max_body_bytes, early

    async def __call__(self, scope, receive, send, **view_kwargs) -> None:
        if (refusal := _host_refusal(scope)) is not None:
            await _send(send, refusal)
            return
        if (length := declared_length(scope)) is not None and length > self.max_body_bytes:
            await _send(send, too_large(self.max_body_bytes, length))
            return
        if self.early is not None and scope["method"] == "POST":
            headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
            response = self.early(headers, **view_kwargs)
            if response is not None:
                if getattr(response, "delay_s", 0) > 0:  # a caller retrying at once is answered later
                    await asyncio.sleep(response.delay_s)
                await _send(send, response)  # the server discards the unread body
                return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the caller left before sending the whole body: nothing was admitted
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:  # a chunked body, counted as it arrives
                await _send(send, too_large(self.max_body_bytes))
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


# CommonMiddleware's Content-Length, which this path skips (without it the server frames the body as
# chunked), is set by send_response.
_send = send_response

# Host header -> the 400 answer for it (None: allowed). Per host string, so the check costs a dict
# lookup; bounded, since the strings come from callers.
_host_answers: dict[str, HttpResponse | None] = {}
_HOST_ANSWERS_MAX = 1_000


def _host_refusal(scope) -> HttpResponse | None:
    """400 for a Host outside ALLOWED_HOSTS, as Django's request.get_host() would refuse it on other paths."""
    raw = None
    for name, value in scope["headers"]:
        if name == b"x-forwarded-host" and settings.USE_X_FORWARDED_HOST:
            raw = value.decode("latin-1")  # the whole value, as Django takes it
            break
        if name == b"host" and raw is None:
            raw = value.decode("latin-1")
    if raw is None:
        server = scope.get("server") or ("unknown", None)
        raw = f"{server[0]}:{server[1]}" if server[1] else str(server[0])
    if raw in _host_answers:
        return _host_answers[raw]
    allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    domain, _port = split_domain_port(raw)
    answer = None
    if not (domain and validate_host(domain, allowed)):
        detail = f"Invalid HTTP_HOST header: {raw!r}."
        detail += f" You may need to add {domain!r} to ALLOWED_HOSTS." if domain else " It is not a valid host name."
        answer = JsonResponse({"detail": detail, "code": "disallowed_host"}, status=400)
        answer["Connection"] = "close"  # the body stays unread: the server must not read on to a next request
    if len(_host_answers) >= _HOST_ANSWERS_MAX:
        _host_answers.clear()
    _host_answers[raw] = answer
    return answer


predict_application = LeanView(
    import_string(PREDICT_VIEW), settings.DATA_UPLOAD_MAX_MEMORY_SIZE, early=import_string(PREDICT_EARLY_REFUSAL)
)


embeddings_application = LeanView(import_string(EMBEDDINGS_VIEW), settings.DATA_UPLOAD_MAX_MEMORY_SIZE)


guarded_django_application = BodyGuard(django_application, auth=importlib.import_module(UPLOAD_AUTH))


async def application(scope, receive, send) -> None:
    if scope["type"] == "http" and (match := _PREDICT_PATH.match(scope["path"])):
        await predict_application(scope, receive, send, name=match["name"])
    elif scope["type"] == "http" and scope["path"] == EMBEDDINGS_PATH:
        await embeddings_application(scope, receive, send)
    else:
        await guarded_django_application(scope, receive, send)
