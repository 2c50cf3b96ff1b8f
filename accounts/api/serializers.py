"""The keys API's shapes: a key as listed (never its secret) and the request that makes one."""

from __future__ import annotations

from django.utils import timezone
from rest_framework import serializers

from accounts.credentials import SCOPES
from accounts.models import ApiKey
from inference.core.registry import get_registry


class ApiKeySerializer(serializers.ModelSerializer):
    state = serializers.CharField(read_only=True, help_text="active, expired or revoked")

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "scopes",
            "models_allowed",
            "state",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
        ]
        read_only_fields = fields


class ApiKeyCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=SCOPES),
        default=list(SCOPES),
        help_text=f"any of {', '.join(SCOPES)}; default: all",
    )
    models_allowed = serializers.ListField(
        child=serializers.CharField(max_length=200), default=list, help_text="model names; empty: every model"
    )
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)

    def validate_scopes(self, value: list[str]) -> list[str]:
        if not value:
            raise serializers.ValidationError("give at least one scope")
        return value

    def validate_models_allowed(self, value: list[str]) -> list[str]:
        served = get_registry().names()
        unknown = [name for name in value if name not in served]
        if unknown:
            raise serializers.ValidationError(f"unknown models {', '.join(unknown)}; served: {', '.join(served)}")
        return value

    def validate_expires_at(self, value):
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("must be in the future")
        return value


class IssuedKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="the secret: shown only in this answer")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields
