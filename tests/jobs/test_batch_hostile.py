"""The OpenAI Files and Batch APIs under a hostile tenant: odd bytes in ids and bodies, deep JSON, races on
quotas and throttles, files deleted mid-validation, and what a client sees for each (a clear 4xx in
OpenAI's shape, never a 500; a batch that ends with a message that says what happened).

Live tests run against the session's stack (tests/conftest.py); a few check one component in-process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.message
import io
import json
import os
import signal
import tracemalloc

import pytest
import requests
from openai import OpenAI

from tests.conftest import JOBS_ENV, wait_until

FINAL = {"completed", "failed", "expired", "cancelled"}
ROUTER = "/api/v1/models/router/predict"


def embedding_line(custom_id: str, text: str) -> dict:
    body = {"model": "embedding", "input": text}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def router_line(custom_id: str, text: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": ROUTER, "body": {"inputs": [text]}}


def jsonl(lines: list[object]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key=stack.token, max_retries=0)


@pytest.fixture
def other_client(stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key=stack.other_token, max_retries=0)


def upload(stack, data: bytes, name: str = "requests.jsonl", token: str | None = None) -> requests.Response:
    headers = {"Authorization": f"Token {token or stack.token}"}
    return requests.post(
        f"{stack.url}/v1/files", headers=headers, files={"file": (name, data)}, data={"purpose": "batch"}, timeout=60
    )


def create_batch(stack, body: str | dict, token: str | None = None) -> requests.Response:
    headers = {"Authorization": f"Token {token or stack.token}", "Content-Type": "application/json"}
    data = body if isinstance(body, str) else json.dumps(body)
    return requests.post(f"{stack.url}/v1/batches", headers=headers, data=data.encode(), timeout=120)


def batch_body(file_id: str, endpoint: str = "/v1/embeddings", **extra) -> dict:
    return {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra}


def wait_final(client: OpenAI, batch_id: str, timeout_s: float = 180):
    return wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in FINAL and b, timeout_s, f"batch {batch_id} to end"
    )


def is_openai_error(response: requests.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return {"message", "type", "param", "code"} <= set(error)


def batches_of(django_db_blocker, username: str) -> int:
    from jobs.models import Batch

    with django_db_blocker.unblock():
        return Batch.objects.filter(job__owner__username=username).count()


# --- NUL and lone surrogates: a clear 4xx, never a 500 ----------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/v1/files?after=%00"),
        ("get", "/v1/files?purpose=%00"),
        ("get", "/v1/batches?after=%00"),
        ("get", "/v1/files/file-%00"),
        ("get", "/v1/files/file-%00/content"),
        ("delete", "/v1/files/file-%00"),
        ("get", "/v1/batches/batch_%00"),
        ("post", "/v1/batches/batch_%00/cancel"),
    ],
)
def test_a_nul_in_an_id_or_a_list_parameter_is_a_4xx(stack, method, path):
    response = requests.request(method, stack.url + path, headers=stack.headers(), timeout=30)
    assert response.status_code in (400, 404), (response.status_code, response.text[:300])
    assert is_openai_error(response)


@pytest.mark.integration
@pytest.mark.parametrize(
    "field",
    [
        '"input_file_id": "file-\\u0000"',
        '"input_file_id": "\\ud800"',
        '"metadata": {"team": "a\\u0000b"}',
        '"metadata": {"a\\u0000b": "team"}',
        '"metadata": {"team": "\\ud800"}',
    ],
)
def test_a_nul_or_lone_surrogate_in_a_batch_field_is_a_400(stack, field):
    file_id = upload(stack, jsonl([embedding_line("a", "x")])).json()["id"]
    body = json.dumps(batch_body(file_id))[:-1]
    if field.startswith('"input_file_id"'):
        body = body.replace(f'"input_file_id": "{file_id}"', field) + "}"
    else:
        body += ", " + field + "}"
    response = create_batch(stack, body)
    assert response.status_code in (400, 404), (response.status_code, response.text[:300])
    assert is_openai_error(response)


@pytest.mark.integration
@pytest.mark.parametrize(
    "line",
    [
        json.dumps(embedding_line("a\x00b", "hello")),  # NUL in custom_id
        json.dumps(embedding_line("a", "hel\x00lo")),  # NUL in the input (the synchronous call takes it)
        json.dumps(embedding_line("a", "x")).replace('"a"', '"a\\ud800"', 1),  # lone surrogate in custom_id
        json.dumps(embedding_line("a", "hello")).replace("hello", "x\\ud800"),  # lone surrogate in the input
        json.dumps({**embedding_line("a", "x"), "body": {"model": "embedding", "input": "x", "k\x00": 1}}),
        json.dumps({**embedding_line("a", "x"), "body": {"model": "embedding", "input": "x", "k": 1}}).replace(
            '"k"', '"k\\ud800"'
        ),
    ],
    ids=["nul-custom-id", "nul-input", "surrogate-custom-id", "surrogate-input", "nul-body-key", "surrogate-body-key"],
)
def test_a_line_with_a_nul_or_lone_surrogate_is_validated_not_a_500(stack, client, django_db_blocker, line):
    file_id = upload(stack, jsonl([line, embedding_line("ok", "fine")])).json()["id"]
    before = batches_of(django_db_blocker, "tester")
    response = create_batch(stack, batch_body(file_id))
    assert response.status_code == 200, (response.status_code, response.text[:300])
    assert batches_of(django_db_blocker, "tester") == before + 1
    done = wait_final(client, response.json()["id"])
    if done.status == "failed":  # refused at validation: the line is named
        assert done.errors.data[0].line == 1, done.errors
    else:  # or run, each line answered in one of the files
        assert done.status == "completed" and done.request_counts.total == 2


# --- deep JSON ---------------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_deeply_nested_json_body_is_a_400(stack):
    response = create_batch(stack, "[" * 50_000 + "]" * 50_000)
    assert response.status_code == 400, (response.status_code, response.text[:300])
    assert is_openai_error(response)


@pytest.mark.integration
@pytest.mark.parametrize("depth", [1_500, 5_000], ids=["read-in-the-request", "read-by-the-worker"])
def test_a_deeply_nested_line_fails_validation_naming_its_line(stack, client, depth):
    deep = "[" * depth + "]" * depth  # 3 KB or 10 KB: either side of the stack's JOBS_INLINE_INGEST_BYTES (4 KB)
    file_id = upload(stack, jsonl([embedding_line("a", "x"), deep])).json()["id"]
    response = create_batch(stack, batch_body(file_id))
    assert response.status_code == 200, (response.status_code, response.text[:300])
    failed = wait_final(client, response.json()["id"])
    assert failed.status == "failed"
    assert [(error.line, error.code) for error in failed.errors.data] == [(2, "invalid_json_line")]


@pytest.mark.integration
@pytest.mark.parametrize(
    "data",
    [
        b'{"text": "ok"}\n' + b"[" * 5_000 + b"]" * 5_000 + b"\n",
        b'{"text": "ok"}\n{"text": ' + b"[" * 5_000 + b"]" * 5_000 + b"}\n",
    ],
    ids=["deep-line", "deep-value"],
)
def test_a_json_lines_job_with_a_deeply_nested_line_is_a_400_naming_it(stack, data):
    response = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("rows.jsonl", data)},
        data={"model": "router"},
        headers=stack.headers(),
        timeout=60,
    )
    assert response.status_code in (202, 400), (response.status_code, response.text[:300])
    if response.status_code == 400:
        assert "line 2" in response.json()["detail"]


@pytest.mark.integration
@pytest.mark.parametrize("id_column", ["", "key"])
def test_a_json_lines_job_with_a_lone_surrogate_is_not_a_500(stack, id_column):
    row = '{"key": "k\\ud800", "text": "fine"}' if id_column else '{"text": "bad \\ud800 text"}'
    response = requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("rows.jsonl", (row + '\n{"key": "k2", "text": "ok"}\n').encode())},
        data={"model": "router", "id_column": id_column},
        headers=stack.headers(),
        timeout=60,
    )
    assert response.status_code in (202, 400), (response.status_code, response.text[:300])


# --- bodies and files ---------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_file_over_the_body_limit_gets_an_openai_413(stack):
    response = upload(stack, b"x" * 5_000_000)  # past DATA_UPLOAD_MAX_MEMORY_SIZE (4 MiB)
    assert response.status_code == 413
    assert is_openai_error(response), response.text[:300]


def test_the_body_guard_lets_a_files_upload_reach_the_upload_limit(settings):
    """POST /v1/files takes files up to JOBS_MAX_UPLOAD_BYTES (docs/api.md), as POST /api/v1/jobs does: the
    body guard must not refuse it at DATA_UPLOAD_MAX_MEMORY_SIZE (4 MiB)."""
    from platform_.bodies import BodyGuard

    settings.JOBS_MAX_UPLOAD_BYTES = 256 * 1024 * 1024
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4 * 1024 * 1024
    reached: list[bool] = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        reached.append(True)

    class Auth:
        async def user_for_token(self, key, address):
            return object()

        async def session_user(self, request):
            raise AssertionError("a token was sent")

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/files",
        "query_string": b"",
        "headers": [
            (b"content-length", str(10 * 1024 * 1024).encode()),
            (b"content-type", b"multipart/form-data; boundary=x"),
            (b"authorization", b"Token a-valid-token"),
        ],
    }
    asyncio.run(BodyGuard(app, Auth())(scope, receive, send))
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert reached and not statuses, f"the guard answered {statuses} for a 10 MiB file (limit 256 MiB)"


@pytest.mark.integration
def test_too_many_multipart_fields_is_an_openai_400(stack):
    fields = [(f"x{i}", "1") for i in range(1_100)] + [("purpose", "batch")]
    response = requests.post(
        f"{stack.url}/v1/files",
        headers=stack.headers(),
        files={"file": ("r.jsonl", b"{}\n")},
        data=fields,
        timeout=60,
    )
    assert response.status_code == 400 and is_openai_error(response), response.text[:200]


@pytest.mark.integration
@pytest.mark.parametrize("filename", ['a"b.jsonl', "\u540d\u524d.jsonl"])
def test_the_content_download_names_the_file_as_uploaded(stack, filename):
    quoted = filename.replace('"', '\\"').encode()
    body = (
        b'--BND\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--BND\r\nContent-Disposition: form-data; name="file"; filename="' + quoted + b'"\r\n\r\n{}\n\r\n--BND--\r\n'
    )
    headers = stack.headers(**{"Content-Type": "multipart/form-data; boundary=BND"})
    uploaded = requests.post(f"{stack.url}/v1/files", headers=headers, data=body, timeout=30).json()
    assert uploaded["filename"] == filename
    content = requests.get(f"{stack.url}/v1/files/{uploaded['id']}/content", headers=stack.headers(), timeout=30)
    disposition = content.headers["Content-Disposition"]
    assert disposition.startswith("attachment"), disposition
    message = email.message.EmailMessage()
    message["Content-Disposition"] = disposition
    assert message.get_filename() == filename, disposition


@pytest.mark.integration
def test_an_unknown_parameter_error_does_not_echo_a_megabyte(stack):
    file_id = upload(stack, jsonl([embedding_line("a", "x")])).json()["id"]
    response = create_batch(stack, batch_body(file_id, **{"x" * 1_000_000: 1}))
    assert response.status_code == 400 and is_openai_error(response)
    assert len(response.content) < 10_000, f"{len(response.content)} bytes of error"


@pytest.mark.integration
def test_an_expired_file_cannot_start_a_batch(stack, django_db_blocker):
    from django.utils import timezone

    from jobs.models import StoredFile

    file_id = upload(stack, jsonl([embedding_line("a", "x")])).json()["id"]
    with django_db_blocker.unblock():
        StoredFile.objects.filter(public_id=file_id).update(expires_at=timezone.now())
    assert requests.get(f"{stack.url}/v1/files/{file_id}", headers=stack.headers(), timeout=30).status_code == 404
    response = create_batch(stack, batch_body(file_id))
    assert response.status_code == 404 and is_openai_error(response), response.text[:200]


@pytest.mark.integration
def test_a_file_deleted_while_its_batch_validates_fails_saying_so(stack, client):
    # Over JOBS_INLINE_INGEST_BYTES (64 KiB): validated by the offline worker, after the answer.
    data = jsonl([router_line(f"r{i}", f"text number {i} " + "x" * 100) for i in range(1_200)])
    file_id = upload(stack, data).json()["id"]
    # The offline worker held still, so the file is deleted before it is read (it reads 1,200 lines in ms).
    os.killpg(stack.offline.pid, signal.SIGSTOP)
    try:
        batch = create_batch(stack, batch_body(file_id, ROUTER)).json()
        assert batch["status"] == "validating"
        deleted = requests.delete(f"{stack.url}/v1/files/{file_id}", headers=stack.headers(), timeout=30)
        assert deleted.status_code == 200
    finally:
        os.killpg(stack.offline.pid, signal.SIGCONT)
    failed = wait_final(client, batch["id"])
    assert failed.status == "failed"
    message = " ".join(error.message for error in failed.errors.data)
    assert "deleted" in message, failed.errors  # not "the file is empty": it had 1,200 lines


# --- cancel ------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_cancelling_a_batch_that_is_cancelling_is_not_a_409(stack, client):
    data = jsonl([router_line(f"c{i}", f"text number {i}") for i in range(600)])
    file_id = upload(stack, data).json()["id"]
    batch = create_batch(stack, batch_body(file_id, ROUTER)).json()
    url = f"{stack.url}/v1/batches/{batch['id']}/cancel"
    first = requests.post(url, headers=stack.headers(), timeout=30)
    assert first.status_code == 200
    second = requests.post(url, headers=stack.headers(), timeout=30)
    # docs/api.md: "cancelling an ended batch is a 409"; one still cancelling has not ended.
    if second.status_code == 409:
        assert "it is cancelling" not in second.json()["error"]["message"], second.text
    else:
        assert second.status_code == 200 and second.json()["status"] in ("cancelling", "cancelled")
    assert wait_final(client, batch["id"]).status == "cancelled"


# --- quotas and throttles under concurrency -----------------------------------------------------------


@pytest.mark.integration
def test_the_files_quota_holds_under_concurrent_uploads(stack, django_db_blocker):
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from jobs import files
    from jobs.models import StoredFile

    limit = settings.JOBS_MAX_FILES_PER_USER
    with django_db_blocker.unblock():
        owner = get_user_model().objects.get(username="tester")
        kept = StoredFile.objects.filter(owner=owner, purpose="batch", job__isnull=True)
        kept.delete()
        for _ in range(limit - 1):
            StoredFile.objects.create(
                public_id=files.new_public_id("file-"), owner=owner, purpose="batch", filename="x"
            )
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: upload(stack, jsonl([embedding_line("a", "x")])).status_code, range(8)))
        with django_db_blocker.unblock():
            count = kept.count()
        assert count <= limit, f"{count} files kept (limit {limit}); uploads answered {codes}"
    finally:
        with django_db_blocker.unblock():
            kept.delete()


@pytest.mark.integration
def test_the_create_throttle_holds_under_concurrent_requests(stack, django_db_blocker):
    """JOBS_CREATE_RATE (300/min on the test stack) counts batch creations; 330 sent three at a time must
    not pass 300 (before creations were counted atomically, 66 of 70 passed a 60/min limit). As a user of
    its own, so that the other tests' users keep their allowance."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    with django_db_blocker.unblock():
        user, _ = get_user_model().objects.get_or_create(username="throttle-prober")
        token = Token.objects.get_or_create(user=user)[0].key

    def create(_):
        response = create_batch(stack, batch_body("file-nope"), token=token)
        return response.json()["error"]["code"]

    limit = int(JOBS_ENV["JOBS_CREATE_RATE"].split("/")[0])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        codes = list(pool.map(create, range(limit + 30)))
    admitted = sum(code != "throttled" for code in codes)
    # The sliding minute is estimated from two fixed windows (the previous one's count weighted by how much
    # of it still overlaps, as if its requests were spread evenly), so a burst across a window's edge may
    # get a few past the rate (301 of 330 seen in CI); the race it replaced let nearly all of them through.
    assert "throttled" in codes and admitted <= limit * 1.05, (
        f"{admitted} of {limit + 30} passed a {limit}/min throttle"
    )


