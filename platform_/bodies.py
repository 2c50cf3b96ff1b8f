"""Request bodies on every path but predict: a size limit that holds for chunked bodies, and upload
endpoints that check credentials before reading a byte.

Django's ASGI handler reads a whole body into a temporary file (on disk past
FILE_UPLOAD_MAX_MEMORY_SIZE) before any middleware or view runs, so neither can stop an oversized
or anonymous upload in time: a chunked body has no Content-Length to refuse it by, and an anonymous
one was read to the end before DRF said 401. `BodyGuard` sits between the server and Django:

- a declared Content-Length over the path's limit gets 413 at once;
- a POST to an upload endpoint without valid credentials (a token, or a session for the web page)
  gets 401 (the page: a redirect to the login form) from its headers, without its body being read;
- a body without Content-Length (chunked) is counted as each piece arrives, before Django writes
  it anywhere; past the limit the caller gets 413 and the connection is closed, so the server stops
  reading. Within the limit, the Content-Length header is added to the request once the body is
  complete: Django's multipart parser reads nothing without one ("No file was submitted").

Every early answer carries `Connection: close`: the server would otherwise read (and discard) the
rest of the body to reach the next request on the connection.
"""

from __future__ import annotations

import io
from typing import Any

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse, JsonResponse

from platform_.errors import ApiError, api_error_response, database_unavailable

# The endpoints that take a file upload: POST /api/v1/jobs (jobs/api/urls.py), the upload form on
# the job list page (jobs/urls.py) and OpenAI's POST /v1/files (jobs/api/openai_batches.py). "api" answers 401 JSON; "page" redirects to the login form, as
# login_required would.
UPLOAD_ENDPOINTS = {"/api/v1/jobs": "api", "/jobs/": "page", "/v1/files": "api"}


def upload_limit_bytes() -> int:
    """A CSV at the upload limit plus the multipart form around it."""
    return settings.JOBS_MAX_UPLOAD_BYTES + 1024 * 1024


def other_limit_bytes() -> int:
    """Any other body: Django would refuse more than this of non-file data anyway, after reading it all."""
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def too_large(limit: int, length: int | None = None, path: str = "") -> HttpResponse:
    size = f"is {length} bytes" if length is not None else "passed the limit as it arrived"
    detail = f"the request body {size}; the limit is {limit} bytes"
    # OpenAI's shape on /v1/ (its clients read errors so); JSON on the pages' uploads too.
    response = api_error_response(path, 413, "payload_too_large", detail, "invalid_request_error") or JsonResponse(
        {"detail": detail, "code": "payload_too_large"}, status=413
    )
    response["Connection"] = "close"
    return response


def declared_length(scope: dict) -> int | None:
    """Content-Length, or None when the body is framed otherwise (chunked) or the header is not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _is_chunked(scope: dict) -> bool:
    return any(name == b"transfer-encoding" and b"chunked" in value.lower() for name, value in scope["headers"])


async def send_response(send: Any, response: HttpResponse) -> None:
    """Send a small, complete Django response straight to the server."""
    if not response.has_header("Content-Length"):
        response["Content-Length"] = str(len(response.content))
    headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.items()]
    headers += [(b"set-cookie", c.output(header="").strip().encode("latin-1")) for c in response.cookies.values()]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.content})


async def anonymous_upload_refusal(scope: dict, kind: str, auth: Any) -> HttpResponse | None:
    """401 (or a redirect to login) for an upload whose headers carry no valid credentials, else None.

    The same rules as the views behind it: the API takes `Authorization: Token <key>` first, then a
    session (DRF's TokenAuthentication, SessionAuthentication); the page takes a session. Lookups go
    through `auth` (the predict view's helpers, inference/web/api/auth.py, handed in by platform_/asgi.py):
    its token cache, failed-authentication throttling and run_db.
    CSRF is left to the view, which checks it after the body is read.
    """
    request = ASGIRequest(scope, io.BytesIO())  # headers and cookies only: the body stays unread
    header = request.headers.get("Authorization", "")
    if kind == "api" and header.partition(" ")[0].lower() in ("token", "bearer"):
        try:
            await auth.user_for_token(header.partition(" ")[2].strip(), request.META.get("REMOTE_ADDR", ""))
            return None
        except ApiError as error:
            return error.response()
    try:
        user = await auth.session_user(request)
    except ApiError as error:  # the database is unreachable: the styled 503 page, or JSON on an API path
        return database_unavailable(request) if error.status == 503 else error.response()
    if user.is_authenticated:
        return None
    if kind == "page":
        return redirect_to_login(request.get_full_path())
    detail = "authentication credentials were not provided: send 'Authorization: Token <key>'"
    return ApiError(401, "not_authenticated", detail, headers={"WWW-Authenticate": "Token"}).response()


class BodyGuard:
    """ASGI wrapper that enforces body limits and upload credentials before `app` reads a body.

    `auth` provides `user_for_token(key, address)` and `session_user(request)`: the predict view's own
    helpers, so an upload and a predict call share one token cache and one failed-authentication throttle.
    """

    def __init__(self, app: Any, auth: Any) -> None:
        self.app, self.auth = app, auth

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        kind = UPLOAD_ENDPOINTS.get(scope["path"]) if scope["method"] == "POST" else None
        limit = upload_limit_bytes() if kind else other_limit_bytes()
        length = declared_length(scope)
        if length is not None and length > limit:
            await send_response(send, too_large(limit, length, scope["path"]))
            return
        if kind and (refusal := await anonymous_upload_refusal(scope, kind, self.auth)) is not None:
            refusal["Connection"] = "close"
            await send_response(send, refusal)
            return
        if length is not None:
            # The server delivers exactly Content-Length bytes, already checked above.
            await self.app(scope, receive, send)
            return
        await self._counted(scope, receive, send, limit)

    async def _counted(self, scope: dict, receive: Any, send: Any, limit: int) -> None:
        """Hand the body to `app` piece by piece, counting; 413 and a disconnect for `app` past the limit."""
        chunked = _is_chunked(scope)
        # Django builds its request from the scope's headers only after the whole body is in, so a
        # Content-Length added to this copy at the last piece is there when it parses the body.
        headers = [(n, v) for n, v in scope["headers"] if not (chunked and n == b"transfer-encoding")]
        inner_scope = {**scope, "headers": headers}
        received = 0
        refused = False

        async def counted_receive() -> dict:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] != "http.request":
                return message
            received += len(message.get("body", b""))
            if received > limit:
                refused = True
                await send_response(send, too_large(limit, path=scope["path"]))
                # To `app` the caller hung up: Django's handler drops the body and sends nothing.
                return {"type": "http.disconnect"}
            if chunked and not message.get("more_body", False):
                headers.append((b"content-length", str(received).encode()))
            return message

        async def guarded_send(message: dict) -> None:
            if not refused:  # the caller already has its 413
                await send(message)

        await self.app(inner_scope, counted_receive, guarded_send)
