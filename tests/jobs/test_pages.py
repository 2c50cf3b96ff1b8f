"""The jobs pages as a person uses them: buttons that apply, times, owner, labels, paging, forms that keep their values.

In-process (Django's test client); the on_commit hooks that would send messages to workers do not fire
inside the test's transaction, so Cancel and Retry change the database only, as the API's actions do.
"""

from __future__ import annotations

import re
import time
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone

import platform_.redis
from jobs import scheduler
from jobs.keys import offline_rows_field
from jobs.models import Chunk, ChunkStatus, Job, JobRow, JobStatus, Priority, RowStatus, UserShare
from jobs.views import duration_text
from observability.metrics import write_pipeline
from tests.jobs.factories import job_with_rows, user

pytestmark = pytest.mark.django_db
DB = 13  # this module's own Redis database: the offline rate behind each ETA is what these tests write there


@pytest.fixture(autouse=True)
def own_redis(settings, redis_url, monkeypatch) -> redis.Redis:
    """Pages read the measured offline rate from Redis: a database of this module's own, empty at the start;
    and no standing cached by an earlier test (the scheduler keeps them for 2 s)."""
    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{DB}"))
    settings.REDIS_URL = url
    monkeypatch.setattr(platform_.redis, "_sync", None)
    monkeypatch.setattr(scheduler, "_cache", None)
    client = redis.Redis.from_url(url, decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()


def offline_rate(client: redis.Redis, rows_per_s: int, seconds: int = 5) -> None:
    """As the offline workers write: `rows_per_s` rows in each of the last few seconds."""
    now = int(time.time())
    pipe = client.pipeline(transaction=False)
    for second in range(now - seconds, now):
        write_pipeline(pipe, {offline_rows_field("router"): rows_per_s}, now=second)
    pipe.execute()


def text_of(html: str) -> str:
    """The page's text as a person reads it: tags dropped, spaces collapsed."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


@pytest.fixture
def alice(client):
    person = user("alice")
    client.force_login(person)
    return person


def running_job(owner, rows: int = 120, done: int = 30, failed: int = 5) -> Job:
    job = Job.objects.create(owner=owner, model="router", text_column="text", filename="big.csv",
                             status=JobStatus.RUNNING, started_at=timezone.now(), total_rows=rows)  # fmt: skip
    JobRow.objects.bulk_create(
        JobRow(
            job=job,
            index=i,
            text=f"row text {i}",
            status=RowStatus.DONE if i < done else RowStatus.FAILED if i < done + failed else RowStatus.PENDING,
            label="billing" if i < done else "",
            score=0.9 if i < done else None,
            error="model error" if done <= i < done + failed else "",
        )  # fmt: skip
        for i in range(rows)
    )
    Chunk.objects.create(job=job, first_index=0, end_index=rows, status=ChunkStatus.RUNNING)
    job.refresh_counts()
    return job


def buttons(html: str) -> list[str]:
    return [re.sub(r"\s+", " ", b).strip() for b in re.findall(r"<button[^>]*>(.*?)</button>", html, re.S)]


def test_a_running_job_shows_cancel_and_cancelling_keeps_the_rows_done(client, alice):
    job = running_job(alice)
    page = client.get(reverse("jobs:detail", args=[job.pk]))
    html = page.content.decode()
    assert page.status_code == 200
    assert "Cancel job" in buttons(html) and not any(b.startswith("Retry") for b in buttons(html))
    assert "alice" in html and "Started" in html and "Elapsed" in html and "Time left" in html
    # The bar has a red part for the 5 failed rows of 120.
    assert 'class="failed" style="width: 4.17%"' in html
    assert "30 done, 5 failed of 120 rows · 85 to go" in html

    answer = client.post(reverse("jobs:cancel", args=[job.pk]), follow=True)
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED and job.done_rows == 30 and job.finished_at
    assert answer.redirect_chain[-1][0] == reverse("jobs:detail", args=[job.pk])
    html = answer.content.decode()
    assert f"Job {job.pk} cancelled" in html and "Cancel job" not in buttons(html)
    assert "30 done, 5 failed of 120 rows · 85 not run" in html
    assert JobRow.objects.filter(job=job, status=RowStatus.CANCELLED).count() == 85

    again = client.post(reverse("jobs:cancel", args=[job.pk]), follow=True)
    assert "had already ended" in again.content.decode()


def test_retry_failed_rows_requeues_only_the_failed_rows(client, alice):
    job = running_job(alice, rows=40, done=30, failed=10)
    job.chunks.update(status=ChunkStatus.DONE)
    job.finish()
    job.refresh_from_db()
    assert job.status == JobStatus.PARTIAL
    html = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert "Retry 10 failed rows" in buttons(html) and "Cancel job" not in buttons(html)

    answer = client.post(reverse("jobs:retry", args=[job.pk]), follow=True)
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED and job.failed_rows == 0 and job.done_rows == 30
    assert JobRow.objects.filter(job=job, status=RowStatus.PENDING).count() == 10
    assert "10 failed rows queued again" in answer.content.decode()


def test_actions_need_post_and_the_jobs_owner(client, alice):
    job = running_job(alice)
    assert client.get(reverse("jobs:cancel", args=[job.pk])).status_code == 405
    client.force_login(user("mallory"))
    assert client.post(reverse("jobs:cancel", args=[job.pk])).status_code == 404
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING


def test_rows_come_in_pages_and_filters(client, alice):
    job = running_job(alice)
    first = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert "row text 49" in first and "row text 50<" not in first and "page 1 of 3" in first
    third = client.get(reverse("jobs:detail", args=[job.pk]), {"page": 3}).content.decode()
    assert "row text 119" in third and "row text 99<" not in third and "101–120 of 120" in third
    failed = client.get(reverse("jobs:detail", args=[job.pk]), {"status": "failed"}).content.decode()
    assert failed.count("model error") == 5 and "row text 29<" not in failed


def test_labels_summary_and_review_link(client):
    boss = user("boss", staff=True)
    job = job_with_rows(user("alice"))
    client.force_login(boss)
    html = client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    summary = re.sub(r"\s+", " ", html)
    assert '<td>billing</td><td class="num">2</td><td class="num">1</td>' in summary
    assert "2 rows below the model's confidence threshold" in summary
    assert f"/admin/jobs/jobrow/?job__id__exact={job.pk}&amp;low_confidence__exact=1" in html
    review = client.get(f"/admin/jobs/jobrow/?job__id__exact={job.pk}&low_confidence__exact=1")
    assert review.status_code == 200 and [r.index for r in review.context["cl"].result_list] == [1, 3]


def test_the_list_shows_eta_failed_and_refreshes_from_a_fragment(client, alice, own_redis):
    running_job(alice)
    offline_rate(own_redis, 17)  # 85 rows left, nothing else waiting, the workers write 17 rows/s: 5 s
    page = client.get(reverse("jobs:list")).content.decode()
    assert 'id="job-rows"' in page and "setTimeout(refresh" in page
    fragment = client.get(reverse("jobs:list-rows"))
    html = fragment.content.decode()
    assert fragment.status_code == 200 and "<html" not in html
    assert "big.csv" in html and "5 s" in html and '<b class="row-error">5</b>' in html and 'data-live="1"' in html


def test_the_job_list_is_paged(client, alice):
    for _ in range(30):
        Job.objects.create(owner=alice, model="router", text_column="text", filename="many.csv",
                           status=JobStatus.SUCCEEDED)  # fmt: skip
    first = client.get(reverse("jobs:list")).content.decode()
    assert first.count("many.csv</a>") == 25 and "page 1 of 2" in first
    second = client.get(reverse("jobs:list"), {"page": 2}).content.decode()
    assert second.count("many.csv</a>") == 5


def test_an_upload_error_keeps_the_fields_and_asks_for_the_file_again(client, alice):
    csv = SimpleUploadedFile("bad.csv", b"key;body\n1;hello\n", content_type="text/csv")
    form = {
        "model": "router",
        "text_column": "text",
        "id_column": "key",
        "delimiter": "semicolon",
        "encoding": "latin-1",
    }
    answer = client.post(reverse("jobs:list"), {**form, "file": csv})
    html = answer.content.decode()
    assert answer.status_code == 400 and "text column &#x27;text&#x27; not found" in html
    assert "choose the CSV file again" in html
    assert 'value="key"' in html and 'value="latin-1"' in html
    assert re.search(r'<option value="semicolon" selected>', html)
    assert re.search(r'<option value="router" selected>', html)
    assert not Job.objects.exists()


def test_durations_read_as_a_person_would():
    assert [duration_text(s) for s in (None, 4.4, 65, 7325)] == ["–", "4 s", "1 min 05 s", "2 h 02 min"]


def waiting_job(owner, priority: str, chunks: int, rows_per_chunk: int = 32, status: str = JobStatus.QUEUED) -> Job:
    """A job whose chunks wait in the database for the scheduler (none sent yet)."""
    rows = chunks * rows_per_chunk
    job = Job.objects.create(owner=owner, model="router", text_column="text", filename=f"{owner}-{priority}.csv",
                             status=status, priority=priority, total_rows=rows)  # fmt: skip
    JobRow.objects.bulk_create(JobRow(job=job, index=i, text=f"row {i}") for i in range(rows))
    Chunk.objects.bulk_create(
        Chunk(job=job, first_index=c * rows_per_chunk, end_index=(c + 1) * rows_per_chunk, cost_tokens=400)
        for c in range(chunks)
    )
    return job


def test_a_waiting_job_shows_its_priority_and_where_it_stands(client, alice, own_redis):
    mine = waiting_job(alice, Priority.NORMAL, chunks=4)
    urgent = waiting_job(user("bob"), Priority.HIGH, chunks=3)
    offline_rate(own_redis, 64)
    standing = scheduler.standing_of(mine)
    assert standing.chunks_ahead >= 1 and standing.eta_s is not None  # bob's high-priority chunks go first

    page = text_of(client.get(reverse("jobs:detail", args=[mine.pk])).content.decode())
    assert "Normal priority" in page and "Priority Normal" in page
    assert "Waiting: 1 job of higher priority" in page
    assert f"Chunks ahead {standing.chunks_ahead} chunk" in page
    assert f"Rows ahead {standing.rows_ahead:,} rows" in page
    assert f"Time left {duration_text(standing.eta_s)}" in page
    # The card that refreshes itself says the same.
    fragment = text_of(client.get(reverse("jobs:summary", args=[mine.pk])).content.decode())
    assert "Waiting: 1 job of higher priority" in fragment and f"Time left {duration_text(standing.eta_s)}" in fragment

    # The list: each job's priority, why it waits, and how many chunks go before its next one.
    rows = text_of(client.get(reverse("jobs:list-rows")).content.decode())
    assert f"{mine.filename} Queued waiting: 1 job of higher priority" in rows
    assert "router alice Normal" in rows  # model, owner and priority, after the columns a job is followed by
    assert f"{standing.chunks_ahead} chunk" in rows and duration_text(standing.eta_s) in rows

    # The high-priority job has nothing ahead of it (bob sees his own job).
    client.force_login(urgent.owner)
    first = text_of(client.get(reverse("jobs:detail", args=[urgent.pk])).content.decode())
    assert "High priority" in first and "Nothing ahead of it" in first and "Chunks ahead 0 chunks" in first


def test_an_ended_job_shows_no_standing(client, alice, own_redis):
    offline_rate(own_redis, 64)
    waiting_job(user("bob"), Priority.HIGH, chunks=3)  # other work waits, but not before an ended job
    job = job_with_rows(alice)
    page = text_of(client.get(reverse("jobs:detail", args=[job.pk])).content.decode())
    assert "Normal priority" in page and "Time left ended" in page
    assert "Chunks ahead" not in page and "Rows ahead" not in page and "waiting" not in page.lower()
    row = [r for r in client.get(reverse("jobs:list-rows")).content.decode().split("<tr") if job.filename in r][0]
    assert "waiting" not in row and "chunk" not in text_of(row)


def test_a_job_with_no_measured_rate_says_its_time_left_is_not_known(client, alice):
    job = waiting_job(alice, Priority.LOW, chunks=2)
    page = text_of(client.get(reverse("jobs:detail", args=[job.pk])).content.decode())
    assert "Low priority" in page and "Time left not known yet" in page and "Chunks ahead 0 chunks" in page


def test_the_upload_form_offers_the_priorities_the_user_may_ask_for(client, alice):
    html = client.get(reverse("jobs:list")).content.decode()
    assert re.search(r'<select name="priority"[^>]*aria-describedby="id_priority_helptext"', html)
    assert "higher is served first; a lower priority still advances" in html
    # Normal is the highest an ordinary user may ask for (JOBS_DEFAULT_MAX_PRIORITY); staff may raise it.
    assert '<option value="normal" selected>' in html and '<option value="low">' in html
    assert '<option value="high">' not in html
    UserShare.objects.create(user=alice, max_priority=Priority.HIGH)
    assert '<option value="high">' in client.get(reverse("jobs:list")).content.decode()


def test_a_quota_refusal_is_said_above_the_form(client, alice):
    UserShare.objects.create(user=alice, max_unfinished_jobs=1)
    waiting_job(alice, Priority.NORMAL, chunks=1)
    csv = SimpleUploadedFile("more.csv", b"text\nhello\n", content_type="text/csv")
    answer = client.post(reverse("jobs:list"), {"model": "router", "encoding": "utf-8", "file": csv})
    html = answer.content.decode()
    assert answer.status_code == 429
    alert = text_of(re.search(r'<div class="form-error" role="alert">(.*?)</div>', html, re.S).group(1))
    assert "The job was not created. Quota of unfinished jobs reached: you have 1 jobs not yet ended" in alert
    assert "may have at most 1" in alert and "choose the CSV file again" in alert and "marked below" not in alert
    assert Job.objects.count() == 1


def test_a_batch_shows_its_batch_id_on_the_list_and_its_page_and_offers_no_retry(client, alice):
    from jobs.models import Batch, FileFormat

    job = job_with_rows(alice, status=JobStatus.PARTIAL, labels=("billing", "shipping"))
    JobRow.objects.filter(job=job, index=1).update(status=RowStatus.FAILED, error="input[0] is empty")
    Job.objects.filter(pk=job.pk).update(file_format=FileFormat.BATCH, filename="requests.jsonl")
    Batch.objects.create(public_id="batch_0123abc", job=job, endpoint="/v1/embeddings", expires_at=timezone.now())
    job.refresh_counts()
    listed = text_of(client.get(reverse("jobs:list")).content.decode())
    assert "requests.jsonl batch_0123abc" in listed
    page = text_of(client.get(reverse("jobs:detail", args=[job.pk])).content.decode())
    assert "Batch batch_0123abc (/v1/embeddings)" in page
    assert "Retry" not in page and "Download results (JSON lines)" in page


def test_the_job_page_shows_no_template_comment(client, alice):
    """A multi-line {# #} is not a comment in Django's templates: it showed on the page as text."""
    client.force_login(alice)
    job = job_with_rows(alice)
    assert "{#" not in client.get(f"/jobs/{job.pk}/").content.decode()
