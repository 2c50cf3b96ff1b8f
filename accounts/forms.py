"""The keys page's form: what a person chooses when making a key."""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.utils import timezone

from accounts.credentials import SCOPE_CHOICES, SCOPES
from inference.core.registry import get_registry

EXPIRY_CHOICES = [("", "Never"), ("7", "In 7 days"), ("30", "In 30 days"), ("90", "In 90 days"), ("365", "In a year")]


class NewKeyForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="Say where it is used, e.g. 'staging crawler'.")
    scopes = forms.MultipleChoiceField(
        choices=SCOPE_CHOICES, initial=list(SCOPES), widget=forms.CheckboxSelectMultiple, label="Scopes"
    )
    models_allowed = forms.MultipleChoiceField(
        required=False,
        label="Models",
        help_text="Leave all unselected to allow every model.",
        widget=forms.SelectMultiple(attrs={"size": 4}),
    )
    expires_in_days = forms.ChoiceField(choices=EXPIRY_CHOICES, required=False, label="Expires")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["models_allowed"].choices = [(name, name) for name in get_registry().names()]

    def expires_at(self):
        days = self.cleaned_data.get("expires_in_days")
        return timezone.now() + timedelta(days=int(days)) if days else None
