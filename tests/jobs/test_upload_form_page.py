"""The jobs page's upload form as the server answers it: column fields that show and use their defaults, errors
in the page's words (its labels), every field an error blames marked and linked from the summary above the form.

In-process (Django's test client), on a registry with a text model and a question-answering model whose files
are never loaded; what the page's script checks before sending is tests/browser/test_upload_form.py's.
"""

from __future__ import annotations

import re
from html import unescape

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from inference.core.registry import get_registry
from jobs.models import Job
from tests.jobs.factories import user

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def task_models(settings, tmp_path):
    models = tmp_path / "models.yaml"
    models.write_text(
        "default: router\nmodels:\n"
        "  router: {task: router, path: x, routes: inference/routes/support.yaml}\n"
        "  qa: {task: question-answering, path: x}\n"
    )
    settings.INFERENCE_MODELS_FILE = str(models)
    get_registry.cache_clear()
    yield
    get_registry.cache_clear()


@pytest.fixture
def alice(client):
    person = user("alice")
    client.force_login(person)
    return person


def post(client, data: bytes, name: str = "faq.csv", **fields: str):
    form = {"model": "qa", "encoding": "utf-8", **fields}
    return client.post(reverse("jobs:list"), {**form, "file": SimpleUploadedFile(name, data, content_type="text/csv")})


def text_of(html: str) -> str:
    """The text as read: tags dropped, entities decoded, spaces collapsed (and none before punctuation)."""
    text = re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html))).strip()
    return re.sub(r" ([:;,.])", r"\1", text)


def summary_of(html: str) -> str:
    """The error summary above the form, as read."""
    return text_of(re.search(r'<div class="form-error" role="alert">(.*?)</div>', html, re.S).group(1))


def input_tag(html: str, name: str) -> str:
    return re.search(rf'<input[^>]*name="{name}"[^>]*>', html).group(0)


def test_the_column_fields_show_their_defaults(client, alice):
    html = client.get(reverse("jobs:list")).content.decode()
    for name, default in [("text_column", "text"), ("question_column", "question"), ("context_column", "context")]:
        assert f'placeholder="{default}"' in input_tag(html, name)
        assert 'value="' not in input_tag(html, name)  # a placeholder, not a value the person would have to clear
    assert "(default: question)" in html and "(default: context)" in html


def test_blank_question_and_context_fields_read_the_default_columns(client, alice):
    answer = post(client, b"id,question,context\n1,Who wrote it?,Ada wrote it.\n")
    assert answer.status_code == 302, answer.content.decode()
    assert Job.objects.get().input_columns == {"question": "question", "context": "context"}


def test_a_named_column_wins_over_the_default(client, alice):
    answer = post(client, b"q,context\nWho?,Ada wrote it.\n", question_column="q")
    assert answer.status_code == 302, answer.content.decode()
    assert Job.objects.get().input_columns == {"question": "q", "context": "context"}


def test_a_blank_text_column_still_reads_text_and_a_text_model_gets_no_question_column(client, alice):
    answer = post(client, b"text\nwhere is my parcel\n", model="router")
    assert answer.status_code == 302, answer.content.decode()
    job = Job.objects.get()
    assert job.text_column == "text" and job.input_columns == {}


def test_an_error_names_the_fields_by_their_labels_and_marks_the_field_it_blames(client, alice):
    answer = post(client, b"text,question,context\nx,Who?,Ada.\n", text_column="text")
    html = answer.content.decode()
    assert answer.status_code == 400
    message = "reads Question column and Context column, not Text column; leave it out"
    assert message in summary_of(html)
    # The message under the field and in the summary; the API's field names in neither.
    errors = re.search(r'<ul class="errorlist" id="id_text_column_error">(.*?)</ul>', html, re.S).group(1)
    assert message in text_of(errors)
    assert "_column" not in summary_of(html) + text_of(errors)
    tag = input_tag(html, "text_column")
    assert 'aria-invalid="true"' in tag and 'aria-describedby="id_text_column_helptext id_text_column_error"' in tag
    assert re.search(r'<div class="field has-error" data-field="text_column">', html)
    # The fields it does not blame are not marked.
    assert "aria-invalid" not in input_tag(html, "question_column") + input_tag(html, "context_column")
    assert not Job.objects.exists()


def test_the_summary_links_to_each_field_in_error_and_asks_for_the_file_again(client, alice):
    answer = post(client, b"q,passage\nWho?,Ada.\n", question_column="q", context_column="ctx")
    html = answer.content.decode()
    assert answer.status_code == 400
    assert re.search(r'<a href="#id_context_column">Context column</a>: context column &#x27;ctx&#x27; not found', html)
    summary = summary_of(html)
    assert summary.startswith("The job was not created. Context column: context column 'ctx' not found")
    assert "the comma-separated header has: 'q', 'passage'" in summary
    assert "Fix what is marked below, then choose the CSV file again" in summary
    assert 'aria-invalid="true"' in input_tag(html, "context_column")
    assert 'value="q"' in input_tag(html, "question_column") and 'value="ctx"' in input_tag(html, "context_column")


def test_a_missing_file_is_linked_from_the_summary(client, alice):
    answer = client.post(reverse("jobs:list"), {"model": "qa", "encoding": "utf-8"})
    html = answer.content.decode()
    assert answer.status_code == 400
    assert '<a href="#id_file">CSV or JSON lines file</a>: This field is required.' in html
    assert 'aria-invalid="true"' in input_tag(html, "file")
