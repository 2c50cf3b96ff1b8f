"""Jobs for every task: question-answering rows read a question and a context column, token-classification
rows a text column; each task's answer shows in the results, the CSV export, the job page and the admin.

In-process tests use a registry with `qa` and `entities` models (the files are never loaded); the
end-to-end ones run on the live stack's offline worker (tests/conftest.py serves `qa` and `entities`).
"""

from __future__ import annotations

import csv
import io
import json

import pytest
import requests
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from inference.core.registry import get_registry
from jobs import export, lifecycle
from jobs.api.serializers import JobCreateSerializer
from jobs.display import answer_html, input_html, snippet_html
from jobs.ingest import COLUMN_FIELDS, IngestError, IngestLimits, input_columns
from jobs.models import Chunk, ChunkStatus, Job, JobRow, JobStatus, RowStatus
from jobs.readers import CsvReader
from tests.conftest import wait_until
from tests.jobs.factories import user

LIMITS = IngestLimits(max_rows=10, max_text_chars=40, batch_rows=2, chunk_rows=2)
QA_HEADER = "id,q,ctx,other\n"


@pytest.fixture
def task_models(settings, tmp_path):
    """A registry with a model of each kind of input: router (text), qa (question and context), entities (text)."""
    models = tmp_path / "models.yaml"
    models.write_text(
        "default: router\nmodels:\n"
        "  router: {task: router, path: x, routes: inference/routes/support.yaml}\n"
        "  qa: {task: question-answering, path: x}\n"
        "  entities: {task: token-classification, path: x}\n"
    )
    settings.INFERENCE_MODELS_FILE = str(models)
    get_registry.cache_clear()
    yield
    get_registry.cache_clear()


def qa_rows(data: str, **columns: str) -> list:
    rows = CsvReader(encoding="utf-8").rows(
        io.BytesIO(data.encode()),
        columns=columns or {"question": "q", "context": "ctx"},
        id_column="id",
        limits=LIMITS,
    )
    return list(rows)


# Which columns a task reads ------------------------------------------------------------------------


def test_text_tasks_read_text_column_with_its_default():
    assert input_columns("router", "router", {}) == {"text": "text"}
    assert input_columns("entities", "token-classification", {"text_column": "body"}) == {"text": "body"}


def test_question_answering_columns_left_out_mean_the_columns_named_like_the_fields():
    given = {"question_column": "q", "context_column": "ctx"}
    assert input_columns("qa", "question-answering", given) == {"question": "q", "context": "ctx"}
    # As text_column means "text": the page's placeholders say so, and the API takes the same rule.
    assert input_columns("qa", "question-answering", {"question_column": "q"}) == {
        "question": "q",
        "context": "context",
    }
    assert input_columns("qa", "question-answering", {}) == {"question": "question", "context": "context"}


def test_a_column_the_task_does_not_read_is_refused_not_ignored():
    with pytest.raises(IngestError) as caught:
        input_columns("qa", "question-answering", {"question_column": "q", "context_column": "c", "text_column": "t"})
    assert "reads question_column and context_column, not text_column" in caught.value.message
    with pytest.raises(IngestError) as caught:
        input_columns("router", "router", {"question_column": "q"})
    assert caught.value.message.startswith("model 'router' (task router) reads text_column, not question_column")


def test_the_api_declares_a_field_for_every_input_column():
    assert set(COLUMN_FIELDS) == {"text_column", "question_column", "context_column"}
    assert set(COLUMN_FIELDS) <= set(JobCreateSerializer().fields)


# Reading question-answering rows ---------------------------------------------------------------------


def test_question_answering_rows_keep_both_fields_and_the_question_as_text():
    rows = qa_rows(QA_HEADER + 'a,Who wrote it?,"Ada wrote it, in 1843.",x\n')
    assert rows[0].inputs == {"question": "Who wrote it?", "context": "Ada wrote it, in 1843."}
    assert (rows[0].external_id, rows[0].text, rows[0].error) == ("a", "Who wrote it?", "")


def test_an_empty_or_over_long_cell_fails_its_row_naming_the_field():
    rows = qa_rows(QA_HEADER + "a,Who?,,x\nb,  ,ctx,x\nc,Who?," + "y" * 50 + ",x\nd,Who?,fine,x\n")
    assert [r.error for r in rows] == [
        "empty context",
        "empty question",
        "context too long: 50 characters, the limit is 40",
        "",
    ]
    assert len(rows[2].inputs["context"]) == 41  # one past the limit: a retry fails the same check


