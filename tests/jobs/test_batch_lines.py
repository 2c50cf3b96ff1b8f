"""The plain parts of the Batch API and of JSON lines: the request-line and JSON-lines readers, the batch's
derived status and counts, and the JSON lines writer (the live round trips are in test_batch_api.py)."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.batches import batch_status, request_counts
from jobs.ingest import IngestError, IngestLimits
from jobs.models import Batch, Job, JobStatus
from jobs.readers import BatchRequestReader, JsonlReader

LIMITS = IngestLimits(max_rows=10, max_text_chars=50, batch_rows=2, chunk_rows=2)
EMBEDDINGS = BatchRequestReader(endpoint="/v1/embeddings", model="embedding")
ROUTER = BatchRequestReader(endpoint="/api/v1/models/router/predict", model="router")
QA = BatchRequestReader(endpoint="/api/v1/models/qa/predict", model="qa")


def lines(*items: object) -> io.BytesIO:
    return io.BytesIO("".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items).encode())


def emb(custom_id: str, text: object, **body) -> dict:
    body = {"model": "embedding", "input": text, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def read(reader, data: io.BytesIO) -> list:
    return list(reader.rows(data, columns={}, id_column="", limits=LIMITS))


def details(reader, data: io.BytesIO) -> list[dict]:
    """What validation (the pass before any row is written) lists about the file's lines."""
    with pytest.raises(IngestError) as raised:
        reader.validate(data, limits=LIMITS)
    return raised.value.details


def test_request_lines_become_rows_keyed_by_custom_id_with_request_options_kept():
    rows = read(EMBEDDINGS, lines(emb("a", "hello"), emb("b", ["one"], encoding_format="base64")))
    assert [(r.index, r.external_id, r.text, r.error, r.inputs) for r in rows] == [
        (0, "a", "hello", "", None),
        (1, "b", "one", "", {"encoding_format": "base64"}),
    ]


def test_a_body_the_endpoint_refuses_fails_only_its_line_with_the_endpoints_message():
    rows = read(EMBEDDINGS, lines(emb("a", "  "), emb("b", 42), emb("c", ["x", "y"]), emb("d", "fine")))
    assert [r.error for r in rows] == [
        "input[0] is empty",
        "`input` must be a string or a list of strings",
        "a batch line holds one input: send each text as a line of its own",
        "",
    ]


def test_every_bad_envelope_is_listed_with_its_line_and_the_batch_fails():
    found = details(
        EMBEDDINGS,
        lines(
            emb("a", "x"),
            "not json",
            emb("a", "again"),
            {**emb("c", "x"), "url": "/v1/chat/completions"},
            {**emb("d", "x"), "method": "PUT"},
            {"method": "POST", "url": "/v1/embeddings", "body": {}},
            emb("f", "x", model="other"),
            {"custom_id": "g", "method": "POST", "url": "/v1/embeddings", "body": "text"},
        ),
    )
    assert [(d["line"], d["code"]) for d in found] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
        (5, "invalid_method"),
        (6, "missing_custom_id"),
        (7, "model_mismatch"),
        (8, "invalid_body"),
    ]
    assert "also on line 1" in found[1]["message"]


def test_blank_lines_are_skipped_and_line_numbers_count_them():
    found = details(EMBEDDINGS, lines(emb("a", "x"), "", "[]"))
    assert [(d["line"], d["code"]) for d in found] == [(3, "invalid_request")]


def test_an_embeddings_batch_on_a_model_that_is_not_one_fails_each_line():
    reader = BatchRequestReader(endpoint="/v1/embeddings", model="router")
    assert {d["code"] for d in details(reader, lines(emb("a", "x", model="router")))} == {"model_not_found"}


def test_predict_lines_take_one_input_of_the_tasks_shape():
    url = "/api/v1/models/qa/predict"
    good = {"question": "who?", "context": "Ada wrote it."}
    rows = read(
        QA,
        lines(
            {"custom_id": "q1", "method": "POST", "url": url, "body": {"inputs": [good]}},
            {"custom_id": "q2", "method": "POST", "url": url, "body": {"inputs": [good, good]}},
            {"custom_id": "q3", "method": "POST", "url": url, "body": {"inputs": ["just text"]}},
        ),
    )
    assert rows[0].inputs == good and rows[0].text == "who?" and rows[0].error == ""
    assert "the limit is 1" in rows[1].error and "must be an object" in rows[2].error


