"""A user's offline share and quotas (jobs/quotas.py): what a user is refused, why, and what the message
tells them to do; first as plain functions, then as the API answers them.

In-process: pytest-django rolls each test's transaction back, so the ingest that create_job queues after
commit never runs unless a test calls lifecycle.run_ingest itself.
"""

from __future__ import annotations

import io

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from jobs import lifecycle, quotas
from jobs.ingest import IngestError
from jobs.models import Job, JobStatus, UserShare
from jobs.quotas import QuotaExceeded
from tests.jobs.factories import user

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def small_quotas(settings):
    settings.JOBS_MAX_UNFINISHED_JOBS_PER_USER = 2
    settings.JOBS_MAX_QUEUED_ROWS_PER_USER = 1000
    settings.JOBS_DEFAULT_MAX_PRIORITY = "normal"
    settings.JOBS_DEFAULT_WEIGHT = 1.0
    settings.JOBS_MAX_INGESTING_PER_USER = 100
    settings.JOBS_CHUNK_ROWS = 50


def job(owner, status: str = JobStatus.RUNNING, *, total: int = 0, done: int = 0, failed: int = 0, read: int = 0):
    return Job.objects.create(
        owner=owner, model="router", text_column="text", filename="t.csv", status=status,
        total_rows=total, done_rows=done, failed_rows=failed, ingested_rows=read,
    )  # fmt: skip


def refusal(owner) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as caught:
        quotas.check_new_job(owner, quotas.share_of(owner))
    assert caught.value.status == 429
    return caught.value


def csv_bytes(rows: int) -> bytes:
    return b"key,text\n" + b"".join(f"k{i},text number {i}\n".encode() for i in range(rows))


# Shares ----------------------------------------------------------------------------------------------


def test_a_user_without_a_share_gets_the_settings_defaults():
    assert quotas.share_of(user("ann")) == quotas.Share(
        weight=1.0, max_priority="normal", max_queued_rows=1000, max_unfinished_jobs=2
    )


def test_staff_overrides_replace_only_the_fields_they_set():
    ann = user("ann")
    UserShare.objects.create(user=ann, weight=3.0, max_priority="high", max_queued_rows=5000)
    assert quotas.share_of(ann) == quotas.Share(
        weight=3.0, max_priority="high", max_queued_rows=5000, max_unfinished_jobs=2
    )
    bob = user("bob")
    UserShare.objects.create(user=bob, max_unfinished_jobs=0, max_queued_rows=0)
    assert quotas.share_of(bob) == quotas.Share(
        weight=1.0, max_priority="normal", max_queued_rows=0, max_unfinished_jobs=0
    )


# Unfinished jobs -------------------------------------------------------------------------------------


def test_at_the_unfinished_jobs_quota_a_new_job_is_refused_naming_it_the_use_and_what_to_do():
    ann = user("ann")
    job(ann, JobStatus.QUEUED)
    job(ann, JobStatus.INGESTING)
    for ended in (JobStatus.SUCCEEDED, JobStatus.PARTIAL, JobStatus.FAILED, JobStatus.CANCELLED):
        job(ann, ended)  # ended jobs do not count
    job(user("bob"), JobStatus.RUNNING)  # nor do other users'
    refused = refusal(ann)
    assert refused.code == "quota_unfinished_jobs"
    assert refused.message == (
        "quota of unfinished jobs reached: you have 2 jobs not yet ended and may have at most 2; "
        "wait until one ends, or cancel one, then upload again"
    )


def test_below_the_unfinished_jobs_quota_a_new_job_is_taken():
    ann = user("ann")
    job(ann, JobStatus.RUNNING, total=10)
    quotas.check_new_job(ann, quotas.share_of(ann))


def test_a_staff_override_of_unfinished_jobs_applies_either_way():
    ann, bob = user("ann"), user("bob")
    job(ann, JobStatus.QUEUED)
    job(ann, JobStatus.QUEUED)
    UserShare.objects.create(user=ann, max_unfinished_jobs=3)
    quotas.check_new_job(ann, quotas.share_of(ann))
    UserShare.objects.create(user=bob, max_unfinished_jobs=0)
    assert "may have at most 0" in refusal(bob).message


# Queued rows -----------------------------------------------------------------------------------------


def test_at_the_queued_rows_quota_a_new_job_is_refused_naming_it_the_use_and_what_to_do(settings):
    settings.JOBS_MAX_UNFINISHED_JOBS_PER_USER = 10
    ann = user("ann")
    job(ann, JobStatus.RUNNING, total=700, done=150, failed=50)  # 500 rows still to run
    job(ann, JobStatus.INGESTING, read=300)  # rows read so far of a file being read
    job(ann, JobStatus.QUEUED, total=200)
    job(ann, JobStatus.SUCCEEDED, total=5000, done=5000)  # done: counts for nothing
    refused = refusal(ann)
    assert refused.code == "quota_queued_rows"
    assert refused.message == (
        "quota of queued rows reached: you have 1000 rows waiting or running and may have at most 1000; "
        "wait until some are done, or cancel a job, then upload again"
    )