def test_a_column_absent_from_the_header_names_the_field_and_the_header():
    with pytest.raises(IngestError) as caught:
        qa_rows(QA_HEADER + "a,b,c,d\n", question="q", context="passage")
    assert caught.value.message == (
        "context column 'passage' not found; the comma-separated header has: 'id', 'q', 'ctx', 'other'"
    )
    assert caught.value.field == "context_column"


# Creating jobs: lifecycle, API and the web form ---------------------------------------------------------

QA_CSV = (QA_HEADER + 'k1,Who wrote it?,"Ada wrote it, in 1843.",x\n').encode()


@pytest.mark.django_db
def test_create_job_stores_the_column_mapping(task_models):
    owner = alice()
    job = lifecycle.create_job(
        owner=owner,
        model="qa",
        upload=io.BytesIO(QA_CSV),
        filename="qa.csv",
        columns={"question_column": "q", "context_column": "ctx"},
        id_column="id",
    )
    assert job.input_columns == {"question": "q", "context": "ctx"} and job.text_column == ""
    # Read back from the database (jsonb sorts keys: context first), the task's order still holds.
    job.refresh_from_db()
    assert list(lifecycle.job_columns(job).items()) == [("question", "q"), ("context", "ctx")]
    lifecycle.run_ingest(job.pk)
    row = job.rows.get()
    assert (row.external_id, row.text, row.status) == ("k1", "Who wrote it?", RowStatus.PENDING)
    assert row.inputs == {"question": "Who wrote it?", "context": "Ada wrote it, in 1843."}
    text_job = lifecycle.create_job(
        owner=owner, model="entities", upload=io.BytesIO(b"text\nAda met Bob\n"), filename="e.csv"
    )
    assert (text_job.text_column, text_job.input_columns) == ("text", {})


@pytest.fixture
def api(settings, task_models):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    client = APIClient()
    client.force_authenticate(alice())
    return client


def api_upload(api, data: bytes, **fields: str):
    return api.post("/api/v1/jobs", {"file": SimpleUploadedFile("rows.csv", data), **fields}, format="multipart")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "key", "message"),
    [
        (  # a column field left out means the column named like it, which this file lacks
            {"model": "qa", "question_column": "q"},
            "context_column",
            "context column 'context' not found; the comma-separated header has: 'id', 'q', 'ctx', 'other'",
        ),
        (
            {"model": "qa", "text_column": "q"},
            "text_column",
            "reads question_column and context_column, not text_column",
        ),
        (
            {"model": "qa", "question_column": "q", "context_column": "ctx", "text_column": "text"},
            "text_column",
            "reads question_column and context_column, not text_column",
        ),
        (
            {"model": "qa", "question_column": "question", "context_column": "ctx"},
            "question_column",
            "question column 'question' not found; the comma-separated header has: 'id', 'q', 'ctx', 'other'",
        ),
        ({"model": "router", "context_column": "ctx"}, "context_column", "reads text_column, not context_column"),
    ],
)
def test_api_column_errors_are_400_naming_the_field(api, fields, key, message):
    response = api_upload(api, QA_CSV, **fields)
    assert response.status_code == 400, response.content
    assert message in response.json()["detail"] and message in response.json()["errors"][key][0]
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_api_creates_a_question_answering_job_and_shows_its_columns(api):
    response = api_upload(api, QA_CSV, model="qa", question_column="q", context_column="ctx", id_column="id")
    assert response.status_code == 202, response.content
    assert response.json()["input_columns"] == {"question": "q", "context": "ctx"}
    assert response.json()["text_column"] == ""


