"""Review in Django admin: job list with progress and actions, low-confidence rows, corrections in the export."""

from __future__ import annotations

import csv
import io
import re

import pytest
import redis
from django.urls import reverse

from jobs import quotas, scheduler
from jobs.models import Chunk, Job, JobRow, JobStatus, Priority, RowStatus, UserShare
from tests.conftest import own_redis_database
from tests.jobs.factories import job_with_rows, user

pytestmark = pytest.mark.django_db
DB = 14  # this module's own Redis database (the job page reads the offline rate for its time left)


@pytest.fixture(autouse=True)
def own_redis(settings, redis_url, monkeypatch) -> redis.Redis:
    """An empty Redis database of this module's own, and no standing cached by an earlier test."""
    monkeypatch.setattr(scheduler, "_cache", None)
    yield from own_redis_database(settings, redis_url, monkeypatch, DB)


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


def waiting_job(owner, priority: str = Priority.NORMAL, chunks: int = 3) -> Job:
    job = Job.objects.create(owner=owner, model="router", text_column="text", filename=f"{owner}.csv",
                             status=JobStatus.QUEUED, priority=priority, total_rows=chunks * 10)  # fmt: skip
    Chunk.objects.bulk_create(
        Chunk(job=job, first_index=c * 10, end_index=(c + 1) * 10, cost_tokens=100) for c in range(chunks)
    )
    return job


def test_staff_raise_a_jobs_priority_and_nothing_else_is_written(admin_client, monkeypatch):
    alice_job = waiting_job(user("alice"))
    bob_job = waiting_job(user("bob"))
    changelist = reverse("admin:jobs_job_changelist")
    listed = admin_client.get(changelist)
    assert listed.status_code == 200 and "column-priority" in listed.content.decode()
    assert admin_client.get(changelist, {"priority__exact": "high"}).context["cl"].result_count == 0

    page = admin_client.get(reverse("admin:jobs_job_change", args=[bob_job.pk])).content.decode()
    assert re.search(r"<select name=\"priority\"", page) and "Where it stands" in page
    # A worker moves the job on while the form is open: saving the priority must not write back the old status.
    Job.objects.filter(pk=bob_job.pk).update(status=JobStatus.RUNNING, done_rows=10)
    saved = admin_client.post(
        reverse("admin:jobs_job_change", args=[bob_job.pk]), {"priority": "high", "_save": "Save"}
    )
    assert saved.status_code == 302
    bob_job.refresh_from_db()
    assert (bob_job.priority, bob_job.status, bob_job.done_rows) == ("high", JobStatus.RUNNING, 10)
    assert admin_client.get(changelist, {"priority__exact": "high"}).context["cl"].result_count == 1

    # The scheduler goes by it: alice's job now waits for bob's (once the standings cached for 2 s are renewed).
    monkeypatch.setattr(scheduler, "_cache", None)
    assert scheduler.standing_of(alice_job).waiting_reason == "waiting: 1 job of higher priority"


def test_staff_lower_a_priority_from_the_list(admin_client):
    job = waiting_job(user("alice"))
    form = {"form-TOTAL_FORMS": "1", "form-INITIAL_FORMS": "1", "form-0-id": str(job.pk), "form-0-priority": "low",
            "_save": "Save"}  # fmt: skip
    assert admin_client.post(reverse("admin:jobs_job_changelist"), form).status_code == 302
    job.refresh_from_db()
    assert job.priority == Priority.LOW and job.status == JobStatus.QUEUED


def test_user_shares_are_set_and_searched_in_the_admin(admin_client):
    alice, bob = user("alice"), user("bob")
    waiting_job(alice, chunks=2)
    added = admin_client.post(
        reverse("admin:jobs_usershare_add"),
        {"user": alice.pk, "weight": "3", "max_priority": "high", "max_queued_rows": "", "max_unfinished_jobs": "5"},
    )
    assert added.status_code == 302, added.content.decode()[:2000]
    UserShare.objects.create(user=bob, weight=0.5)
    share = quotas.share_of(alice)
    assert (share.weight, share.max_priority, share.max_unfinished_jobs) == (3.0, "high", 5)

    changelist = reverse("admin:jobs_usershare_changelist")
    html = admin_client.get(changelist).content.decode()
    # Empty fields say which default applies; the use the quotas are checked against is beside them.
    assert "default (2,000,000)" in html and "1 job · 20 rows" in html
    found = admin_client.get(changelist, {"q": "ali"}).context["cl"].result_list
    assert [s.user.username for s in found] == ["alice"]
    form = admin_client.get(reverse("admin:jobs_usershare_change", args=[share_id(alice)])).content.decode()
    assert "empty: 2,000,000 (settings)" in form


def share_id(person) -> int:
    return UserShare.objects.get(user=person).pk
