"""Offline jobs end to end: upload over HTTP, the offline Celery worker, the database as record of truth.

Limits for these tests (tests/conftest.py JOBS_ENV): 50-row chunks, 100-row batches, stall after 3 s,
reconciler every 1 s, at most 5000 rows and 300 kB per file.
"""

from __future__ import annotations

import csv
import http.client
import io
import json
import os
import signal

import pytest
import requests

from tests.conftest import wait_until

pytestmark = pytest.mark.integration

SHORT_TEXTS = [
    "where is my parcel {i}",
    "I was charged twice on invoice {i}, refund please",
    "app crash number {i}",
    "reset password for user {i}",
    "price for {i} seats",
]


def make_csv(rows: int, *, empty_every: int = 0, sep: str = ",") -> bytes:
    out = io.StringIO()
    writer = csv.writer(out, delimiter=sep)
    writer.writerow(["key", "text"])
    for i in range(rows):
        text = "" if empty_every and i % empty_every == 0 else SHORT_TEXTS[i % len(SHORT_TEXTS)].format(i=i)
        writer.writerow([f"k{i}", text])
    return out.getvalue().encode()


def upload(stack, data: bytes, token: str | None = None, **fields) -> requests.Response:
    form = {"text_column": "text", "id_column": "key", "model": "router", **fields}
    return requests.post(
        f"{stack.url}/api/v1/jobs",
        files={"file": ("rows.csv", data, "text/csv")},
        data=form,
        headers={"Authorization": f"Token {token or stack.token}"},
        timeout=60,
    )


def get_job(stack, job_id: int, token: str | None = None) -> dict:
    response = requests.get(
        f"{stack.url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Token {token or stack.token}"}, timeout=10
    )
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_end(stack, job_id: int, timeout_s: float = 120) -> dict:
    ended = {"succeeded", "partial", "failed", "cancelled"}
    return wait_until(
        lambda: (job := get_job(stack, job_id))["status"] in ended and job, timeout_s, f"job {job_id} to end"
    )


def export_rows(stack, job_id: int) -> list[dict]:
    response = requests.get(f"{stack.url}/api/v1/jobs/{job_id}/results.csv", headers=stack.headers(), timeout=60)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/csv")
    return list(csv.DictReader(io.StringIO(response.text)))


def assert_each_row_once(rows: list[dict], total: int) -> None:
    indexes = [int(r["index"]) for r in rows]
    assert sorted(indexes) == list(range(total)), "every input row appears exactly once in the export"


def test_upload_runs_to_completion_with_every_row_exactly_once(stack):
    response = upload(stack, make_csv(300, empty_every=100))
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] == "ingesting" and job["upload_bytes"] > 0  # the rows are read by a worker
    done = wait_for_end(stack, job["id"])
    assert done["total_rows"] == 300 and done["ingested_rows"] == 300 and done["ingest_progress"] == 1.0
    assert done["status"] == "partial"  # three empty texts failed, the job still ran
    assert (done["done_rows"], done["failed_rows"]) == (297, 3)
    assert done["rows_per_s"] > 0 and done["progress"] == 1.0
    rows = export_rows(stack, job["id"])
    assert_each_row_once(rows, 300)
    by_index = {int(r["index"]): r for r in rows}
    assert by_index[0]["status"] == "failed" and by_index[0]["error"] == "empty text"
    assert by_index[1]["id"] == "k1" and by_index[1]["label"] == "billing"  # "I was charged twice on invoice 1..."
    assert by_index[5]["label"] == "shipping"  # "where is my parcel 5"


def test_a_small_upload_is_read_in_the_request_and_answers_queued(stack):
    response = upload(stack, make_csv(20))
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] in ("queued", "running", "succeeded") and job["total_rows"] == 20
    assert wait_for_end(stack, job["id"])["done_rows"] == 20


def test_results_are_paginated_and_filterable(stack):
    job = upload(stack, make_csv(120, empty_every=40)).json()
    wait_for_end(stack, job["id"])
    url = f"{stack.url}/api/v1/jobs/{job['id']}/results"
    page = requests.get(url, params={"page_size": 50}, headers=stack.headers(), timeout=10).json()
    assert page["count"] == 120 and len(page["results"]) == 50 and page["next"]
    failed = requests.get(url, params={"status": "failed"}, headers=stack.headers(), timeout=10).json()
    assert [r["index"] for r in failed["results"]] == [0, 40, 80]


def test_cancel_stops_the_job_and_keeps_rows_done_so_far(stack):
    job = upload(stack, make_csv(4000)).json()
    wait_until(lambda: get_job(stack, job["id"])["done_rows"] > 0, 60, "some progress")
    response = requests.post(f"{stack.url}/api/v1/jobs/{job['id']}/cancel", headers=stack.headers(), timeout=10)
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    at_cancel = response.json()["done_rows"]
    # The offline worker has one child and runs its batches in turn: once a job uploaded after the cancel
    # has ended, the batch that held the cancelled job's rows has ended too, whatever the machine's load.
    later = upload(stack, make_csv(10)).json()
    assert wait_for_end(stack, later["id"])["status"] == "succeeded"
    after = get_job(stack, job["id"])
    assert after["status"] == "cancelled"
    assert after["done_rows"] == at_cancel, "no row done after the cancel answered"
    assert 0 < after["done_rows"] < 4000
    rows = export_rows(stack, job["id"])
    assert_each_row_once(rows, 4000)
    assert {r["status"] for r in rows} <= {"done", "cancelled"}
    again = requests.post(f"{stack.url}/api/v1/jobs/{job['id']}/cancel", headers=stack.headers(), timeout=10)
    assert again.status_code == 409 and "already ended" in again.json()["detail"]


def test_retry_reruns_only_the_rows_that_failed_at_run_time(stack, django_db_blocker):
    from tests.jobs.factories import fail_at_run_time

    job = upload(stack, make_csv(100, empty_every=25)).json()
    assert wait_for_end(stack, job["id"])["failed_rows"] == 4
    retry_url = f"{stack.url}/api/v1/jobs/{job['id']}/retry"

    def results() -> dict[int, dict]:
        url = f"{stack.url}/api/v1/jobs/{job['id']}/results"
        page = requests.get(url, params={"page_size": 1000}, headers=stack.headers(), timeout=10).json()
        return {r["index"]: r for r in page["results"]}

    first = results()
    assert all(r["row"] == r["index"] + 1 for r in first.values())  # numbered from 1, as the page numbers them
    empty = {i for i, r in first.items() if r["status"] == "failed"}
    assert empty == {0, 25, 50, 75} and all(first[i]["input_error"] and first[i]["attempts"] == 0 for i in empty)
    # Empty texts would only fail again: nothing to retry, and the answer says why and what to do.
    refused = requests.post(retry_url, headers=stack.headers(), timeout=10)
    assert refused.status_code == 409 and refused.json()["code"] == "rows_failed_on_input", refused.text
    assert refused.json()["detail"] == (
        f"job {job['id']} has no rows that a retry could help: 4 rows failed because of their input (empty text):"
        " fix the file and upload it again"
    )

    with django_db_blocker.unblock():  # two rows' batch failed at run time (their model raised)
        fail_at_run_time(job["id"], [1, 2])
    response = requests.post(retry_url, headers=stack.headers(), timeout=10)
    assert response.status_code == 200, response.text
    assert (response.json()["requeued_rows"], response.json()["input_failed_rows"]) == (2, 4)
    again = wait_for_end(stack, job["id"])
    assert (again["status"], again["done_rows"], again["failed_rows"]) == ("partial", 96, 4)
    second = results()
    assert [(second[i]["status"], second[i]["attempts"]) for i in (1, 2)] == [("done", 2)] * 2  # run once more
    for index in empty:  # not run again: still the file's problem
        assert (second[index]["attempts"], second[index]["error"]) == (0, "empty text")
    for index, row in first.items():  # rows that had succeeded were not touched
        if index not in empty | {1, 2}:
            assert second[index] == row

    # A row taken for a run-time failure whose input fails it anyway (a retried row's input is checked
    # again) is then known as the file's problem: the next retry leaves it.
    with django_db_blocker.unblock():
        fail_at_run_time(job["id"], [0])
    assert requests.post(retry_url, headers=stack.headers(), timeout=10).status_code == 200
    wait_for_end(stack, job["id"])
    third = results()
    assert (third[0]["status"], third[0]["error"], third[0]["input_error"]) == ("failed", "empty text", True)
    last = requests.post(retry_url, headers=stack.headers(), timeout=10)
    assert last.status_code == 409 and last.json()["code"] == "rows_failed_on_input", last.text


