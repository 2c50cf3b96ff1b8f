"""Retry offers only rows that can succeed, and a retried job's timing stays honest (issue 24).

A row that failed because of its input (an empty or over-long text, found when the file was read) would
fail again: retries leave it and the page, the API and the admin say to fix the file. A row that failed at
run time (a worker or model error) is offered again. In-process (Django's test client): jobs are created
from real uploads, read in the request as small files are; what an offline worker writes is written here
through the same JobRow methods the runner uses (`run_to_end`), since no worker runs in these tests.
"""

from __future__ import annotations

import importlib
import io
import re
from datetime import timedelta

import pytest
import redis
from django.apps import apps
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import lifecycle, scheduler
from jobs.models import Chunk, ChunkStatus, Job, JobRow, JobStatus, RowStatus
from tests.conftest import own_redis_database
from tests.jobs.factories import user

pytestmark = pytest.mark.django_db
DB = 8  # this module's own Redis database (throttles, and the offline rate the job page reads)
INPUT_NOTE = "3 rows failed because of their input (empty text): fix the file and upload it again"


@pytest.fixture(autouse=True)
def own_redis(settings, redis_url, monkeypatch) -> redis.Redis:
    """An empty Redis database of this module's own, and no standing cached by an earlier test."""
    monkeypatch.setattr(scheduler, "_cache", None)
    yield from own_redis_database(settings, redis_url, monkeypatch, DB)


@pytest.fixture
def alice(client):
    person = user("alice")
    client.force_login(person)
    return person


@pytest.fixture
def api(alice) -> APIClient:
    client = APIClient()
    client.force_authenticate(alice)
    return client


