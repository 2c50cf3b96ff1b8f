"""The jobs page's upload form: the same fields as the API's JobCreateSerializer."""

from __future__ import annotations

from django import forms

from inference.registry import get_registry


class UploadForm(forms.Form):
    """The web page's upload form; the API takes the same fields."""

    file = forms.FileField(
        label="CSV file",
        help_text="with a header row; comma, semicolon or tab separated",
        widget=forms.ClearableFileInput(attrs={"accept": ".csv,.tsv,.txt,text/csv,text/plain"}),
    )
    model = forms.ChoiceField()
    text_column = forms.CharField(initial="text", help_text="the header of the column to classify")
    id_column = forms.CharField(required=False, label="ID column", help_text="optional: copied to the results")
    delimiter = forms.ChoiceField(
        required=False,
        choices=[("", "detect from the file"), ("comma", "comma ,"), ("semicolon", "semicolon ;"), ("tab", "tab")],
    )
    encoding = forms.CharField(
        initial="utf-8", help_text="utf-8, latin-1, gbk, ...; a UTF-8/16/32 byte-order mark is honoured"
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        registry = get_registry()
        self.fields["model"].choices = [(name, name) for name in registry.names()]
        self.fields["model"].initial = registry.default

    @property
    def file_must_be_chosen_again(self) -> bool:
        """A browser never re-fills a file input: after any error on a submitted form, say so."""
        return self.is_bound and bool(self.errors)