def test_the_time_a_job_spent_ended_is_not_in_its_rate_after_a_retry(stack, django_db_blocker):
    """Issue 24: a retry an hour after a job's end counted that hour as running time ("1 s, 340.8 rows/s"
    became "2 min 15 s, 3.7 rows/s"); the time between the end and the retry is left out."""
    from datetime import timedelta

    from jobs.models import Job
    from tests.jobs.factories import fail_at_run_time

    job = upload(stack, make_csv(100, empty_every=25)).json()
    first = wait_for_end(stack, job["id"])
    assert first["rows_per_s"] > 0 and first["elapsed_s"] is not None
    with django_db_blocker.unblock():  # as if the job had ended an hour ago, after the same run
        ended = Job.objects.get(pk=job["id"])
        Job.objects.filter(pk=ended.pk).update(
            started_at=ended.started_at - timedelta(hours=1), finished_at=ended.finished_at - timedelta(hours=1)
        )
        fail_at_run_time(job["id"], [1, 2, 3])
    retried = requests.post(f"{stack.url}/api/v1/jobs/{job['id']}/retry", headers=stack.headers(), timeout=10)
    assert retried.status_code == 200, retried.text
    again = wait_for_end(stack, job["id"])
    # Without the hour: the same order as the first run's rate (96 rows over a few seconds), not 96 / 3,600 s.
    assert again["rows_per_s"] > 1.0, (first["rows_per_s"], again["rows_per_s"])
    assert again["elapsed_s"] < first["elapsed_s"] + 60, (first["elapsed_s"], again["elapsed_s"])


def test_retry_of_a_running_job_or_one_without_failures_is_409(stack):
    job = upload(stack, make_csv(2000)).json()
    running = requests.post(f"{stack.url}/api/v1/jobs/{job['id']}/retry", headers=stack.headers(), timeout=10)
    assert running.status_code == 409 and "retry it once it has ended" in running.json()["detail"]
    requests.post(f"{stack.url}/api/v1/jobs/{job['id']}/cancel", headers=stack.headers(), timeout=10)


def test_a_worker_child_killed_mid_job_loses_and_duplicates_nothing(stack):
    job = upload(stack, make_csv(1500)).json()
    wait_until(lambda: get_job(stack, job["id"])["done_rows"] >= 100, 60, "the job to be under way")
    (child,) = stack.children("offline")
    os.kill(child["pid"], signal.SIGKILL)
    done = wait_for_end(stack, job["id"], timeout_s=180)
    assert done["status"] == "succeeded" and done["done_rows"] == 1500 and done["failed_rows"] == 0
    rows = export_rows(stack, job["id"])
    assert_each_row_once(rows, 1500)
    assert all(r["status"] == "done" and r["label"] for r in rows)


def test_redis_losing_its_lists_mid_job_delays_but_does_not_lose_it(stack):
    job = upload(stack, make_csv(1500)).json()
    wait_until(lambda: get_job(stack, job["id"])["done_rows"] >= 100, 60, "the job to be under way")
    # What a Redis restart without persistence does to the broker: the queue and unacked messages vanish.
    stack.redis.delete("offline", "unacked", "unacked_index")
    done = wait_for_end(stack, job["id"], timeout_s=180)
    assert done["status"] == "succeeded" and done["done_rows"] == 1500
    assert_each_row_once(export_rows(stack, job["id"]), 1500)


@pytest.mark.parametrize(
    ("data", "fields", "status", "message"),
    [
        (b"", {}, 400, "file is empty"),
        (b"key,text\n", {}, 400, "the file has a header but no data rows"),
        (
            b"key,body\nk1,hello\n",
            {},
            400,
            "text column 'text' not found; the comma-separated header has: 'key', 'body'",
        ),
        (
            b"key,text\nk1,fine\nk2," + "发票".encode("gbk") + b"\n",
            {},
            400,
            "line 3: byte 0xb7 at column 4 is not valid utf-8",
        ),
        (b"key,text\n" + b"k," + b"x" * 310_000 + b"\n", {}, 413, "the limit is 300000 bytes"),
        (b"key,text\nk1,hi\n", {"encoding": "klingon"}, 400, "unknown encoding 'klingon'"),
        (b"key,text\nk1,hi\n", {"model": "nope"}, 400, "unknown model 'nope'"),
    ],
)
def test_malformed_uploads_get_a_clear_error_and_create_nothing(stack, data, fields, status, message):
    before = requests.get(f"{stack.url}/api/v1/jobs", headers=stack.headers(), timeout=10).json()["count"]
    response = upload(stack, data, **fields)
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    after = requests.get(f"{stack.url}/api/v1/jobs", headers=stack.headers(), timeout=10).json()["count"]
    assert after == before, "no job was created"