@pytest.mark.django_db
def test_web_form_takes_the_question_and_context_columns(client, task_models):
    client.force_login(alice())
    page = client.get(reverse("jobs:list")).content.decode()
    assert 'name="question_column"' in page and 'name="context_column"' in page
    assert "qa (question-answering)" in page and 'id="column-fields"' in page
    form = {"model": "qa", "question_column": "q", "context_column": "nope", "encoding": "utf-8"}
    refused = client.post(reverse("jobs:list"), {**form, "file": SimpleUploadedFile("qa.csv", QA_CSV)})
    assert refused.status_code == 400
    assert "context column &#x27;nope&#x27; not found" in refused.content.decode()
    form["context_column"] = "ctx"
    created = client.post(reverse("jobs:list"), {**form, "file": SimpleUploadedFile("qa.csv", QA_CSV)})
    assert created.status_code == 302
    assert Job.objects.get().input_columns == {"question": "q", "context": "ctx"}
    assert "question: q, context: ctx" in client.get(created.url).content.decode()


# Showing each task's answers -----------------------------------------------------------------------------

CONTEXT = "The invoice was sent by Ada Lovelace in London."
QA_OUTPUT = {"answer": "Ada Lovelace", "start": 24, "end": 36, "score": 0.42}
ENTITY_TEXT = "Ada Lovelace lives in London"
ENTITY_OUTPUT = {
    "entities": [
        {"label": "PER", "text": "Ada Lovelace", "start": 0, "end": 12, "score": 0.9},
        {"label": "LOC", "text": "London", "start": 22, "end": 28, "score": 0.8},
    ],
    "truncated": False,
}


def finished_job(owner, model: str, rows: list[dict]) -> Job:
    job = Job.objects.create(owner=owner, model=model, filename=f"{model}.csv", status=JobStatus.SUCCEEDED,
                             started_at=timezone.now(), finished_at=timezone.now(), total_rows=len(rows))  # fmt: skip
    for index, fields in enumerate(rows):
        JobRow.objects.create(job=job, index=index, status=RowStatus.DONE, attempts=1, **fields)
    Chunk.objects.create(job=job, first_index=0, end_index=len(rows), status=ChunkStatus.DONE)
    job.refresh_counts()
    return job


def exported(job: Job) -> list[dict]:
    """The job's CSV export as a client reads it."""
    response = export.csv_response(None, job.rows.all(), "x.csv")
    text = b"".join(response.streaming_content).decode()
    return list(csv.DictReader(io.StringIO(text)))


def alice():
    return get_user_model().objects.filter(username="alice").first() or user("alice")


@pytest.fixture
def qa_job(task_models):
    inputs = {"question": "Who sent it?", "context": CONTEXT}
    return finished_job(
        alice(),
        "qa",
        [{"text": inputs["question"], "inputs": inputs, "output": QA_OUTPUT, "score": 0.42, "low_confidence": True}],
    )


@pytest.fixture
def entities_job(task_models):
    return finished_job(alice(), "entities", [{"text": ENTITY_TEXT, "output": ENTITY_OUTPUT}])


@pytest.mark.django_db
def test_question_answering_export_has_the_answer_and_its_offsets(qa_job):
    (row,) = exported(qa_job)
    assert list(row) == [
        "job", "row", "index", "id", "question", "context", "status", "answer", "answer_start", "answer_end", "score",
        "low_confidence", "model_version", "reviewed", "error", "output",
    ]  # fmt: skip
    assert (row["question"], row["context"], row["answer"]) == ("Who sent it?", CONTEXT, "Ada Lovelace")
    assert CONTEXT[int(row["answer_start"]) : int(row["answer_end"])] == row["answer"]
    assert (row["score"], row["low_confidence"]) == ("0.420000", "yes")


@pytest.mark.django_db
def test_token_classification_export_lists_the_entities_readably(entities_job):
    (row,) = exported(entities_job)
    assert list(row) == [
        "job", "row", "index", "id", "text", "status", "entities", "entity_count", "truncated", "model_version", "reviewed", "error",
        "output",
    ]  # fmt: skip
    assert (row["entities"], row["entity_count"], row["truncated"]) == ("PER: Ada Lovelace; LOC: London", "2", "")
    assert json.loads(row["output"]) == ENTITY_OUTPUT


@pytest.mark.django_db
def test_an_export_mixing_layouts_falls_back_to_the_text_columns(qa_job, entities_job):
    rows = JobRow.objects.filter(job__in=[qa_job, entities_job])
    assert export.layout_for_models(export.models_of(rows)) == export.TEXT_COLUMNS
    assert export.layout_for_models(export.models_of(qa_job.rows.all())) == export.QA_COLUMNS


