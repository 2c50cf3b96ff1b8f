"""The OpenAI Files and Batch APIs (jobs/api/openai_batches.py) through the official `openai` client against the
live stack: embeddings and router batches end to end, validation failures naming their lines, cancel,
expiry, owner-only access, callbacks, and JSON lines on the native jobs API.

Batches run as the stack's jobs do (one offline worker, 50-row chunks); what is asserted is what a
client sees: statuses, counts, and the output and error files' lines, never seconds.
"""

from __future__ import annotations

import base64
import json
import struct

import openai
import pytest
import requests
from openai import OpenAI

from tests.conftest import wait_until
from tests.jobs.test_callbacks import receiver, verify  # noqa: F401  (a fixture, used by name)

pytestmark = pytest.mark.integration

FINAL = {"completed", "failed", "expired", "cancelled"}
TEXTS = ["how do I reset my password", "my parcel never arrived", "I was charged twice for my subscription"]


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key=stack.token, max_retries=0)


@pytest.fixture
def other_client(stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key=stack.other_token, max_retries=0)


def jsonl(lines: list[object]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def embedding_line(custom_id: str, text: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "embedding", "input": text, **body},
    }


def router_line(custom_id: str, text: str) -> dict:
    url = "/api/v1/models/router/predict"
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"inputs": [text]}}


def submit(client: OpenAI, lines: list[object], endpoint: str = "/v1/embeddings", **extra):
    uploaded = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **extra)


def wait_status(client: OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 120):
    return wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
        timeout_s,
        f"batch {batch_id} to be one of {sorted(statuses)}",
    )


def file_lines(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


# --- end to end ----------------------------------------------------------------------------------


def test_an_embeddings_batch_answers_each_line_as_v1_embeddings_does(client):
    lines = [embedding_line(f"req-{i}", text) for i, text in enumerate(TEXTS)]
    lines.append(embedding_line("as-base64", TEXTS[0], encoding_format="base64"))
    lines.append(embedding_line("empty", "   "))
    batch = submit(client, lines, metadata={"team": "support"})
    assert batch.status in ("validating", "in_progress") and batch.endpoint == "/v1/embeddings"
    assert batch.metadata == {"team": "support"} and batch.completion_window == "24h"

    done = wait_status(client, batch.id, FINAL)
    assert done.status == "completed", done
    assert done.request_counts.total == 5 and done.request_counts.completed == 4 and done.request_counts.failed == 1
    assert done.completed_at and done.in_progress_at and done.finalizing_at and done.created_at <= done.completed_at

    output = {line["custom_id"]: line for line in file_lines(client, done.output_file_id)}
    assert list(output) == ["req-0", "req-1", "req-2", "as-base64"]  # the file's order
    synchronous = client.embeddings.create(model="embedding", input=TEXTS, encoding_format="float")
    for i, text in enumerate(TEXTS):
        line = output[f"req-{i}"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "list" and body["model"] == "embedding"
        assert body["model_version"] == synchronous.model_extra["model_version"]
        assert [item["index"] for item in body["data"]] == [0]
        assert close(body["data"][0]["embedding"], synchronous.data[i].embedding)
        alone = client.embeddings.create(model="embedding", input=text, encoding_format="float")
        assert body["usage"] == {"prompt_tokens": alone.usage.prompt_tokens, "total_tokens": alone.usage.total_tokens}
    packed = base64.b64decode(output["as-base64"]["response"]["body"]["data"][0]["embedding"])
    assert close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), synchronous.data[0].embedding)

    errors = file_lines(client, done.error_file_id)
    assert [line["custom_id"] for line in errors] == ["empty"]
    failed = errors[0]["response"]
    assert failed["status_code"] == 400
    assert (
        set(failed["body"]["error"]) == {"message", "type", "param", "code"}
        and "empty" in failed["body"]["error"]["message"]
    )