def test_below_the_queued_rows_quota_or_with_a_bigger_one_a_new_job_is_taken(settings):
    settings.JOBS_MAX_UNFINISHED_JOBS_PER_USER = 10
    ann = user("ann")
    job(ann, JobStatus.RUNNING, total=999)
    quotas.check_new_job(ann, quotas.share_of(ann))
    job(ann, JobStatus.INGESTING, read=1)
    assert refusal(ann).code == "quota_queued_rows"
    UserShare.objects.create(user=ann, max_queued_rows=5000)
    quotas.check_new_job(ann, quotas.share_of(ann))


def test_a_file_that_takes_its_owner_past_the_queued_rows_quota_is_refused_once_read():
    ann = user("ann")
    job(ann, JobStatus.RUNNING, total=800)
    reading = job(ann, JobStatus.INGESTING, read=150)
    quotas.check_ingested(reading, 200)  # exactly the quota: taken
    with pytest.raises(QuotaExceeded) as caught:
        quotas.check_ingested(reading, 201)
    assert caught.value.code == "quota_queued_rows" and caught.value.status == 429
    assert caught.value.message == (
        "quota of queued rows: this file has 201 rows and you had 800 rows waiting or running; together they "
        "pass your quota of 1000: split the file, or upload it once your other jobs are done"
    )


def test_the_ingest_of_a_file_past_the_quota_fails_its_job_with_the_quota_message():
    ann = user("ann")
    job(ann, JobStatus.RUNNING, total=900)
    big = lifecycle.create_job(
        owner=ann, model="router", upload=io.BytesIO(csv_bytes(120)), filename="f.csv", text_column="text"
    )
    lifecycle.run_ingest(big.pk)
    big.refresh_from_db()
    assert big.status == JobStatus.FAILED
    assert big.error.startswith("quota of queued rows: this file has 120 rows and you had 900 rows")
    assert not big.rows.exists() and not big.chunks.exists()


# Priority --------------------------------------------------------------------------------------------


def test_a_priority_above_the_users_highest_is_refused_naming_it():
    share = quotas.share_of(user("ann"))
    quotas.check_priority(share, "normal")
    quotas.check_priority(share, "low")
    with pytest.raises(IngestError) as caught:
        quotas.check_priority(share, "high")
    assert caught.value.field == "priority" and caught.value.status == 400
    assert caught.value.message == (
        "priority 'high' is above your highest allowed priority ('normal'); use that or lower, or ask staff to raise it"
    )


def test_staff_may_raise_or_lower_a_users_highest_priority():
    ann, bob = user("ann"), user("bob")
    UserShare.objects.create(user=ann, max_priority="high")
    quotas.check_priority(quotas.share_of(ann), "high")
    UserShare.objects.create(user=bob, max_priority="low")
    with pytest.raises(IngestError, match=r"priority 'normal' is above your highest allowed priority \('low'\)"):
        quotas.check_priority(quotas.share_of(bob), "normal")


def test_an_unknown_priority_names_the_ones_there_are():
    with pytest.raises(IngestError, match="unknown priority 'urgent'; one of: high, normal, low"):
        quotas.check_priority(quotas.share_of(user("ann")), "urgent")


# Through the API -------------------------------------------------------------------------------------


@pytest.fixture
def api(settings):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    ann = user("ann")
    client = APIClient()
    client.force_authenticate(ann)
    client.owner = ann
    return client


def upload(api, **fields: str):
    form = {"file": SimpleUploadedFile("rows.csv", csv_bytes(5)), "text_column": "text", **fields}
    return api.post("/api/v1/jobs", form, format="multipart")


def test_api_over_the_queued_rows_quota_is_a_429_with_the_quotas_code(api):
    job(api.owner, JobStatus.RUNNING, total=1000)
    response = upload(api)
    assert response.status_code == 429, response.content
    body = response.json()
    assert body["code"] == "quota_queued_rows"
    assert body["detail"].startswith("quota of queued rows reached: you have 1000 rows")
    assert "Retry-After" not in response  # when is up to the user's own jobs, which the message says
    assert Job.objects.filter(owner=api.owner).count() == 1


def test_api_over_the_unfinished_jobs_quota_is_a_429_with_the_quotas_code(api):
    assert upload(api).status_code == 202
    assert upload(api).status_code == 202
    response = upload(api)
    assert response.status_code == 429, response.content
    assert response.json()["code"] == "quota_unfinished_jobs"
    assert "you have 2 jobs not yet ended and may have at most 2" in response.json()["detail"]


def test_api_priority_above_the_users_highest_is_a_400_keyed_priority(api):
    response = upload(api, priority="high")
    assert response.status_code == 400, response.content
    assert "above your highest allowed priority ('normal')" in response.json()["errors"]["priority"][0]
    assert not Job.objects.exists()
    UserShare.objects.create(user=api.owner, max_priority="high")
    created = upload(api, priority="high")
    assert created.status_code == 202, created.content
    assert created.json()["priority"] == "high"
    assert upload(api).json()["priority"] == "normal"
