"""Staff's view of every user's keys: make one for a user (the secret is shown once, in a message),
revoke, change expiry, scopes and models. Revoking or deleting refuses the key within seconds."""

from __future__ import annotations

import csv

from django import forms
from django.contrib import admin, messages
from django.http import HttpResponse
from django.utils import timezone

from accounts.credentials import SCOPE_CHOICES
from accounts.models import ApiKey, Quota, Usage
from accounts.usage import METRICS


class ApiKeyForm(forms.ModelForm):
    scopes = forms.MultipleChoiceField(choices=SCOPE_CHOICES, widget=forms.CheckboxSelectMultiple)

    class Meta:
        model = ApiKey
        fields = ["user", "name", "scopes", "models_allowed", "expires_at", "revoked_at"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    form = ApiKeyForm
    list_display = ["name", "user", "prefix", "scope_list", "state", "created_at", "expires_at", "last_used_at"]
    list_filter = ["revoked_at", "created_at"]
    search_fields = ["name", "prefix", "user__username"]
    readonly_fields = ["prefix", "created_at", "last_used_at"]
    actions = ["revoke"]
    autocomplete_fields = ["user"]

    @admin.display(description="scopes")
    def scope_list(self, key: ApiKey) -> str:
        return ", ".join(key.scopes)

    def save_model(self, request, obj: ApiKey, form, change: bool) -> None:
        if not change:
            raw = obj.new_secret()
            messages.warning(request, f"The key for {obj.user}: {raw} (copy it now: it is not shown again).")
        super().save_model(request, obj, form, change)

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset) -> None:
        for key in queryset.filter(revoked_at__isnull=True):
            key.revoked_at = timezone.now()
            key.save(update_fields=["revoked_at"])  # each save tells the web processes (post_save)


@admin.register(Usage)
class UsageAdmin(admin.ModelAdmin):
    """Every user's usage, filterable by day and model; the selection (or all of it) exports as CSV."""

    list_display = ["day", "user", "api_key", "model", "requests", "inputs", "tokens", "job_rows"]
    list_filter = ["day", "model"]
    search_fields = ["user__username", "model", "api_key__prefix"]
    date_hierarchy = "day"
    actions = ["export_csv"]

    def has_add_permission(self, request) -> bool:
        return False  # rolled up from the counters, never typed in

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.action(description="Export the selected usage as CSV")
    def export_csv(self, request, queryset) -> HttpResponse:
        response = HttpResponse(content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = 'attachment; filename="usage.csv"'
        writer = csv.writer(response)
        writer.writerow(["day", "username", "key_prefix", "key_name", "model", *METRICS])
        for row in queryset.select_related("user", "api_key").order_by("day", "user_id", "model"):
            key = row.api_key
            writer.writerow(
                [row.day, row.user.get_username(), key.prefix if key else "", key.name if key else "", row.model]
                + [getattr(row, metric) for metric in METRICS]
            )
        return response


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    """Overrides of the default limits (settings QUOTA_*): a user's cover all their calls, a key's that key's.
    Saved, they apply on every web process within AUTH_REVOCATION_CHECK_S."""

    list_display = ["__str__", "requests_per_s", "burst", "tokens_per_day", "note"]
    search_fields = ["user__username", "api_key__prefix", "api_key__name", "note"]
    autocomplete_fields = ["user", "api_key"]