def test_too_many_rows_fails_the_job_once_ingest_counts_them(stack):
    """The row count is known only after the whole file is read: the job fails with the limit's message."""
    response = upload(stack, b"key,text\n" + b"k,t\n" * 5001)
    assert response.status_code == 202, response.text
    done = wait_for_end(stack, response.json()["id"])
    assert done["status"] == "failed" and done["error"] == "the file has more than 5000 data rows, the limit per job"
    assert done["total_rows"] == 0 and export_rows(stack, done["id"]) == []


@pytest.mark.parametrize(
    ("data", "fields"),
    [
        (b'key;text\nk1;where is my parcel\nk2;"refund; please"\n', {}),
        (b"key\ttext\nk1\twhere is my parcel\nk2\trefund please\n", {}),
        ('\ufeffkey,text\nk1,where is my parcel\nk2,"refund,\nplease"\n'.encode(), {}),
        ("key,text\nk1,包裹在哪里\nk2,我要退款\n".encode("gbk"), {"encoding": "gbk"}),
    ],
    ids=["semicolon", "tab", "bom-and-quoted-newline", "gbk"],
)
def test_csv_dialects_and_encodings_are_read(stack, data, fields):
    response = upload(stack, data, **fields)
    assert response.status_code == 202, response.text
    done = wait_for_end(stack, response.json()["id"])
    assert done["status"] == "succeeded" and done["total_rows"] == 2
    rows = export_rows(stack, done["id"])
    assert [r["id"] for r in rows] == ["k1", "k2"]


def test_an_oversized_body_is_refused_before_it_is_read(stack):
    """Only the headers are sent: the 413 comes back without the server waiting for the 2 MB body."""
    host, port = stack.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.putrequest("POST", "/api/v1/jobs")
    connection.putheader("Authorization", f"Token {stack.token}")
    connection.putheader("Content-Type", "multipart/form-data; boundary=x")
    connection.putheader("Content-Length", "2000000")
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413
    assert "the limit is 1348576 bytes" in json.loads(response.read())["detail"]
    connection.close()


def test_json_body_is_415(stack):
    response = requests.post(
        f"{stack.url}/api/v1/jobs", json={"text_column": "text"}, headers=stack.headers(), timeout=10
    )
    assert response.status_code == 415


def test_another_users_job_is_404_everywhere(stack):
    job = upload(stack, make_csv(10)).json()
    other = {"Authorization": f"Token {stack.other_token}"}
    base = f"{stack.url}/api/v1/jobs/{job['id']}"
    for method, url in [
        ("get", base),
        ("get", f"{base}/results"),
        ("get", f"{base}/results.csv"),
        ("post", f"{base}/cancel"),
        ("post", f"{base}/retry"),
    ]:
        response = requests.request(method, url, headers=other, timeout=10)
        assert response.status_code == 404, (url, response.status_code)
    listed = requests.get(f"{stack.url}/api/v1/jobs", headers=other, params={"page_size": 200}, timeout=10).json()
    assert job["id"] not in [j["id"] for j in listed["results"]]
    assert requests.get(base, timeout=10).status_code == 401


def test_the_web_form_creates_the_same_job(stack):
    session = stack.browser_login()
    page = session.get(f"{stack.url}/jobs/", timeout=10)
    assert page.status_code == 200 and "New job" in page.text

    def submit(filename: str, data: bytes, text_column: str) -> requests.Response:
        form = {"model": "router", "text_column": text_column, "id_column": "key", "encoding": "utf-8"}
        return session.post(
            f"{stack.url}/jobs/",
            data={**form, "csrfmiddlewaretoken": session.cookies["csrftoken"]},
            files={"file": (filename, data, "text/csv")},
            headers={"Referer": f"{stack.url}/jobs/"},
            timeout=60,
        )

    response = submit("form.csv", make_csv(60), "text")
    assert response.status_code == 200 and "/jobs/" in response.url and "form.csv" in response.text
    job_id = int(response.url.rstrip("/").rsplit("/", 1)[1])
    assert wait_for_end(stack, job_id)["status"] == "succeeded"
    bad = submit("bad.csv", make_csv(3), "body")
    assert bad.status_code == 400 and "text column &#x27;body&#x27; not found" in bad.text
