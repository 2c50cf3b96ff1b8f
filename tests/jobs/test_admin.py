"""Review in Django admin: job list with progress and actions, low-confidence rows, corrections in the export."""

from __future__ import annotations

import csv
import io

import pytest
from django.urls import reverse

from jobs.models import Job, JobRow, JobStatus, RowStatus
from tests.jobs.factories import job_with_rows, user

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client(client):
    client.force_login(user("reviewer", staff=True))
    return client


def export_of(response) -> list[dict]:
    text = b"".join(response.streaming_content).decode()
    return list(csv.DictReader(io.StringIO(text)))


def test_job_list_shows_progress_and_filters(admin_client):
    job = job_with_rows(user("alice"))
    page = admin_client.get(reverse("admin:jobs_job_changelist"), {"status__exact": "succeeded"})
    assert page.status_code == 200
    html = page.content.decode()
    assert "4 / 4" in html and "t.csv" in html and "low confidence" in html
    assert (
        admin_client.get(reverse("admin:jobs_job_changelist"), {"status__exact": "failed"}).context["cl"].result_count
        == 0
    )
    assert admin_client.get(reverse("admin:jobs_job_changelist"), {"q": "alice"}).context["cl"].result_count == 1
    assert job.pk in [j.pk for j in page.context["cl"].result_list]


def test_low_confidence_rows_can_be_corrected_and_the_export_carries_both_labels(admin_client):
    job = job_with_rows(user("alice"))
    changelist = reverse("admin:jobs_jobrow_changelist")
    flagged = admin_client.get(changelist, {"job__id__exact": job.pk, "low_confidence__exact": "1"})
    rows = list(flagged.context["cl"].result_list)
    assert [r.index for r in rows] == [1, 3]

    row = rows[0]
    response = admin_client.post(
        reverse("admin:jobs_jobrow_change", args=[row.pk]), {"corrected_label": "account", "_save": "Save"}
    )
    assert response.status_code == 302
    row.refresh_from_db()
    assert row.corrected_label == "account" and row.reviewed_by.username == "reviewer" and row.reviewed_at

    exported = admin_client.post(
        reverse("admin:jobs_job_changelist"), {"action": "export_results", "_selected_action": [job.pk]}
    )
    by_index = {int(r["index"]): r for r in export_of(exported)}
    assert (by_index[1]["label"], by_index[1]["corrected_label"], by_index[1]["reviewed"]) == (
        "shipping",
        "account",
        "yes",
    )
    assert by_index[0]["corrected_label"] == ""


def test_mark_reviewed_action(admin_client):
    job = job_with_rows(user("alice"))
    ids = list(job.rows.filter(low_confidence=True).values_list("pk", flat=True))
    admin_client.post(reverse("admin:jobs_jobrow_changelist"), {"action": "mark_reviewed", "_selected_action": ids})
    assert JobRow.objects.filter(pk__in=ids, reviewed_by__username="reviewer").count() == 2


def test_cancel_and_retry_actions(admin_client):
    running = job_with_rows(user("alice"), status=JobStatus.RUNNING)
    admin_client.post(reverse("admin:jobs_job_changelist"), {"action": "cancel_jobs", "_selected_action": [running.pk]})
    assert Job.objects.get(pk=running.pk).status == JobStatus.CANCELLED

    ended = job_with_rows(user("bob"))
    JobRow.objects.filter(job=ended, index=2).update(status=RowStatus.FAILED, error="inference failed: boom")
    admin_client.post(
        reverse("admin:jobs_job_changelist"), {"action": "retry_failed_rows", "_selected_action": [ended.pk]}
    )
    ended.refresh_from_db()
    assert ended.status == JobStatus.QUEUED
    assert list(ended.rows.filter(status=RowStatus.PENDING).values_list("index", flat=True)) == [2]


def test_non_staff_cannot_open_the_admin(client):
    client.force_login(user("carol"))
    assert client.get(reverse("admin:jobs_job_changelist")).status_code == 302
