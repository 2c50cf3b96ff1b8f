"""The jobs page's upload form: the same fields as the API's JobCreateSerializer."""

from __future__ import annotations

import re

from django import forms

from inference.core.registry import get_registry
from inference.core.task_io import input_fields
from jobs.ingest import IngestError, column_field, column_fields, default_column
from jobs.models import Priority

# Upload field names as the API's messages write them (`question_column`): the page says its labels instead.
_FIELD_NAME = re.compile(r"\b[a-z]+_column\b")


class UploadForm(forms.Form):
    """The web page's upload form; the API takes the same fields."""

    file = forms.FileField(
        label="CSV or JSON lines file",
        help_text="CSV with a header row (comma, semicolon or tab separated), or a .jsonl file of one JSON object "
        "per line, its fields named like the columns",
        widget=forms.ClearableFileInput(
            attrs={"accept": ".csv,.tsv,.txt,.jsonl,.ndjson,text/csv,text/plain,application/jsonl"}
        ),
    )
    # Choice errors name the choices, not the value sent (Django's own would echo a value of any size).
    model = forms.ChoiceField(error_messages={"invalid_choice": "choose one of the served models"})
    # A column field left blank means its default (`default_column`, shown as the placeholder). Not prefilled,
    # so that a question-answering upload (which refuses a text column) does not carry one the person never typed.
    text_column = forms.CharField(
        required=False,
        max_length=255,
        help_text="the header of the column to run (default: text); not for question-answering models",
    )
    question_column = forms.CharField(
        required=False,
        max_length=255,
        help_text="question-answering models: the header of the questions' column (default: question)",
    )
    context_column = forms.CharField(
        required=False,
        max_length=255,
        help_text="question-answering models: the header of the contexts' column, the passages answers come from "
        "(default: context)",
    )
    id_column = forms.CharField(
        required=False, max_length=255, label="ID column", help_text="optional: copied to the results"
    )
    delimiter = forms.ChoiceField(
        required=False,
        choices=[("", "detect from the file"), ("comma", "comma ,"), ("semicolon", "semicolon ;"), ("tab", "tab")],
        error_messages={"invalid_choice": "choose comma, semicolon or tab, or leave it to be detected"},
    )
    priority = forms.ChoiceField(
        required=False,  # left out: normal, as on the API
        choices=Priority.choices,
        error_messages={"invalid_choice": "choose high, normal or low"},
        initial=Priority.NORMAL,
        help_text="higher is served first; a lower priority still advances (normal unless staff raised your limit)",
    )
    encoding = forms.CharField(
        max_length=40, initial="utf-8", help_text="utf-8, latin-1, gbk, ...; a UTF-8/16/32 byte-order mark is honoured"
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        registry = get_registry()
        self.fields["model"].choices = [(name, f"{name} ({registry.get(name).task})") for name in registry.names()]
        self.fields["model"].initial = registry.default
        added = {
            name: forms.CharField(
                required=False,
                max_length=255,
                help_text=f"the header of the {default_column(name)} column (default: {default_column(name)})",
            )
            for name in column_fields()
            if name not in self.fields  # a plugin task's field (query_column, ...): named by its task type's fields
        }
        if added:  # shown with the other column fields, before the ID column
            fields = list(self.fields.items())
            at = next(i for i, (name, _) in enumerate(fields) if name == "id_column")
            self.fields = dict([*fields[:at], *added.items(), *fields[at:]])
        for name in column_fields():
            # What a blank field means, where the person sees it; the page's file check reads it from here too.
            self.fields[name].widget.attrs["placeholder"] = default_column(name)

    def clean(self) -> dict:
        """Blank column fields the chosen model reads become their defaults; the ones it does not read stay
        blank (the API refuses a column a model would not read)."""
        data = super().clean()
        spec = get_registry().get(data.get("model") or "")
        if spec is not None:
            for name in map(column_field, input_fields(spec.task)):
                data[name] = data.get(name) or default_column(name)
        return data

    def add_ingest_error(self, error: IngestError) -> None:
        """Mark what an IngestError blames: a column field or the model, the form as a whole for a quota, else the
        file; in the page's words (the fields' labels, not the API's field names)."""
        field = error.field if error.field in self.fields else None if error.field == "quota" else "file"
        self.add_error(field, self.in_labels(error.message))

    def in_labels(self, message: str) -> str:
        """`message` with the API's field names (question_column) written as this form's labels (Question column)."""

        def label(match: re.Match) -> str:
            name = match.group(0)
            return str(self[name].label) if name in self.fields else name

        return _FIELD_NAME.sub(label, message)

    @property
    def column_fields_by_model(self) -> dict[str, list[str]]:
        """Model -> the column fields its task reads, for the page's script to show only those."""
        registry = get_registry()
        return {
            name: [column_field(field) for field in input_fields(registry.get(name).task)] for name in registry.names()
        }

    @property
    def file_must_be_chosen_again(self) -> bool:
        """A browser never re-fills a file input: after any error on a submitted form, say so."""
        return self.is_bound and bool(self.errors)
