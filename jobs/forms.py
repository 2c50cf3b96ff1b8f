from __future__ import annotations

from django import forms

from inference.registry import get_registry


class UploadForm(forms.Form):
    """The web page's upload form; the API takes the same fields."""

    file = forms.FileField(help_text="CSV with a header row; comma, semicolon or tab separated")
    model = forms.ChoiceField()
    text_column = forms.CharField(initial="text")
    id_column = forms.CharField(required=False, help_text="optional: a column copied to the results")
    encoding = forms.CharField(
        initial="utf-8", help_text="utf-8, latin-1, gbk, ...; a UTF-8/16/32 byte-order mark is honoured"
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        registry = get_registry()
        self.fields["model"].choices = [(name, name) for name in registry.names()]
        self.fields["model"].initial = registry.default
