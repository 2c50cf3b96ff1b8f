"""Authentication for the async predict view: the same tokens and sessions DRF accepts elsewhere.

DRF's authentication classes are sync and hit the database on every call; on the hot path a web
process keeps a token it has looked up for API_TOKEN_CACHE_S (so a revoked token works that long).
A token it has to look up is first checked against failed-authentication throttling
(platform_/auth_throttle.py), and a bad one counts as a failure of the caller's address.
"""

from __future__ import annotations

import time
from importlib import import_module
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user
from django.contrib.auth.models import AnonymousUser
from django.middleware.csrf import CsrfViewMiddleware
from rest_framework.authtoken.models import Token

from platform_ import auth_throttle
from platform_.db import run_db
from platform_.errors import ApiError

_token_cache: dict[str, tuple[float, Any]] = {}
_TOKEN_CACHE_MAX = 10_000


def _unauthenticated(detail: str) -> ApiError:
    return ApiError(401, "not_authenticated", detail, headers={"WWW-Authenticate": "Token"})


async def user_for_token(key: str, client_ip: str) -> Any:
    now = time.monotonic()
    cached = _token_cache.get(key)
    if cached and cached[0] > now:
        return cached[1]
    token = await run_db(Token.objects.select_related("user").filter(key=key).first)
    if token is None or not token.user.is_active:
        # Only a failure asks Redis. A token that checks out is accepted even from an address that has
        # failed too often: tenants behind one NAT or proxy share an address, and refusing valid tokens
        # would let one of them lock the others out; a 40-hex-digit key cannot be guessed anyway.
        if wait_s := await auth_throttle.blocked_for_s(client_ip):
            raise ApiError(
                429, "auth_throttled", auth_throttle.message(client_ip, wait_s), headers={"Retry-After": str(wait_s)}
            )
        await auth_throttle.record_failure(client_ip)
        raise _unauthenticated("invalid token")
    if len(_token_cache) >= _TOKEN_CACHE_MAX:
        _token_cache.clear()
    _token_cache[key] = (now + settings.API_TOKEN_CACHE_S, token.user)
    return token.user


def _load_session_user(request: Any) -> Any:
    if not hasattr(request, "session"):
        request.session = import_module(settings.SESSION_ENGINE).SessionStore(
            request.COOKIES[settings.SESSION_COOKIE_NAME]
        )
    return get_user(request)


async def session_user(request: Any) -> Any:
    """The session's user. Predict runs without middleware (platform_/asgi.py), so the session is loaded here."""
    if not hasattr(request, "session") and not request.COOKIES.get(settings.SESSION_COOKIE_NAME):
        return AnonymousUser()
    return await run_db(_load_session_user, request)


def _enforce_csrf(request: Any) -> None:
    """Session callers are browsers, so their POSTs need the CSRF token (as DRF's SessionAuthentication does)."""
    check = CsrfViewMiddleware(lambda req: None)
    check.process_request(request)
    reason = check.process_view(request, None, (), {})
    if reason:
        raise ApiError(403, "csrf_failed", f"CSRF failed: {reason.content.decode(errors='replace')[:200]}")


async def authenticate(request: Any) -> Any:
    """The user behind `Authorization: Token <key>` or a session; 401 when neither is there.

    `Bearer <key>` is the same token: what OpenAI clients (inference/api/openai_compat.py) send."""
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, key = header.partition(" ")
        if scheme.lower() not in ("token", "bearer") or not key.strip():
            raise _unauthenticated("Authorization header must be 'Token <key>' or 'Bearer <key>'")
        return await user_for_token(key.strip(), request.META.get("REMOTE_ADDR", ""))
    user = await session_user(request)
    if user.is_authenticated:
        _enforce_csrf(request)
        return user
    raise _unauthenticated("authentication credentials were not provided: send 'Authorization: Token <key>'")
