"""API keys: many named keys per user, each with scopes, an optional model allow-list and expiry.

The secret is shown once, when the key is made; only its SHA-256 is stored (a 256-bit random secret
needs no slow hash: nobody can guess one, and the lookup must stay one indexed read). `prefix` is its
first characters, shown in lists so a user can tell keys apart.
"""

from __future__ import annotations

import secrets
from datetime import datetime

from django.conf import settings
from django.db import models
from django.utils import timezone
from rest_framework.exceptions import APIException

from accounts.credentials import KEY_PREFIX, PREFIX_SHOWN_CHARS, SCOPES, hash_secret


class TooManyKeys(APIException):
    status_code = 409
    default_code = "too_many_keys"


class ApiKeyQuerySet(models.QuerySet):
    def usable(self, now: datetime | None = None) -> ApiKeyQuerySet:
        now = now or timezone.now()
        return self.filter(revoked_at__isnull=True, user__is_active=True).filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        )


class ApiKey(models.Model):
    """One named credential of a user."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=PREFIX_SHOWN_CHARS, help_text="the key's first characters, shown")
    secret_sha256 = models.CharField(max_length=64, unique=True, editable=False)
    scopes = models.JSONField(default=list, help_text=f"any of {', '.join(SCOPES)}")
    models_allowed = models.JSONField(
        default=list, blank=True, help_text="model names this key may call; empty: every model"
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @classmethod
    def issue(
        cls,
        user,
        name: str,
        scopes: list[str],
        *,
        models_allowed: list[str] | None = None,
        expires_at: datetime | None = None,
    ) -> tuple[ApiKey, str]:
        """A new key and its secret, which is never stored and so can be shown only now."""
        key = cls(
            user=user,
            name=name,
            scopes=sorted(set(scopes), key=SCOPES.index),
            models_allowed=list(models_allowed or []),
            expires_at=expires_at,
        )
        raw = key.new_secret()
        key.save()
        return key, raw

    @classmethod
    def check_room(cls, user) -> None:
        """409 when the user already holds API_KEYS_PER_USER usable keys (revoked and expired ones do not count)."""
        held = cls.objects.usable().filter(user=user).count()
        if held >= settings.API_KEYS_PER_USER:
            raise TooManyKeys(
                f"you hold {held} active API keys, the most one user may (API_KEYS_PER_USER); revoke one first"
            )

    def new_secret(self) -> str:
        """Give this (unsaved) key a fresh secret; the secret, to show once."""
        raw = KEY_PREFIX + secrets.token_urlsafe(32)
        self.prefix, self.secret_sha256 = raw[:PREFIX_SHOWN_CHARS], hash_secret(raw)
        return raw

    def revoke(self) -> None:
        if self.revoked_at is None:
            self.revoked_at = timezone.now()
            self.save(update_fields=["revoked_at"])

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"


class Usage(models.Model):
    """What one user (through one key, or their token or session: no key) spent on one model on one day (UTC).

    Rolled up from Redis counters (accounts/usage.py) every USAGE_FLUSH_S; never written per request.
    """

    day = models.DateField()
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="usage")
    # A deleted key's usage stays its user's, without the key.
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage")
    model = models.CharField(max_length=200)
    requests = models.BigIntegerField(default=0, help_text="online calls answered (predict, embeddings)")
    inputs = models.BigIntegerField(default=0, help_text="texts in those calls")
    tokens = models.BigIntegerField(default=0, help_text="tokens the model read for them, after truncation")
    job_rows = models.BigIntegerField(default=0, help_text="offline job rows done")

    class Meta:
        ordering = ["-day", "user_id", "model"]
        indexes = [models.Index(fields=["user", "day"]), models.Index(fields=["day"])]
        verbose_name_plural = "usage"

    def __str__(self) -> str:
        return f"{self.day} {self.user_id} {self.model}"


class Quota(models.Model):
    """Staff's override of the default limits (settings QUOTA_*) for one user or one key.

    A user's limits cover all of their calls together; a key's, in addition, that key's calls. Empty
    fields keep the default (a key has no default of its own: only its user's limits apply); 0 lifts it.
    """

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="quota"
    )
    api_key = models.OneToOneField(ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="quota")
    requests_per_s = models.FloatField(null=True, blank=True, help_text="sustained online calls per second; 0: none")
    burst = models.PositiveIntegerField(null=True, blank=True, help_text="calls allowed at once above that rate")
    tokens_per_day = models.BigIntegerField(null=True, blank=True, help_text="tokens per UTC day; 0: no limit")
    note = models.CharField(max_length=200, blank=True, help_text="why (a plan, an agreement)")

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(user__isnull=False, api_key__isnull=True)
                | models.Q(user__isnull=True, api_key__isnull=False),
                name="quota_for_a_user_or_a_key",
            )
        ]

    def __str__(self) -> str:
        return f"quota of {self.user or self.api_key}"
