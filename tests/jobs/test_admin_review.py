"""Admin review on a laptop screen: labels chosen from the model, runner-up, rounded numbers, a read-only job page with per-job actions."""

from __future__ import annotations

import csv
import io
import re

import pytest
from django.urls import reverse

from inference.core.labels import labels_for
from jobs.models import Job, JobRow, JobStatus, RowStatus
from tests.jobs.factories import job_with_rows, user

pytestmark = pytest.mark.django_db

ROUTER_LABELS = ["billing", "technical", "account", "sales", "shipping"]  # inference/routes/support.yaml


@pytest.fixture
def admin_client(client):
    client.force_login(user("reviewer", staff=True))
    return client


def rows_page(client, job: Job, **params) -> str:
    page = client.get(reverse("admin:jobs_jobrow_changelist"), {"job__id__exact": job.pk, **params})
    assert page.status_code == 200
    return page.content.decode()


def test_labels_for_reads_the_routes_file_and_knows_no_labels_for_other_tasks():
    assert labels_for("router") == ROUTER_LABELS
    assert labels_for("embedding") == []
    assert labels_for("no-such-model") == []


def test_labels_for_reads_a_classifiers_id2label_in_id_order(tmp_path, settings):
    model = tmp_path / "clf"
    model.mkdir()
    (model / "config.json").write_text('{"id2label": {"1": "positive", "0": "negative", "10": "mixed"}}')
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  sentiment:\n    task: text-classification\n    path: {model}\n")
    from inference.core.registry import get_registry

    settings.INFERENCE_MODELS_FILE = str(models)
    get_registry.cache_clear()
    try:
        assert labels_for("sentiment") == ["negative", "positive", "mixed"]
    finally:
        get_registry.cache_clear()


def test_review_list_offers_the_models_labels_in_a_select_with_an_empty_choice(admin_client):
    job = job_with_rows(user("alice"))
    html = rows_page(admin_client, job)
    select = re.search(r'<select name="form-0-corrected_label"[^>]*>(.*?)</select>', html, re.S)
    assert select, "corrected_label is a select in the list"
    options = re.findall(r'<option value="([^"]*)"', select.group(1))
    assert options == ["", *ROUTER_LABELS]


def test_review_list_has_the_narrow_columns_and_the_full_text_on_hover(admin_client):
    job = job_with_rows(user("alice"))
    long_text = "my parcel " * 40
    JobRow.objects.filter(job=job, index=0).update(text=long_text)
    html = rows_page(admin_client, job)
    headers = re.findall(r'<th scope="col" class="[^"]*column-(\w+)', html)
    assert headers == [
        "row_ref",
        "short_text",
        "predicted",
        "score_shown",
        "runner_up_shown",
        "corrected_label",
        "reviewer",
    ]
    assert f'title="{long_text}"' in html  # full text on hover
    assert "my parcel my parcel" in html and long_text not in html.replace(f'title="{long_text}"', "")
    # Across jobs, the job column comes back.
    all_rows = admin_client.get(reverse("admin:jobs_jobrow_changelist")).content.decode()
    assert "column-job_ref" in all_rows


def test_scores_have_three_decimals_and_the_runner_up_comes_from_stored_scores(admin_client):
    job = job_with_rows(user("alice"))
    JobRow.objects.filter(job=job, index=0).update(
        score=0.812345678,
        output={
            "label": "billing",
            "score": 0.812346,
            "scores": {"billing": 0.812346, "sales": 0.41234, "account": 0.1},
        },
    )
    html = rows_page(admin_client, job)
    assert "0.812" in html and "0.812345" not in html
    assert re.search(r"sales <span[^>]*>0\.412</span>", html)
    # Rows stored without per-label scores say so instead of guessing.
    assert "only the top label" in html
    assert "0.300 ⚑" in html  # low-confidence rows flagged in the score column


def test_saving_a_correction_in_the_list_stores_it_with_the_reviewer(admin_client):
    job = job_with_rows(user("alice"))
    rows = list(job.rows.order_by("index"))
    form = {
        "form-TOTAL_FORMS": str(len(rows)),
        "form-INITIAL_FORMS": str(len(rows)),
        "_save": "Save",
    }
    for i, row in enumerate(rows):
        form[f"form-{i}-id"] = str(row.pk)
        form[f"form-{i}-corrected_label"] = "account" if row.index == 1 else ""
    changelist = reverse("admin:jobs_jobrow_changelist") + f"?job__id__exact={job.pk}"
    response = admin_client.post(changelist, form)
    assert response.status_code == 302
    corrected = JobRow.objects.get(job=job, index=1)
    assert corrected.corrected_label == "account" and corrected.reviewed_by.username == "reviewer"
    assert corrected.reviewed_at is not None
    untouched = JobRow.objects.get(job=job, index=0)
    assert untouched.reviewed_by is None  # only the rows whose label changed count as reviewed


def test_a_label_the_model_does_not_have_is_refused(admin_client):
    job = job_with_rows(user("alice"))
    row = job.rows.get(index=1)
    response = admin_client.post(reverse("admin:jobs_jobrow_change", args=[row.pk]), {"corrected_label": "biling"})
    assert response.status_code == 200  # the form again, with the error
    assert "Select a valid choice" in response.content.decode()
    row.refresh_from_db()
    assert row.corrected_label == "" and row.reviewed_by is None