@pytest.mark.django_db
def test_results_json_carries_inputs_and_output(api, qa_job):
    results = api.get(f"/api/v1/jobs/{qa_job.pk}/results").json()["results"]
    assert results[0]["inputs"] == {"question": "Who sent it?", "context": CONTEXT}
    assert results[0]["output"] == QA_OUTPUT and results[0]["label"] == ""


@pytest.mark.django_db
def test_answers_are_marked_in_their_input(qa_job, entities_job):
    qa_row, entity_row = qa_job.rows.get(), entities_job.rows.get()
    assert str(answer_html(qa_row)) == 'Ada Lovelace <span class="row-muted">[24:36]</span>'
    assert '<mark title="answer, score 0.42">Ada Lovelace</mark> in London.' in str(input_html(qa_row))
    assert "<b>question</b>" in str(input_html(qa_row)) and "<mark" in str(snippet_html(qa_row))
    assert "PER</span> Ada Lovelace" in str(answer_html(entity_row))
    marked = str(input_html(entity_row))
    assert '<mark title="PER 0.9">Ada Lovelace</mark> lives in <mark title="LOC 0.8">London</mark>' in marked
    # Offsets that do not fit the text are not marked (stored JSON is not trusted blindly), and text is escaped.
    entity_row.text = "<b>x</b>"
    assert str(input_html(entity_row)) == '<div class="row-input">&lt;b&gt;x&lt;/b&gt;</div>'


@pytest.mark.django_db
def test_job_page_and_admin_show_answers(client, qa_job, entities_job):
    boss = user("boss", staff=True)
    client.force_login(boss)
    page = client.get(reverse("jobs:detail", args=[qa_job.pk])).content.decode()
    assert "Answer [start:end] in its context" in page and "[24:36]" in page
    assert "answers no labels" in page
    page = client.get(reverse("jobs:detail", args=[entities_job.pk])).content.decode()
    assert "<th>Entities</th>" in page and '<mark title="LOC 0.8">London</mark>' in page
    row = qa_job.rows.get()
    admin_page = client.get(reverse("admin:jobs_jobrow_change", args=[row.pk])).content.decode()
    assert '<mark title="answer, score 0.42">Ada Lovelace</mark>' in admin_page
    rows_page = client.get(reverse("admin:jobs_jobrow_changelist"), {"job__id__exact": qa_job.pk}).content.decode()
    assert "[24:36]" in rows_page and "this task answers no labels" in rows_page
    job_page = client.get(reverse("admin:jobs_job_change", args=[qa_job.pk])).content.decode()
    assert ">no label</a> 1" in job_page  # the label summary names the unlabelled rows, not an empty link


# End to end on the live stack ---------------------------------------------------------------------------


def live_upload(stack, data: bytes, **fields: str) -> requests.Response:
    return requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("rows.csv", data, "text/csv")},
        data=fields,
        headers=stack.headers(),
        timeout=60,
    )


def wait_for_end(stack, job_id: int) -> dict:
    def ended() -> dict | None:
        job = requests.get(f"{stack.url}/api/v1/jobs/{job_id}", headers=stack.headers(), timeout=10).json()
        return job if job["status"] in ("succeeded", "partial", "failed", "cancelled") else None

    return wait_until(ended, 120, f"job {job_id} to end")


def live_results(stack, job_id: int) -> list[dict]:
    url = f"{stack.url}/api/v1/jobs/{job_id}/results"
    return requests.get(url, params={"page_size": 1000}, headers=stack.headers(), timeout=10).json()["results"]


def live_export(stack, job_id: int) -> list[dict]:
    response = requests.get(f"{stack.url}/api/v1/jobs/{job_id}/results.csv", headers=stack.headers(), timeout=60)
    assert response.status_code == 200
    return list(csv.DictReader(io.StringIO(response.text)))


QUESTIONS = [
    ("Who sent the invoice?", "The invoice was sent by Ada Lovelace from London on Monday."),
    ("Where is the parcel?", "Your parcel is waiting at the depot in Leeds until Friday."),
    ("What broke?", "After the update the app crashed every time I opened settings."),
]


