"""Which scope each DRF endpoint needs of an API key: one table, checked by one permission class.

The online paths (predict, embeddings) check theirs in the views (accounts/credentials.Caller.require).
DRF tokens and sessions have every scope. Managing keys needs a session or a DRF token: a leaked key
must not be able to mint more keys or revoke its owner's others. Controlling model versions (staff) needs
one too.
"""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions, permissions

from accounts.credentials import JOBS_READ, JOBS_WRITE, Caller

# URL names (or prefixes of them) of the jobs API and the OpenAI Files and Batch APIs over it.
_JOB_URLS = ("job-", "openai-file", "openai-batch", "callback-secret")
# Key management and the DRF token's rotation (which a key would otherwise turn into a full-access token).
KEY_MANAGEMENT_URLS = ("apikey-list", "apikey-detail", "token-rotate")
# Staff control of model versions (promote, roll back, canary): an operator's act, never a tenant key's,
# whoever the key's owner is (a staff user's narrow key must not swap a model every tenant uses).
MODEL_CONTROL_URLS = ("model-deployment", "model-promote", "model-canary")


def needed_scope(url_name: str, method: str) -> str | None:
    """The scope a key needs for this endpoint; None: any key will do; "" : no key may (keys management)."""
    if url_name in KEY_MANAGEMENT_URLS or url_name in MODEL_CONTROL_URLS:
        return ""
    if url_name.startswith(_JOB_URLS):
        return JOBS_READ if method in permissions.SAFE_METHODS else JOBS_WRITE
    return None


class KeyScopes(permissions.BasePermission):
    """403 when the caller's API key lacks the endpoint's scope (a DRF default permission class)."""

    message = "this API key lacks the scope this endpoint needs"
    code = "scope_missing"

    def has_permission(self, request: Any, view: Any) -> bool:
        caller = request.auth
        if not isinstance(caller, Caller):
            return True
        match = request.resolver_match
        scope = needed_scope(match.url_name or "" if match else "", request.method)
        if scope is None:
            return True
        if scope == "":
            self.message = "API keys are managed with a session or an account token, not with an API key"
            return False
        if scope in caller.scopes:
            return True
        self.message = f"this API key ({caller.key_prefix}…) lacks the {scope!r} scope"
        return False


def require_model(request: Any, scope: str, model: str) -> None:
    """In a DRF view: 403 when the caller's API key may not use `scope` on `model` (its allow-list)."""
    caller = request.auth
    if isinstance(caller, Caller) and (refused := caller.refusal(scope, model)) is not None:
        code, detail = refused
        raise exceptions.PermissionDenied(detail, code)
