"""The jobs pages as a person uses them: buttons that apply, times, owner, labels, paging, forms that keep their values.

In-process (Django's test client); the on_commit hooks that would send messages to workers do not fire
inside the test's transaction, so Cancel and Retry change the database only, as the API's actions do.
"""

from __future__ import annotations

import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone

from jobs.models import Chunk, ChunkStatus, Job, JobRow, JobStatus, RowStatus
from jobs.views import duration_text
from tests.jobs.factories import job_with_rows, user

pytestmark = pytest.mark.django_db


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


def test_the_list_shows_eta_failed_and_refreshes_from_a_fragment(client, alice):
    job = running_job(alice)
    Job.objects.filter(pk=job.pk).update(rows_per_s=17.0)  # 85 rows left at 17 rows/s: 5 s
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
