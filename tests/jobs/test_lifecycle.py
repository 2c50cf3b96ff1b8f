"""Job state in-process: stored-upload ingest, its reconciliation, and the transitions' guards.

Messages are never sent here: pytest-django runs each test in a transaction that is rolled back, so
the on_commit hooks that would enqueue ingests and chunks do not fire; the tests call the worker-side
functions directly instead.
"""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from jobs import lifecycle
from jobs.ingest import IngestError
from jobs.models import Chunk, ChunkStatus, Job, JobRow, JobStatus, RowStatus, UploadPart
from jobs.reconcile import MAX_INGEST_ATTEMPTS, reconcile
from tests.jobs.factories import user

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def small_limits(settings):
    settings.JOBS_CHUNK_ROWS = 50
    settings.JOBS_INGEST_BATCH_ROWS = 40
    settings.JOBS_MAX_ROWS = 5000
    settings.JOBS_MAX_INGESTING_PER_USER = 100
    # These tests drive the worker-side ingest themselves; a small file would otherwise be read in the request.
    settings.JOBS_INLINE_INGEST_BYTES = 0


def csv_bytes(rows: int) -> bytes:
    return b"key,text\n" + b"".join(f"k{i},text number {i}\n".encode() for i in range(rows))


def new_job(data: bytes, **fields) -> Job:
    owner = get_user_model().objects.filter(username="alice").first() or user("alice")
    return lifecycle.create_job(
        owner=owner, model="router", upload=io.BytesIO(data), filename="f.csv",
        text_column="text", id_column="key", **fields,
    )  # fmt: skip