def test_job_page_is_read_only_with_rounded_numbers_seconds_and_a_progress_bar(admin_client):
    job = job_with_rows(user("alice"))
    JobRow.objects.filter(job=job, index=2).update(status=RowStatus.FAILED, error="boom")
    Job.objects.filter(pk=job.pk).update(rows_per_s=181.52911046197647, failed_rows=1, done_rows=3)
    page = admin_client.get(reverse("admin:jobs_job_change", args=[job.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="_save"' not in html and 'name="_continue"' not in html
    assert "181.5" in html and "181.529" not in html
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", html)  # times to the second
    assert 'class="job-bar"' in html and "1 failed" in html
    for button in ("Cancel job", "Retry failed", "Export CSV"):
        assert button in html
    assert "Inference platform" in html and 'href="/dashboard/"' in html and 'href="/jobs/"' in html
    assert "Django administration" not in html


def test_cancel_button_cancels_a_running_job_and_needs_a_post(admin_client):
    job = job_with_rows(user("alice"), status=JobStatus.RUNNING)
    url = reverse("admin:jobs_job_cancel", args=[job.pk])
    assert admin_client.get(url).status_code == 405
    assert Job.objects.get(pk=job.pk).status == JobStatus.RUNNING
    response = admin_client.post(url, follow=True)
    assert Job.objects.get(pk=job.pk).status == JobStatus.CANCELLED
    assert "cancelled" in response.content.decode()
    # Once ended, the page shows the button disabled and a second cancel only says so.
    assert re.search(r'<button type="submit" name="cancel"[^>]*disabled', response.content.decode())
    again = admin_client.post(url, follow=True)
    assert "already ended" in again.content.decode()


def test_cancel_is_refused_without_the_csrf_token(client):
    job = job_with_rows(user("alice"), status=JobStatus.RUNNING)
    from django.test import Client

    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user("reviewer", staff=True))
    assert strict.post(reverse("admin:jobs_job_cancel", args=[job.pk])).status_code == 403
    assert Job.objects.get(pk=job.pk).status == JobStatus.RUNNING


def test_retry_button_requeues_failed_rows(admin_client):
    job = job_with_rows(user("alice"))
    JobRow.objects.filter(job=job, index=2).update(status=RowStatus.FAILED, error="inference failed: boom")
    job.refresh_counts()
    Job.objects.filter(pk=job.pk).update(status=JobStatus.PARTIAL)
    response = admin_client.post(reverse("admin:jobs_job_retry", args=[job.pk]), follow=True)
    assert "1 failed row(s) of job" in response.content.decode()
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED
    assert list(job.rows.filter(status=RowStatus.PENDING).values_list("index", flat=True)) == [2]


def test_export_button_streams_the_jobs_rows_with_corrections(admin_client):
    job = job_with_rows(user("alice"))
    JobRow.objects.filter(job=job, index=1).update(corrected_label="account")
    response = admin_client.get(reverse("admin:jobs_job_export", args=[job.pk]))
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [r["index"] for r in rows] == ["0", "1", "2", "3"]
    assert rows[1]["corrected_label"] == "account"


def test_staff_without_job_permissions_get_no_actions(client):
    from django.contrib.auth.models import Permission

    job = job_with_rows(user("alice"), status=JobStatus.RUNNING)
    viewer = user("viewer")
    viewer.is_staff = True
    viewer.save()
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(viewer)
    page = client.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    assert "Cancel job" not in page
    assert client.post(reverse("admin:jobs_job_cancel", args=[job.pk])).status_code == 403
    assert Job.objects.get(pk=job.pk).status == JobStatus.RUNNING


def test_slow_request_log_rounds_durations_and_shows_seconds(admin_client):
    from inference.models import SlowRequest

    SlowRequest.objects.create(
        request_id="r1",
        model="router",
        status=504,
        inputs=1,
        input_chars=10,
        total_ms=2003.456789,
        queue_wait_ms=12.34567,
    )
    html = admin_client.get(reverse("admin:inference_slowrequest_changelist")).content.decode()
    assert "2003.5" in html and "12.3" in html and "2003.456" not in html
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", html)


def test_a_rows_page_says_in_words_why_it_failed_and_whether_it_is_low_confidence(admin_client):
    job = job_with_rows(user("alice"))
    failed = job.rows.get(index=1)
    JobRow.objects.filter(pk=failed.pk).update(status=RowStatus.FAILED, error="empty text", input_error=True)
    page = admin_client.get(reverse("admin:jobs_jobrow_change", args=[failed.pk])).content.decode()
    assert "its input: a retry leaves it" in page
    JobRow.objects.filter(pk=failed.pk).update(input_error=False, error="inference failed: CUDA out of memory")
    page = admin_client.get(reverse("admin:jobs_jobrow_change", args=[failed.pk])).content.decode()
    assert "the run: a retry runs it again" in page
    # Low confidence in words, not the admin's green tick that read as "fine" on the rows to look at.
    low = job.rows.get(index=0)
    JobRow.objects.filter(pk=low.pk).update(low_confidence=True)
    page = admin_client.get(reverse("admin:jobs_jobrow_change", args=[low.pk])).content.decode()
    assert "icon-yes.svg" not in page and "flagged for review" in page
