"""Staff's view of every user's keys: make one for a user (the secret is shown once, in a message),
revoke, change expiry, scopes and models. Revoking or deleting refuses the key within seconds."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.utils import timezone

from accounts.credentials import SCOPE_CHOICES
from accounts.models import ApiKey


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