def test_a_router_batch_answers_each_line_as_predict_does(stack, client):
    lines = [router_line(f"r{i}", text) for i, text in enumerate(TEXTS)]
    batch = submit(client, lines, endpoint="/api/v1/models/router/predict")
    done = wait_status(client, batch.id, FINAL)
    assert done.status == "completed" and done.error_file_id is None and done.model == "router"
    output = file_lines(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == ["r0", "r1", "r2"]
    for line, text in zip(output, TEXTS, strict=True):
        sync = stack.predict("router", [text]).json()
        body = line["response"]["body"]
        assert body["model"] == "router" and body["outputs"][0]["label"] == sync["outputs"][0]["label"]
        assert body["model_version"] == sync["model_version"]  # the version that answered, as predict says
        assert body["outputs"][0]["score"] == pytest.approx(sync["outputs"][0]["score"], abs=1e-5)


def test_the_batch_is_a_job_on_the_jobs_api_with_its_batch_id(stack, client):
    batch = submit(client, [router_line("only", TEXTS[0])], endpoint="/api/v1/models/router/predict")
    done = wait_status(client, batch.id, FINAL)
    job = requests.get(f"{stack.url}/api/v1/jobs/{done.job_id}", headers=stack.headers(), timeout=10).json()
    assert job["batch_id"] == batch.id and job["file_format"] == "batch" and job["done_rows"] == 1


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_line", "code", "param"),
    [
        (embedding_line("a", "again"), "duplicate_custom_id", "custom_id"),
        ("{this is not json", "invalid_json_line", None),
        ({**embedding_line("c", "x"), "url": "/v1/chat/completions"}, "invalid_url", "url"),
        (embedding_line("d", "x", model="no-such-model"), "model_mismatch", "body.model"),
        ({"custom_id": "e", "method": "GET", "url": "/v1/embeddings", "body": {}}, "invalid_method", "method"),
    ],
)
def test_a_bad_line_fails_validation_naming_its_line(client, bad_line, code, param):
    lines = [embedding_line("a", TEXTS[0]), embedding_line("b", TEXTS[1]), bad_line]
    batch = submit(client, lines)
    failed = wait_status(client, batch.id, FINAL)
    assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
    assert failed.request_counts.total == 0
    (error,) = failed.errors.data
    assert error.line == 3 and error.code == code and error.param == param and error.message


def test_an_unknown_model_on_the_first_line_fails_validation(client):
    batch = submit(client, [embedding_line("a", "x", model="nope"), embedding_line("b", "y", model="nope")])
    failed = wait_status(client, batch.id, FINAL)
    assert failed.status == "failed"
    assert [(e.line, e.code) for e in failed.errors.data] == [(1, "model_not_found"), (2, "model_not_found")]