def text_of(html: str) -> str:
    """The page's text as a person reads it: tags dropped, spaces collapsed."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&#x27;", "'")


def buttons(html: str) -> list[str]:
    return [re.sub(r"\s+", " ", b).strip() for b in re.findall(r"<button[^>]*>(.*?)</button>", html, re.S)]


def uploaded(owner, rows: int = 20, empty: tuple[int, ...] = (0, 7, 14)) -> Job:
    """A job from a CSV whose rows `empty` have no text: read at once (a small file), those rows failed at ingest."""
    lines = ["key,text", *(f"k{i},{'' if i in empty else f'where is my parcel {i}'}" for i in range(rows))]
    job = lifecycle.create_job(
        owner=owner, model="router", upload=io.BytesIO("\n".join(lines).encode()), filename="t.csv", text_column="text"
    )
    assert job.status == JobStatus.QUEUED, (job.status, job.error)
    return job


def run_to_end(job: Job, *, fail_at_run_time: tuple[int, ...] = (), ran_s: float = 0.0) -> Job:
    """What an offline worker does with the job's pending rows: those in `fail_at_run_time` fail as a batch whose
    model raised does (jobs/runner.py, fail_the_rest), the others are done; then the job ends. Written through
    the runner's own JobRow methods. `ran_s`: the job's first run is dated that long before its end."""
    Job.start([job.pk])
    if ran_s:
        Job.objects.filter(pk=job.pk).update(started_at=timezone.now() - timedelta(seconds=ran_s))
    pending = list(job.rows.filter(status=RowStatus.PENDING))
    failed = [row for row in pending if row.index in fail_at_run_time]
    for row in failed:
        row.status, row.error, row.attempts = RowStatus.FAILED, "inference failed: CUDA out of memory", row.attempts + 1
    JobRow.objects.fail(failed)
    done = [row for row in pending if row.index not in fail_at_run_time]
    for row in done:
        row.status, row.label, row.score, row.attempts = RowStatus.DONE, "shipping", 0.9, row.attempts + 1
        row.output = {"label": "shipping", "score": 0.9}
    JobRow.objects.complete(done, ["status", "label", "score", "output", "attempts"])
    Chunk.objects.filter(job=job).update(status=ChunkStatus.DONE)
    job.refresh_from_db()
    assert job.finish()
    job.refresh_from_db()
    return job


def statuses(job: Job) -> dict[int, str]:
    return dict(job.rows.values_list("index", "status"))


# Rows that failed because of their input -------------------------------------------------------------------


def test_rows_that_failed_at_ingest_are_marked_as_failed_by_their_input(alice):
    job = run_to_end(uploaded(alice))
    assert (job.status, job.done_rows, job.failed_rows) == (JobStatus.PARTIAL, 17, 3)
    failed = job.rows.filter(status=RowStatus.FAILED)
    assert sorted(failed.values_list("index", "error", "input_error", "attempts")) == [
        (0, "empty text", True, 0),
        (7, "empty text", True, 0),
        (14, "empty text", True, 0),
    ]
    assert not job.rows.filter(status=RowStatus.DONE, input_error=True).exists()


def test_a_job_whose_rows_failed_only_by_their_input_offers_no_retry_and_says_to_fix_the_file(client, alice):
    job = run_to_end(uploaded(alice))
    html = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert not [b for b in buttons(html) if "Retry" in b]
    assert f"{INPUT_NOTE}. Show the failed rows" in text_of(html)

    # A retry posted anyway (a page left open, a crafted form) runs nothing and says why.
    answer = client.post(reverse("jobs:retry", args=[job.pk]), follow=True)
    assert f"Job {job.pk} has no rows that a retry could help: {INPUT_NOTE}." in text_of(answer.content.decode())
    job.refresh_from_db()
    assert job.status == JobStatus.PARTIAL and job.failed_rows == 3
    assert set(statuses(job).values()) == {RowStatus.DONE, RowStatus.FAILED}


def test_the_page_offers_only_the_rows_that_failed_at_run_time(client, alice):
    job = run_to_end(uploaded(alice), fail_at_run_time=(3, 4))
    assert (job.status, job.done_rows, job.failed_rows) == (JobStatus.PARTIAL, 15, 5)
    html = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert "Retry 2 failed rows" in buttons(html)
    assert INPUT_NOTE in text_of(html)

    answer = client.post(reverse("jobs:retry", args=[job.pk]), follow=True)
    shown = text_of(answer.content.decode())
    assert f"Job {job.pk}: 2 failed rows queued again. {INPUT_NOTE}." in shown
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED and job.failed_rows == 3
    rows = statuses(job)
    assert [i for i, s in rows.items() if s == RowStatus.PENDING] == [3, 4]
    assert [i for i, s in rows.items() if s == RowStatus.FAILED] == [0, 7, 14]

    # Run again, the two succeed: the job ends with only the rows its file must fix, and no Retry.
    job = run_to_end(job)
    assert (job.status, job.done_rows, job.failed_rows) == (JobStatus.PARTIAL, 17, 3)
    html = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert not [b for b in buttons(html) if "Retry" in b] and INPUT_NOTE in text_of(html)


def test_one_failed_row_is_said_in_the_singular_and_several_problems_are_counted(client, alice):
    job = run_to_end(uploaded(alice, empty=(5,)), fail_at_run_time=(9,))
    html = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert "Retry 1 failed row" in buttons(html)
    assert "1 row failed because of its input (empty text): fix the file and upload it again" in text_of(html)

    JobRow.objects.filter(job=job, index=2).update(
        status=RowStatus.FAILED, input_error=True, error="text too long: 5000 characters, the limit is 4096"
    )
    job.refresh_counts()
    offer = lifecycle.retry_offer(job)
    assert (offer.rows, offer.input_rows, offer.input_reasons) == (1, 2, "1 empty text, 1 text too long")

    # Counts inside a reason do not make kinds of their own: two questions of different lengths are one kind.
    for index, tokens in ((3, 612), (4, 700)):
        JobRow.objects.filter(job=job, index=index).update(
            status=RowStatus.FAILED, input_error=True, error=f"question is {tokens} tokens; the limit is 512"
        )
    job.refresh_counts()
    offer = lifecycle.retry_offer(job)
    assert offer.input_reasons == "2 question is N tokens, 1 empty text, 1 text too long"


def test_the_api_answers_409_naming_the_input_and_retries_only_run_time_failures(api, alice):
    only_input = run_to_end(uploaded(alice))
    refused = api.post(f"/api/v1/jobs/{only_input.pk}/retry")
    assert refused.status_code == 409, refused.content
    assert refused.json() == {
        "detail": f"job {only_input.pk} has no rows that a retry could help: {INPUT_NOTE}",
        "code": "rows_failed_on_input",
    }
    rows = api.get(f"/api/v1/jobs/{only_input.pk}/results", {"status": "failed"}).json()["results"]
    assert [(r["index"], r["error"], r["input_error"]) for r in rows] == [(i, "empty text", True) for i in (0, 7, 14)]

    mixed = run_to_end(uploaded(alice), fail_at_run_time=(3,))
    answer = api.post(f"/api/v1/jobs/{mixed.pk}/retry")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert (body["status"], body["requeued_rows"], body["input_failed_rows"], body["failed_rows"]) == (
        "queued",
        1,
        3,
        3,
    )

    succeeded = run_to_end(uploaded(alice, empty=()))
    nothing = api.post(f"/api/v1/jobs/{succeeded.pk}/retry")
    assert nothing.status_code == 409 and nothing.json() == {
        "detail": f"job {succeeded.pk} has no failed rows to retry",
        "code": "conflict",
    }


def test_the_admin_offers_only_run_time_failures_and_says_why_not_the_others(client, alice):
    client.force_login(user("reviewer", staff=True))
    only_input = run_to_end(uploaded(alice))
    page = client.get(reverse("admin:jobs_job_change", args=[only_input.pk])).content.decode()
    button = re.search(r'<button type="submit" name="retry"[^>]*>', page).group(0)
    assert "disabled" in button and "has no rows that a retry could help" in button
    assert INPUT_NOTE in text_of(page)
    refused = client.post(reverse("admin:jobs_job_retry", args=[only_input.pk]), follow=True)
    assert f"Job {only_input.pk} has no rows that a retry could help: {INPUT_NOTE}." in text_of(
        refused.content.decode()
    )

    mixed = run_to_end(uploaded(alice), fail_at_run_time=(3, 4))
    page = client.get(reverse("admin:jobs_job_change", args=[mixed.pk])).content.decode()
    assert "Retry failed (2)" in buttons(page)
    assert f"2 row(s) failed at run time: a retry runs them again; {INPUT_NOTE}" in text_of(page)
    changelist = reverse("admin:jobs_job_changelist")
    answer = client.post(
        changelist, {"action": "retry_failed_rows", "_selected_action": [only_input.pk, mixed.pk]}, follow=True
    )
    assert (
        "2 failed row(s) queued again; 6 row(s) that failed because of their input were left: fix the file and"
        " upload it again" in text_of(answer.content.decode())
    )
    assert [i for i, s in statuses(mixed).items() if s == RowStatus.PENDING] == [3, 4]
    assert Job.objects.get(pk=only_input.pk).status == JobStatus.PARTIAL


def test_existing_failed_rows_are_told_apart_by_the_migration():
    """Rows failed before the flag existed: only what the runner writes on a run-time failure stays retryable."""
    migration = importlib.import_module("jobs.migrations.0008_row_input_error")
    job = Job.objects.create(owner=user("olga"), model="router", status=JobStatus.PARTIAL, total_rows=4)
    JobRow.objects.bulk_create(
        [
            JobRow(job=job, index=0, text="", status=RowStatus.FAILED, error="empty text"),  # at ingest
            JobRow(job=job, index=1, text="", status=RowStatus.FAILED, error="empty text", attempts=1),  # re-checked
            JobRow(job=job, index=2, text="hi", status=RowStatus.FAILED, error="inference failed: boom", attempts=1),
            JobRow(job=job, index=3, text="hi", status=RowStatus.DONE, attempts=1),
        ]
    )
    migration.mark_input_errors(apps, None)
    assert dict(job.rows.values_list("index", "input_error")) == {0: True, 1: True, 2: False, 3: False}


# Timing after a retry -------------------------------------------------------------------------------------


def test_a_retry_an_hour_later_leaves_the_hour_out_of_the_elapsed_time_and_rate(client, api, alice):
    """The issue: "1 s / 340.8 rows/s became 2 min 15 s / 3.7 rows/s". A job that ran 2 s and ended an hour
    ago is retried; once its retried rows are done, its elapsed time is still about 2 s, on the page and the
    API, and its rate its rows over those seconds."""
    job = run_to_end(uploaded(alice, rows=100, empty=()), fail_at_run_time=(10, 20), ran_s=2.0)
    first = api.get(f"/api/v1/jobs/{job.pk}").json()
    assert first["status"] == "partial" and 2.0 <= first["elapsed_s"] < 3.0
    assert 30 < first["rows_per_s"] <= 49  # 98 rows in 2 s
    hour = timedelta(hours=1)  # as if it had ended an hour ago, after the same run
    Job.objects.filter(pk=job.pk).update(started_at=job.started_at - hour, finished_at=job.finished_at - hour)

    assert api.post(f"/api/v1/jobs/{job.pk}/retry").status_code == 200
    queued = api.get(f"/api/v1/jobs/{job.pk}").json()
    assert queued["status"] == "queued" and 2.0 <= queued["elapsed_s"] < 3.0  # waiting again: no hour counted
    job = run_to_end(job)
    again = api.get(f"/api/v1/jobs/{job.pk}").json()
    assert (again["status"], again["done_rows"]) == ("succeeded", 100)
    assert 2.0 <= again["elapsed_s"] < 3.0, again
    assert 30 < again["rows_per_s"] <= 50, again  # 100 rows in about 2 s, not 100 in an hour
    summary = text_of(client.get(reverse("jobs:summary", args=[job.pk])).content.decode())
    assert re.search(r"Elapsed [23] s ", summary), summary
    assert f"Rate {again['rows_per_s']:.1f} rows/s" in summary


# One name per state ---------------------------------------------------------------------------------------


def test_every_status_label_carries_the_api_value(client, alice):
    """A person matches the page and the admin to the API by the word: "Partial (some rows failed)" is `partial`."""
    for value, label in JobStatus.choices:
        assert label.lower().startswith(value), (value, label)
    job = run_to_end(uploaded(alice))
    page = text_of(client.get(reverse("jobs:detail", args=[job.pk])).content.decode())
    assert "Partial (some rows failed)" in page and "succeeded with failed rows" not in page
    client.force_login(user("reviewer", staff=True))
    listed = text_of(client.get(reverse("admin:jobs_job_changelist")).content.decode())
    assert "Partial (some rows failed)" in listed


def test_a_retry_that_loses_the_race_to_another_says_so(alice):
    """Two retries at once: the second finds the job queued again, and says that rather than "no rows a
    retry could help" (the job object it checked was read before the first retry queued the rows)."""
    job = run_to_end(uploaded(alice), fail_at_run_time=(3,))
    stale = Job.objects.get(pk=job.pk)  # what a concurrent request read before either retry
    assert lifecycle.retry_failed(job) == 1
    assert stale.is_terminal and lifecycle.retry_failed(stale) == 0
    stale.refresh_from_db()
    reason = lifecycle.no_retry_reason(stale, lifecycle.retry_offer(stale))
    assert reason == f"job {job.pk} is queued again: another retry has just queued its failed rows"