@pytest.mark.integration
def test_question_answering_job_answers_with_offsets_into_the_context(stack):
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["key", "question", "passage"])
    for i in range(60):
        question, context = QUESTIONS[i % len(QUESTIONS)]
        # Row 7: an empty context. Row 11: one of zero-width characters only, which the tokenizer drops
        # (its check runs before the batch: a row the model cannot take fails alone, not its batch).
        # Row 13: 2,000 one-word sentences, ~8,000 tokens: more than one forward pass, refused as online.
        cell = {7: "", 11: "\u200b\u200d\u200b", 13: "a. " * 2000}.get(i, f"{context} (ticket {i})")
        writer.writerow([f"k{i}", question, cell])
    response = live_upload(
        stack,
        out.getvalue().encode(),
        model="qa",
        question_column="question",
        context_column="passage",
        id_column="key",
    )
    assert response.status_code == 202, response.text
    job = wait_for_end(stack, response.json()["id"])
    # The rows with an empty or unreadable context failed alone; the others were answered.
    assert (job["status"], job["done_rows"], job["failed_rows"]) == ("partial", 57, 3), job
    results = {r["index"]: r for r in live_results(stack, job["id"])}
    assert results[7]["status"] == "failed" and results[7]["error"] == "empty context"
    assert results[11]["status"] == "failed"
    assert results[11]["error"].startswith("context has no text model 'qa' can read"), results[11]
    assert "one row may be at most 4096" in results[13]["error"], results[13]
    for index, row in results.items():
        if index in (7, 11, 13):
            continue
        context, answer = row["inputs"]["context"], row["output"]
        assert row["status"] == "done" and row["text"] == row["inputs"]["question"]
        assert context[answer["start"] : answer["end"]] == answer["answer"], row
        assert row["label"] == "" and row["score"] == pytest.approx(answer["score"])
    exported_rows = {int(r["index"]): r for r in live_export(stack, job["id"])}
    assert list(exported_rows[0])[:11] == [
        "job", "row", "index", "id", "question", "context", "status", "answer", "answer_start", "answer_end", "score",
    ]  # fmt: skip
    first = exported_rows[0]
    assert first["id"] == "k0" and first["question"] == QUESTIONS[0][0]
    assert first["context"][int(first["answer_start"]) : int(first["answer_end"])] == first["answer"]
    assert exported_rows[7]["error"] == "empty context" and exported_rows[7]["answer"] == ""


@pytest.mark.integration
def test_token_classification_job_gives_entities_that_are_slices_of_the_text(stack):
    texts = [f"Ada Lovelace met Charles Babbage in London on day {i}." for i in range(20)]
    data = ("id,text\n" + "".join(f"e{i},{text}\n" for i, text in enumerate(texts))).encode()
    response = live_upload(stack, data, model="entities", text_column="text", id_column="id")
    assert response.status_code == 202, response.text
    job = wait_for_end(stack, response.json()["id"])
    assert job["status"] == "succeeded", job
    for row in live_results(stack, job["id"]):
        assert row["inputs"] is None and row["label"] == "" and row["score"] is None
        for entity in row["output"]["entities"]:
            assert row["text"][entity["start"] : entity["end"]] == entity["text"]
    exported_rows = live_export(stack, job["id"])
    assert "entities" in exported_rows[0] and "entity_count" in exported_rows[0]
    for row in exported_rows:
        assert int(row["entity_count"]) == len(json.loads(row["output"])["entities"])


@pytest.mark.integration
def test_live_column_errors_are_400_and_create_nothing(stack):
    data = b"key,question,passage\nk1,Who?,Ada did.\n"
    before = requests.get(f"{stack.url}/api/v1/jobs", headers=stack.headers(), timeout=10).json()["count"]
    missing = live_upload(stack, data, model="qa", question_column="question")  # context_column means "context"
    assert missing.status_code == 400
    assert "context column 'context' not found" in missing.json()["detail"]
    absent = live_upload(stack, data, model="qa", question_column="question", context_column="context")
    assert absent.status_code == 400
    assert "header has: 'key', 'question', 'passage'" in absent.json()["detail"]
    wrong = live_upload(stack, data, model="qa", text_column="question", question_column="question",
                        context_column="passage")  # fmt: skip
    assert wrong.status_code == 400 and "not text_column" in wrong.json()["detail"]
    after = requests.get(f"{stack.url}/api/v1/jobs", headers=stack.headers(), timeout=10).json()["count"]
    assert after == before