def test_a_valid_file_is_counted_and_a_bad_line_met_while_writing_rows_still_fails_the_batch():
    assert EMBEDDINGS.validate(lines(emb("a", "x"), "", emb("b", "y")), limits=LIMITS) == 2
    with pytest.raises(IngestError, match="line 2: not valid JSON") as raised:
        read(EMBEDDINGS, lines(emb("a", "x"), "oops"))  # e.g. the file changed between the passes
    assert raised.value.details[0]["code"] == "invalid_json_line"


def test_too_many_requests_or_none_is_refused():
    with pytest.raises(IngestError, match="more than 10 requests"):
        ROUTER.validate(
            lines(
                *[
                    {"custom_id": str(i), "method": "POST", "url": ROUTER.endpoint, "body": {"inputs": ["x"]}}
                    for i in range(11)
                ]
            ),
            limits=LIMITS,
        )
    assert details(ROUTER, lines(""))[0]["code"] == "empty_file"


def test_at_most_a_hundred_problems_are_listed_and_the_message_counts_them_all():
    with pytest.raises(IngestError) as raised:
        EMBEDDINGS.validate(lines(*["oops"] * 150), limits=LIMITS)
    assert len(raised.value.details) == 100 and raised.value.message.startswith("150 of the file's lines")


def test_json_lines_read_fields_by_key():
    data = lines({"id": 7, "body": "hello"}, {"id": "b", "body": None}, "", {"id": "c", "body": 3.5})
    rows = list(JsonlReader().rows(data, columns={"text": "body"}, id_column="id", limits=LIMITS))
    assert [(r.external_id, r.text, r.error) for r in rows] == [
        ("7", "hello", ""),
        ("b", "", "empty text"),
        ("c", "3.5", ""),
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [(b'{"a": 1}\n[1]\n', "line 2: each line"), (b"{oops\n", "line 1: not valid JSON"), (b"\n\n", "no JSON lines")],
)
def test_a_json_lines_file_that_is_not_one_is_refused_naming_the_line(data, message):
    with pytest.raises(IngestError, match=message):
        list(JsonlReader().rows(io.BytesIO(data), columns={"text": "a"}, id_column="", limits=LIMITS))


@pytest.mark.parametrize(
    ("job_status", "finalized", "total", "expected"),
    [
        (JobStatus.INGESTING, False, 0, "validating"),
        (JobStatus.QUEUED, False, 5, "in_progress"),
        (JobStatus.RUNNING, False, 5, "in_progress"),
        (JobStatus.SUCCEEDED, False, 5, "finalizing"),
        (JobStatus.CANCELLED, False, 5, "cancelling"),
        (JobStatus.SUCCEEDED, True, 5, "completed"),
        (JobStatus.PARTIAL, True, 5, "completed"),
        (JobStatus.FAILED, True, 5, "completed"),  # every line failed: answered, in the error file
        (JobStatus.FAILED, True, 0, "failed"),  # failed validation
        (JobStatus.EXPIRED, True, 5, "expired"),
        (JobStatus.CANCELLED, True, 5, "cancelled"),
    ],
)
def test_the_batch_status_follows_the_job_and_the_files(job_status, finalized, total, expected):
    job = Job(status=job_status, total_rows=total)
    batch = Batch(job=job, expires_at=timezone.now(), finalized_at=timezone.now() if finalized else None)
    assert batch_status(batch) == expected


def test_lines_never_run_count_as_failed_once_an_expired_batch_is_final():
    job = Job(status=JobStatus.EXPIRED, total_rows=10, done_rows=4, failed_rows=1)
    batch = Batch(job=job, expires_at=timezone.now() - timedelta(seconds=1))
    assert request_counts(batch) == {"total": 10, "completed": 4, "failed": 1}
    batch.finalized_at = timezone.now()
    assert request_counts(batch) == {"total": 10, "completed": 4, "failed": 6}


def test_a_batch_whose_lines_passed_validation_is_in_progress_while_its_rows_are_written():
    batch = Batch(job=Job(status=JobStatus.INGESTING), expires_at=timezone.now())
    assert batch_status(batch) == "validating"
    batch.in_progress_at = timezone.now()
    assert batch_status(batch) == "in_progress"


def test_nul_characters_are_dropped_from_inputs_and_refused_in_custom_ids():
    (row,) = read(EMBEDDINGS, lines(emb("a", "hel\x00lo")))
    assert row.text == "hello"
    assert details(EMBEDDINGS, lines(emb("a\x00b", "x")))[0]["code"] == "invalid_custom_id"
