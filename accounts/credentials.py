"""Who is calling and what they may do: one `Caller` for every path (lean predict, embeddings, DRF).

An API key (`ipk_...`) carries its scopes and model allow-list; a DRF token or a session may do
everything (they predate keys, and their clients must keep working). The checks raise the API's
JSON errors: 403 `scope_missing` or `model_not_allowed`, never a 500.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils import timezone

# What a key may be used for. DRF tokens and sessions may do all of it (they predate keys).
PREDICT, EMBEDDINGS, JOBS_READ, JOBS_WRITE = "predict", "embeddings", "jobs:read", "jobs:write"
SCOPES = (PREDICT, EMBEDDINGS, JOBS_READ, JOBS_WRITE)
SCOPE_CHOICES = [
    (PREDICT, "Predict (POST /api/v1/models/<name>/predict)"),
    (EMBEDDINGS, "Embeddings (POST /v1/embeddings)"),
    (JOBS_READ, "Read jobs and batches"),
    (JOBS_WRITE, "Create, cancel and retry jobs and batches"),
]
# Every key starts with this, so a server (and a secret scanner) tells it from a 40-hex DRF token.
KEY_PREFIX = "ipk_"
PREFIX_SHOWN_CHARS = len(KEY_PREFIX) + 8


def hash_secret(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: the user, and the key they used (None: a DRF token or a session)."""

    user: Any
    key_id: int | None = None
    key_prefix: str = ""
    scopes: frozenset[str] = frozenset(SCOPES)
    models_allowed: tuple[str, ...] = ()
    expires_at: datetime | None = None
    # The quotas and rates of this caller's online calls (accounts/quotas.Limits), read with the credential.
    limits: tuple[Any, ...] = ()

    def refusal(self, scope: str, model: str | None = None) -> tuple[str, str] | None:
        """(code, detail) of the 403 this caller gets for `scope` on `model`; None when allowed."""
        if scope not in self.scopes:
            have = ", ".join(sorted(self.scopes)) or "none"
            return "scope_missing", f"this API key ({self.key_prefix}…) lacks the {scope!r} scope; its scopes: {have}"
        # An allow-list names models; a pin (router@2) is a version of one of them.
        if model is not None and self.models_allowed and model.partition("@")[0] not in self.models_allowed:
            allowed = ", ".join(self.models_allowed)
            return "model_not_allowed", f"this API key ({self.key_prefix}…) may call only {allowed}, not {model!r}"
        return None

    def require(self, scope: str, model: str | None = None) -> None:
        """Raise the API's 403 (async views) unless this caller may use `scope` on `model`."""
        # Imported here: DRF imports this module (via the authentication class) while platform_.errors loads.
        from platform_.errors import ApiError

        if (refused := self.refusal(scope, model)) is not None:
            raise ApiError(403, *refused)

    def expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())


def is_api_key(raw: str) -> bool:
    return raw.startswith(KEY_PREFIX)


def caller_for_key(raw: str) -> Caller | None:
    """The caller behind an API key's secret; None when it is unknown, revoked, expired or its user inactive."""
    from accounts.models import ApiKey  # this module is imported with DRF's settings, before the models

    key = ApiKey.objects.usable().select_related("user").filter(secret_sha256=hash_secret(raw)).first()
    if key is None:
        return None
    return Caller(
        user=key.user,
        key_id=key.pk,
        key_prefix=key.prefix,
        scopes=frozenset(key.scopes),
        models_allowed=tuple(key.models_allowed),
        expires_at=key.expires_at,
    )