# --- memory --------------------------------------------------------------------------------------


def test_one_json_line_cannot_take_many_times_its_size_in_memory():
    """The start of a JSON lines upload is read in the web request: a line of a million empty objects
    (3 MB) must not cost ~80 MB there (a 256 MiB upload, JOBS_MAX_UPLOAD_BYTES, would cost ~7 GB).
    Refusing an over-long line is as good as reading it cheaply."""
    from jobs.ingest import IngestError
    from jobs.lifecycle import ingest_limits
    from jobs.readers import JsonlReader

    line = b'{"text": [' + b",".join([b"{}"] * 1_000_000) + b"]}\n"
    tracemalloc.start()
    try:
        JsonlReader().check_start(io.BytesIO(line), columns={"text": "text"}, id_column="", limits=ingest_limits())
    except IngestError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 8 * len(line), f"peak {peak / 1e6:.0f} MB for a {len(line) / 1e6:.0f} MB line"


# --- what held up (regression) -----------------------------------------------------------------------


@pytest.mark.integration
def test_another_user_cannot_reach_a_batchs_job_or_output_through_any_door(stack, client, other_client):
    file_id = upload(stack, jsonl([router_line("a", "hello")])).json()["id"]
    batch = wait_final(client, create_batch(stack, batch_body(file_id, ROUTER)).json()["id"])
    assert batch.status == "completed" and batch.output_file_id
    other = {"Authorization": f"Token {stack.other_token}"}
    job = f"{stack.url}/api/v1/jobs/{batch.job_id}"
    for method, url in [
        ("get", job),
        ("get", job + "/results.jsonl"),
        ("get", job + "/results.csv"),
        ("post", job + "/cancel"),
        ("get", f"{stack.url}/v1/files/{batch.output_file_id}/content"),
        ("delete", f"{stack.url}/v1/files/{batch.output_file_id}"),
    ]:
        assert requests.request(method, url, headers=other, timeout=30).status_code == 404, (method, url)
    listed = requests.get(f"{stack.url}/v1/batches?after={batch.id}", headers=other, timeout=30)
    assert listed.status_code == 400 and is_openai_error(listed)
    assert client.files.content(batch.output_file_id).text  # still there for its owner


@pytest.mark.integration
@pytest.mark.parametrize("query", ["limit=0", "limit=101", "limit=abc", "limit=1.5", "after=batch_nope"])
def test_bogus_list_parameters_are_openai_400s(stack, query):
    response = requests.get(f"{stack.url}/v1/batches?{query}", headers=stack.headers(), timeout=30)
    assert response.status_code == 400 and is_openai_error(response)