def test_refusals_at_creation_are_openai_errors(client):
    uploaded = client.files.create(file=("r.jsonl", jsonl([embedding_line("a", "x")])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("r.jsonl", b"{}\n"), purpose="fine-tune")


# --- files ---------------------------------------------------------------------------------------


def test_files_round_trip_list_and_delete(client):
    data = jsonl([embedding_line("a", "x"), embedding_line("b", "y")])
    uploaded = client.files.create(file=("mine.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data) and uploaded.filename == "mine.jsonl" and uploaded.purpose == "batch"
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == data
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_another_users_file_and_batch_are_404(client, other_client):
    batch = submit(client, [embedding_line("a", "x")])
    with pytest.raises(openai.NotFoundError):
        other_client.files.retrieve(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        other_client.files.content(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        other_client.files.delete(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        other_client.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other_client.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        other_client.batches.create(
            input_file_id=batch.input_file_id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert batch.id not in [b.id for b in other_client.batches.list()]
    done = wait_status(client, batch.id, FINAL)
    with pytest.raises(openai.NotFoundError):
        other_client.files.content(done.output_file_id)


def test_batches_list_pages_with_after_and_limit(client):
    ids = [submit(client, [router_line("a", "x")], endpoint="/api/v1/models/router/predict").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == [ids[2], ids[1]] and first.has_more
    second = client.batches.list(limit=2, after=ids[1])
    assert second.data[0].id == ids[0]


# --- cancel and expiry ---------------------------------------------------------------------------


def _big_router_batch(client: OpenAI, rows: int = 1500):
    lines = [router_line(f"big-{i}", f"{TEXTS[i % 3]} (case {i})") for i in range(rows)]
    batch = submit(client, lines, endpoint="/api/v1/models/router/predict")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 50, 120, "the batch's first rows")
    return batch


def _check_kept_lines(client: OpenAI, batch, code: str) -> None:
    counts = batch.request_counts
    assert counts.completed >= 50 and counts.completed + counts.failed == counts.total == 1500
    output = file_lines(client, batch.output_file_id)
    errors = file_lines(client, batch.error_file_id)
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert {line["error"]["code"] for line in errors} == {code}
    assert sorted(line["custom_id"] for line in output + errors) == sorted(f"big-{i}" for i in range(1500))


def test_cancel_stops_the_batch_and_keeps_the_lines_done(client):
    batch = _big_router_batch(client)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    cancelled = wait_status(client, batch.id, FINAL)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    _check_kept_lines(client, cancelled, "batch_cancelled")
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_past_its_window_expires_and_keeps_the_lines_done(client, django_db_blocker):
    from django.utils import timezone

    from jobs.models import Batch

    batch = _big_router_batch(client)
    with django_db_blocker.unblock():  # the window, shortened for this batch: it ends now
        Batch.objects.filter(public_id=batch.id).update(expires_at=timezone.now())
    expired = wait_status(client, batch.id, FINAL)
    assert expired.status == "expired" and expired.expired_at
    _check_kept_lines(client, expired, "batch_expired")


# --- callbacks -----------------------------------------------------------------------------------


def test_a_batch_calls_back_batch_completed_once_its_files_are_written(stack, client, receiver):  # noqa: F811
    secret = requests.post(f"{stack.url}/api/v1/callback-secret", headers=stack.headers(), timeout=10).json()
    hook = receiver(200)
    batch = submit(client, [embedding_line("a", "x")], extra_body={"callback_url": hook.url})
    wait_until(lambda: hook.got, 60, "the batch's callback")
    got = hook.got[0]
    assert verify(secret["secret"], got.headers, got.body)
    body = json.loads(got.body)
    assert body["event"] == "batch.completed" and body["batch"]["id"] == batch.id
    assert body["batch"]["output_file_id"] and body["batch"]["status"] == "completed"


# --- JSON lines on the native jobs API -----------------------------------------------------------


def test_jobs_take_json_lines_and_export_them(stack):
    data = jsonl([{"key": f"k{i}", "body": text} for i, text in enumerate(TEXTS)] + [{"key": "k3", "body": None}])
    created = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("rows.jsonl", data, "application/jsonl")},
        data={"text_column": "body", "id_column": "key", "model": "router"},
        headers=stack.headers(),
        timeout=30,
    )
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    assert created.json()["file_format"] == "jsonl"
    job = wait_until(
        lambda: (
            (j := requests.get(f"{stack.url}/api/v1/jobs/{job_id}", headers=stack.headers(), timeout=10).json())[
                "status"
            ]
            in ("succeeded", "partial", "failed")
            and j
        ),
        60,
        "the JSON lines job",
    )
    assert job["done_rows"] == 3 and job["failed_rows"] == 1
    export = requests.get(f"{stack.url}/api/v1/jobs/{job_id}/results.jsonl", headers=stack.headers(), timeout=30)
    assert export.headers["Content-Type"].startswith("application/jsonl")
    rows = [json.loads(line) for line in export.text.splitlines()]
    assert [row["external_id"] for row in rows] == ["k0", "k1", "k2", "k3"]
    assert rows[0]["output"]["label"] and rows[3]["status"] == "failed" and rows[3]["error"] == "empty text"


def test_a_json_lines_file_with_a_bad_line_is_a_400_naming_it(stack):
    data = b'{"text": "fine"}\n[1, 2]\n'
    response = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("rows.jsonl", data)},
        data={"model": "router"},
        headers=stack.headers(),
        timeout=30,
    )
    assert response.status_code == 400 and "line 2" in response.json()["detail"]
