"""Authentication for the async predict view: the same tokens and sessions DRF accepts elsewhere.

DRF's authentication classes are sync and hit the database on every call; on the hot path a web
process keeps a token it has looked up for API_TOKEN_CACHE_S. A revocation (a token deleted or
replaced, its user deactivated or deleted) bumps a counter in Redis (`revoked`, wired to the models'
signals in inference/apps.py); each process reads it at most every AUTH_REVOCATION_CHECK_S and forgets
every cached token when it moved, so a revoked token stops working on every path within about that,
for one Redis GET per second per process, not one per request. Before, it kept working for the
whole 30 s cache.
A token it has to look up is first checked against failed-authentication throttling
(platform_/auth_throttle.py), and a bad one counts as a failure of the caller's address.

The credential is a DRF token (every scope) or an API key (`ipk_...`, accounts/credentials.py: its
scopes and model allow-list); either way the caller comes back as a `Caller`. A cached key is also
refused once its expiry passes, without waiting for the cache. A key's last use is noted in Redis
(accounts/lastused.py), at most once a minute per process, never in the database on the request.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from importlib import import_module
from typing import Any

import redis
from django.conf import settings
from django.contrib.auth import get_user
from django.contrib.auth.models import AnonymousUser
from django.db import InterfaceError, OperationalError, transaction
from django.middleware.csrf import CsrfViewMiddleware
from rest_framework.authtoken.models import Token

from accounts import lastused, quotas
from accounts.credentials import Caller, caller_for_key, is_api_key
from platform_ import auth_throttle
from platform_.db import run_db
from platform_.errors import ApiError, database_unavailable_error
from platform_.redis import get_async_redis, get_redis

logger = logging.getLogger(__name__)

_token_cache: dict[str, tuple[float, Any]] = {}
_TOKEN_CACHE_MAX = 10_000
REVOCATIONS_KEY = "auth:revocations"
# The revocation counter this process last saw, and when it next reads it.
_seen_revocations: list[Any] = [None, 0.0]


def revoked(**_: Any) -> None:
    """Signal receiver: some token or user lost its access; every web process drops its cached tokens.

    Once the change is committed: told before, a process could drop its cache, look the token up again
    while the change was still uncommitted, and keep the old answer for the whole cache time."""
    transaction.on_commit(_bump_revocations)


def _bump_revocations() -> None:
    try:
        get_redis().incr(REVOCATIONS_KEY)
    except redis.RedisError:  # the caches then expire on their own, within API_TOKEN_CACHE_S
        logger.warning("auth: Redis unavailable, cached tokens expire on their own", exc_info=True)


def user_deactivated(instance: Any, **_: Any) -> None:
    if not instance.is_active:
        revoked()


async def _forget_revoked(now: float) -> None:
    if now < _seen_revocations[1]:
        return
    _seen_revocations[1] = now + settings.AUTH_REVOCATION_CHECK_S
    try:
        current = await get_async_redis().get(REVOCATIONS_KEY)
    except redis.RedisError:
        return
    if current != _seen_revocations[0]:
        if _seen_revocations[0] is not None or current is not None:
            _token_cache.clear()
        _seen_revocations[0] = current


def _unauthenticated(detail: str) -> ApiError:
    return ApiError(401, "not_authenticated", detail, headers={"WWW-Authenticate": "Token"})


def _caller_for_token(key: str) -> Caller | None:
    if is_api_key(key):
        caller = caller_for_key(key)
    else:
        token = Token.objects.select_related("user").filter(key=key).first()
        caller = Caller(user=token.user) if token is not None and token.user.is_active else None
    # Read with the credential and cached with it: a quota changed by staff clears the cache (apps.py).
    return caller and dataclasses.replace(caller, limits=quotas.limits_for(caller.user, caller.key_id))


async def caller_for_token(key: str, client_ip: str) -> Caller:
    now = time.monotonic()
    await _forget_revoked(now)
    cached = _token_cache.get(key)
    if cached and cached[0] > now and not cached[1].expired():
        await lastused.touch(cached[1].key_id)
        return cached[1]
    try:
        caller = await run_db(_caller_for_token, key)
    except (OperationalError, InterfaceError) as error:
        # Down, or its pool exhausted: this runs before Django's handlers (the lean predict path, the
        # upload guard), where an uncaught error was the server's plain-text 500.
        raise database_unavailable_error() from error
    if caller is None:
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
    _token_cache[key] = (now + settings.API_TOKEN_CACHE_S, caller)
    await lastused.touch(caller.key_id)
    return caller


async def user_for_token(key: str, client_ip: str) -> Any:
    """The user behind a token or key (platform_/bodies.py checks uploads' credentials with it)."""
    return (await caller_for_token(key, client_ip)).user


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
    try:
        return await run_db(_load_session_user, request)
    except (OperationalError, InterfaceError) as error:
        raise database_unavailable_error() from error


def _enforce_csrf(request: Any) -> None:
    """Session callers are browsers, so their POSTs need the CSRF token (as DRF's SessionAuthentication does)."""
    check = CsrfViewMiddleware(lambda req: None)
    check.process_request(request)
    reason = check.process_view(request, None, (), {})
    if reason:
        raise ApiError(403, "csrf_failed", f"CSRF failed: {reason.content.decode(errors='replace')[:200]}")


async def authenticate(request: Any) -> Caller:
    """The caller behind `Authorization: Token <key>` or a session; 401 when neither is there.

    `Bearer <key>` is the same token: what OpenAI clients (inference/web/api/openai_compat.py) send."""
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, key = header.partition(" ")
        if scheme.lower() not in ("token", "bearer") or not key.strip():
            raise _unauthenticated("Authorization header must be 'Token <key>' or 'Bearer <key>'")
        return await caller_for_token(key.strip(), request.META.get("REMOTE_ADDR", ""))
    user = await session_user(request)
    if user.is_authenticated:
        _enforce_csrf(request)
        return Caller(user=user, limits=await run_db(quotas.limits_for, user, None))
    raise _unauthenticated("authentication credentials were not provided: send 'Authorization: Token <key>'")
