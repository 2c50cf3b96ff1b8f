"""API keys for DRF's views (jobs, batches, files, keys, usage): `Token ipk_...` or `Bearer ipk_...`.

Listed before the DRF token class (settings): a key that is not an API key is left to it. A bad key
counts as a failed authentication of the address, as a bad token does (platform_/auth_throttle.py).
"""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header

from accounts import lastused
from accounts.credentials import Caller, caller_for_key, is_api_key
from platform_.auth_throttle import AuthThrottled, blocked_for_s_sync, record_failure_sync


class ApiKeyAuthentication(BaseAuthentication):
    """`request.auth` is the key's `Caller` (its scopes), `request.user` its user."""

    def authenticate(self, request: Any) -> tuple[Any, Caller] | None:
        parts = get_authorization_header(request).split()
        if len(parts) != 2 or parts[0].lower() not in (b"token", b"bearer"):
            return None
        raw = parts[1].decode(errors="replace")
        if not is_api_key(raw):
            return None
        caller = caller_for_key(raw)
        if caller is None:
            client_ip = request.META.get("REMOTE_ADDR", "")
            if wait_s := blocked_for_s_sync(client_ip):
                raise AuthThrottled(client_ip, wait_s)
            record_failure_sync(client_ip)
            raise exceptions.AuthenticationFailed("invalid API key: unknown, revoked or expired")
        lastused.touch_sync(caller.key_id)
        return caller.user, caller

    def authenticate_header(self, request: Any) -> str:
        return "Token"