def test_create_checks_the_start_and_stores_the_file(monkeypatch):
    monkeypatch.setattr(lifecycle, "UPLOAD_PART_BYTES", 1000)
    data = csv_bytes(300)
    job = new_job(data)
    assert job.status == JobStatus.INGESTING and job.upload_bytes == len(data)
    assert UploadPart.objects.filter(job=job).count() == -(-len(data) // 1000)
    assert not job.rows.exists()
    with pytest.raises(IngestError, match="text column 'body' not found"):
        lifecycle.create_job(owner=job.owner, model="router", upload=io.BytesIO(data), filename="f.csv",
                             text_column="body")  # fmt: skip
    assert Job.objects.count() == 1


def test_a_small_file_is_read_in_the_request_and_queued_at_once(settings):
    settings.JOBS_INLINE_INGEST_BYTES = 64 * 1024
    data = csv_bytes(120)
    job = new_job(data)
    assert (job.status, job.total_rows, job.upload_bytes) == ("queued", 120, len(data))
    assert job.chunks.count() == 3 and not UploadPart.objects.filter(job=job).exists()
    assert job.rows.filter(tokens__gt=0).count() == 120  # priced, as the fair share charges them
    settings.JOBS_MAX_ROWS = 100
    failed = new_job(csv_bytes(150))  # its problem past the checked start: the 202 already says so
    assert (failed.status, failed.error) == ("failed", "the file has more than 100 data rows, the limit per job")
    settings.JOBS_INLINE_INGEST_BYTES = len(data) - 1
    assert new_job(data).status == "ingesting"  # one byte over: read by a worker


def test_ingest_writes_rows_and_chunks_and_removes_the_upload(monkeypatch):
    monkeypatch.setattr(lifecycle, "UPLOAD_PART_BYTES", 1000)  # rows straddle the stored parts
    job = new_job(csv_bytes(120))
    lifecycle.run_ingest(job.pk)
    job.refresh_from_db()
    assert (job.status, job.total_rows, job.ingested_rows, job.ingested_bytes) == ("queued", 120, 120, job.upload_bytes)
    assert [r.text for r in job.rows.order_by("index")][:2] == ["text number 0", "text number 1"]
    assert [(c.first_index, c.end_index) for c in job.chunks.all()] == [(0, 50), (50, 100), (100, 120)]
    assert not UploadPart.objects.filter(job=job).exists()
    lifecycle.run_ingest(job.pk)  # a duplicate message changes nothing
    assert job.rows.count() == 120 and job.chunks.count() == 3


def test_a_problem_found_by_the_ingest_fails_the_job_and_keeps_no_rows(settings):
    settings.JOBS_MAX_ROWS = 100
    job = new_job(csv_bytes(150))  # the first rows pass the request's check
    lifecycle.run_ingest(job.pk)
    job.refresh_from_db()
    assert (job.status, job.error) == ("failed", "the file has more than 100 data rows, the limit per job")
    assert not job.rows.exists() and not UploadPart.objects.filter(job=job).exists()


def test_a_lost_ingest_is_queued_again_and_starts_over():
    job = new_job(csv_bytes(100))
    claimed = Job.claim_ingest(job.pk, stall_s=60)
    JobRow.objects.create(job=job, index=0, text="half-written by a worker that died")
    Job.objects.filter(pk=job.pk).update(ingest_progress_at=timezone.now() - timedelta(seconds=120))
    assert Job.claim_ingest(job.pk, stall_s=60 * 60) is None  # not stale for a patient claimer
    assert reconcile(stall_s=60)["ingests_requeued"] == 1
    lifecycle.run_ingest(job.pk)
    assert claimed.record_ingest(1, 10) is False  # the old worker, were it alive, would be told to stop
    job.refresh_from_db()
    assert job.status == "queued" and job.total_rows == 100 and job.ingest_attempts == 2
    assert job.rows.get(index=0).text == "text number 0"


def test_an_ingest_that_keeps_dying_or_lost_its_upload_fails_the_job():
    gone = new_job(csv_bytes(10))
    UploadPart.objects.filter(job=gone).delete()
    dying = new_job(csv_bytes(10))
    Job.objects.filter(pk=dying.pk).update(ingest_attempts=MAX_INGEST_ATTEMPTS, ingest_claimed_at=timezone.now())
    Job.objects.update(ingest_progress_at=timezone.now() - timedelta(seconds=120))
    assert reconcile(stall_s=60)["ingests_failed"] == 2
    gone.refresh_from_db()
    dying.refresh_from_db()
    assert gone.status == dying.status == "failed"
    assert "upload the file again" in gone.error and "stopped 3 times" in dying.error


def test_cancel_during_ingest_stops_it():
    job = new_job(csv_bytes(100))
    assert job.cancel()
    lifecycle.run_ingest(job.pk)
    job.refresh_from_db()
    assert job.status == "cancelled" and not job.rows.exists() and not job.chunks.exists()
    assert not job.cancel()  # already ended


def test_pending_rows_come_with_every_field_the_runner_reads(django_assert_num_queries):
    """A field left deferred costs a query per row when first read: 2,048 SELECTs per 1,024-row dispatch."""
    job = new_job(csv_bytes(100))
    lifecycle.run_ingest(job.pk)
    (chunk,) = Chunk.objects.claim([job.chunks.first().pk], stall_s=60)
    rows = lifecycle.pending_rows([chunk])
    assert len(rows) == 50
    with django_assert_num_queries(0):
        assert all(r.status == RowStatus.PENDING and r.attempts == 0 and r.text and r.job_id for r in rows)


def test_results_written_after_a_cancel_are_dropped():
    job = new_job(csv_bytes(100))
    lifecycle.run_ingest(job.pk)
    (chunk,) = Chunk.objects.claim([job.chunks.first().pk], stall_s=60)
    rows = lifecycle.pending_rows([chunk])
    first, rest = rows[:10], rows[10:20]
    for row in first + rest:
        row.status, row.output, row.label = RowStatus.DONE, {"label": "x"}, "x"
    fields = ["status", "output", "label"]
    assert JobRow.objects.complete(first, fields) == set()
    assert job.cancel() and job.done_rows == 10
    assert JobRow.objects.complete(rest, fields) == {job.pk}  # the writer learns of the cancel at once
    job.refresh_counts()
    assert job.done_rows == 10 == job.rows.filter(status=RowStatus.DONE).count()
    assert job.rows.filter(status=RowStatus.CANCELLED).count() == 90
    Chunk.objects.complete([chunk.pk])
    assert Chunk.objects.get(pk=chunk.pk).status == ChunkStatus.CANCELLED
    assert not job.finish() and Job.objects.get(pk=job.pk).status == "cancelled"


def test_one_user_may_have_only_so_many_uploads_being_read(settings):
    """Ingests run one at a time: one user's dozens of uploads must not queue every other user's behind."""
    settings.JOBS_MAX_INGESTING_PER_USER = 1
    first = new_job(csv_bytes(10))
    with pytest.raises(IngestError, match="already have 1 uploads being read") as refused:
        new_job(csv_bytes(10))
    assert refused.value.status == 429
    other = lifecycle.create_job(owner=user("bob"), model="router", upload=io.BytesIO(csv_bytes(10)),
                                 filename="f.csv", text_column="text")  # fmt: skip
    assert other.status == JobStatus.INGESTING, "another user is not held back"
    lifecycle.run_ingest(first.pk)  # once the first is read, the user may upload again
    assert new_job(csv_bytes(10)).status == JobStatus.INGESTING
