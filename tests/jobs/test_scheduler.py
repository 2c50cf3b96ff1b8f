"""The offline scheduler against the database (jobs/scheduler.py): which chunks it sends, when, and where a
waiting job stands.

No broker and no worker: the messages are caught where they leave (jobs/enqueue.py's Celery app), the
number of live offline children is given (scheduler.offline_children reads worker heartbeats in Redis),
and a worker taking a chunk is Chunk.objects.claim, as jobs/runner.py does before it refills.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import enqueue, lifecycle, scheduler
from jobs.models import Chunk, ChunkStatus, Job, JobRow, JobStatus, RowStatus, SchedulerState, UserShare
from jobs.reconcile import reconcile
from tests.jobs.factories import user

pytestmark = pytest.mark.django_db

ROWS = 128  # rows per chunk in these jobs


class FakeApp:
    """Celery's app as jobs/enqueue.py uses it: the run messages it would have sent, in order."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send_task(self, name: str, kwargs: dict | None = None, **_options) -> None:
        if name == enqueue.RUN_CHUNK:
            self.sent.append(kwargs)


@pytest.fixture(autouse=True)
def offline(monkeypatch, settings):
    """One live offline child, one chunk sent ahead of it, 100 rows/s; standings computed afresh."""
    settings.JOBS_PREFETCH_CHUNKS = 1
    app = FakeApp()
    monkeypatch.setattr(enqueue, "app", app)
    monkeypatch.setattr(scheduler, "offline_children", lambda: 1)
    monkeypatch.setattr(scheduler, "offline_rows_per_s", lambda: 100.0)
    scheduler._cache = None
    yield app
    scheduler._cache = None


@pytest.fixture
def committed(django_capture_on_commit_callbacks):
    """Run a call as if its transaction committed: the messages it queues after commit are sent."""

    def run(call, *args, **kwargs):
        with django_capture_on_commit_callbacks(execute=True):
            return call(*args, **kwargs)

    return run


def queued_job(owner, chunks: int, *, priority: str = "normal", rows: int = ROWS, cost_tokens: int = 1000) -> Job:
    """A job whose file has been read: its chunks wait in the database, none sent."""
    job = Job.objects.create(
        owner=owner,
        model="router",
        text_column="text",
        filename="t.csv",
        priority=priority,
        status=JobStatus.QUEUED,
        total_rows=chunks * rows,
    )
    now = timezone.now()
    Chunk.objects.bulk_create(
        Chunk(job=job, first_index=n * rows, end_index=(n + 1) * rows, enqueued_at=now, cost_tokens=cost_tokens)
        for n in range(chunks)
    )
    return job


def job_of(message: dict) -> int:
    return Chunk.objects.get(pk=message["chunk_id"]).job_id


def unsent(job: Job) -> int:
    return job.chunks.filter(status=ChunkStatus.QUEUED, dispatched_at__isnull=True).count()


def work_one(committed) -> int:
    """An offline child takes the oldest chunk sent to it, then refills (as jobs/runner.py does): the job of
    the chunk the scheduler sends next."""
    oldest = Chunk.objects.filter(status=ChunkStatus.QUEUED, dispatched_at__isnull=False).order_by(
        "dispatched_at", "pk"
    )
    assert Chunk.objects.claim([oldest.first().pk], stall_s=60)
    Chunk.objects.filter(status=ChunkStatus.RUNNING).update(status=ChunkStatus.DONE)
    assert committed(scheduler.refill) == 1
    return job_of(enqueue.app.sent[-1])


# Sending ---------------------------------------------------------------------------------------------


def test_refill_sends_the_prefetch_per_live_child_and_no_more(settings, monkeypatch, offline, committed):
    settings.JOBS_PREFETCH_CHUNKS = 2
    monkeypatch.setattr(scheduler, "offline_children", lambda: 3)
    job = queued_job(user("ann"), 20)
    assert committed(scheduler.refill) == 6
    first_six = list(job.chunks.order_by("first_index")[:6])
    assert offline.sent == [{"chunk_id": c.pk, "model": "router", "rows": ROWS} for c in first_six]
    assert all(c.dispatched_at is not None for c in Chunk.objects.filter(pk__in=[c.pk for c in first_six]))
    assert unsent(job) == 14
    # Nothing claimed: every place is still held, so a second refill (a reconciler tick) sends nothing.
    assert committed(scheduler.refill) == 0
    assert len(offline.sent) == 6


def test_a_claim_opens_a_place_and_a_new_user_takes_it_before_the_flood(committed, offline):
    flood = queued_job(user("ann"), 50)
    committed(scheduler.refill)
    assert [job_of(m) for m in offline.sent] == [flood.pk]
    small = queued_job(user("bob"), 2)
    assert committed(scheduler.refill) == 0  # the only place is held by ann's chunk
    # From here each chunk claimed lets one more through, in the policy's order: bob at once, then turns.
    sent_next = [work_one(committed) for _ in range(6)]
    assert sent_next == [small.pk, flood.pk, small.pk, flood.pk, flood.pk, flood.pk]
    assert SchedulerState.objects.get().state["users"], "the policy's state is kept between refills"


def test_a_high_priority_job_takes_the_places_beside_a_normal_flood(monkeypatch, committed, offline):
    monkeypatch.setattr(scheduler, "offline_children", lambda: 10)
    queued_job(user("ann"), 50)
    urgent = queued_job(user("bob"), 50, priority="high")
    assert committed(scheduler.refill) == 10
    # 400:20 bands: high gets every place but the one a newly busy normal band gets at its start.
    assert [job_of(m) for m in offline.sent].count(urgent.pk) == 9


def test_a_users_weight_set_by_staff_is_their_share_of_the_places(monkeypatch, committed, offline):
    monkeypatch.setattr(scheduler, "offline_children", lambda: 8)
    heavy, light = user("ann"), user("bob")
    UserShare.objects.create(user=heavy, weight=3.0)
    heavy_job, _ = queued_job(heavy, 50), queued_job(light, 50)
    committed(scheduler.refill)
    assert [job_of(m) for m in offline.sent].count(heavy_job.pk) == 6


def test_a_chunk_costing_more_tokens_counts_for_more(monkeypatch, committed, offline):
    monkeypatch.setattr(scheduler, "offline_children", lambda: 10)
    long_texts = queued_job(user("ann"), 50, cost_tokens=4000)
    queued_job(user("bob"), 50, cost_tokens=1000)
    committed(scheduler.refill)
    assert [job_of(m) for m in offline.sent].count(long_texts.pk) == 2  # a quarter of the chunks, within one


def test_a_cancelled_jobs_sent_chunks_no_longer_hold_places(settings, committed, offline):
    settings.JOBS_PREFETCH_CHUNKS = 2
    doomed = queued_job(user("ann"), 10)
    committed(scheduler.refill)
    waiting = queued_job(user("bob"), 5)
    assert committed(scheduler.refill) == 0
    # The cancel's end-of-job signal refills after commit: bob's chunks take the two places.
    assert committed(lifecycle.cancel, doomed)
    assert [job_of(m) for m in offline.sent] == [doomed.pk, doomed.pk, waiting.pk, waiting.pk]
    assert committed(scheduler.refill) == 0


def test_retried_rows_wait_unsent_and_are_sent_in_their_turn(committed, offline):
    owner = user("ann")
    ended = queued_job(owner, 2, rows=2)
    JobRow.objects.bulk_create(
        JobRow(job=ended, index=i, text=f"t{i}", status=RowStatus.FAILED if i == 3 else RowStatus.DONE)
        for i in range(4)
    )
    ended.chunks.update(status=ChunkStatus.DONE, dispatched_at=timezone.now())
    Job.objects.filter(pk=ended.pk).update(status=JobStatus.PARTIAL, finished_at=timezone.now())
    ended.refresh_from_db()
    running = queued_job(user("bob"), 5)
    committed(scheduler.refill)  # bob's chunk holds the only place

    assert committed(lifecycle.retry_failed, ended) == 1
    retried = ended.chunks.get(first_index=2)
    assert (retried.status, retried.dispatched_at) == (ChunkStatus.QUEUED, None)
    assert work_one(committed) == ended.pk  # the next place goes to the retried chunk, not to bob's next
    assert offline.sent[-1]["chunk_id"] == retried.pk
    assert running.pk == job_of(offline.sent[0])


def test_the_reconciler_takes_back_a_chunk_whose_message_was_lost_and_sends_it_again(committed, offline):
    job = queued_job(user("ann"), 3)
    committed(scheduler.refill)
    lost = job.chunks.get(dispatched_at__isnull=False)
    Chunk.objects.filter(pk=lost.pk).update(dispatched_at=timezone.now() - timedelta(seconds=300))

    counts = committed(reconcile, stall_s=60)
    assert (counts["queued_requeued"], counts["chunks_sent"]) == (1, 1)
    assert [m["chunk_id"] for m in offline.sent] == [lost.pk, lost.pk]  # the same chunk: it is first in row order
    lost.refresh_from_db()
    assert lost.dispatched_at > timezone.now() - timedelta(seconds=60)
    # Sent again just now: the next tick leaves it alone.
    assert committed(reconcile, stall_s=60)["queued_requeued"] == 0
    assert len(offline.sent) == 2


# Where a waiting job stands --------------------------------------------------------------------------


def test_a_new_users_job_stands_first_and_its_eta_counts_what_is_ahead(committed):
    flood = queued_job(user("ann"), 10)
    committed(scheduler.refill)  # ann's first chunk is sent: 128 rows in flight
    small = queued_job(user("bob"), 2, rows=50)
    waiting, rate = scheduler.standings()
    assert rate == 100.0
    # Bob's two chunks go at once and after one of ann's: 128 of ann's rows ahead of bob's last chunk,
    # and 128 in flight + 50 + 128 + 50 rows until it is handed out, at 100 rows/s.
    assert waiting[small.pk] == scheduler.Standing(
        chunks_ahead=0,
        rows_ahead=128,
        eta_s=pytest.approx(3.56),
        waiting_reason=waiting[small.pk].waiting_reason,
    )
    assert waiting[small.pk].waiting_reason.startswith("sharing the offline workers with 1 other user")
    # Ann's 9 waiting chunks: bob's one goes first, bob's 100 rows are ahead of her last.
    assert (waiting[flood.pk].chunks_ahead, waiting[flood.pk].rows_ahead) == (1, 100)
    assert waiting[flood.pk].eta_s == pytest.approx((128 + 100 + 9 * 128) / 100)


def test_the_reason_for_one_other_user_reads_as_english():
    queued_job(user("ann"), 3)
    small = queued_job(user("bob"), 1)
    reason = scheduler.standings()[0][small.pk].waiting_reason
    assert reason == "sharing the offline workers with 1 other user's jobs of normal priority"


def test_a_job_below_higher_priorities_says_how_many_wait_above_it():
    queued_job(user("ann"), 3, priority="high")
    queued_job(user("cat"), 3, priority="high")
    below = queued_job(user("bob"), 2)
    lowest = queued_job(user("dan"), 2, priority="low")
    waiting, _ = scheduler.standings()
    assert waiting[below.pk].waiting_reason == "waiting: 2 jobs of higher priority"
    assert waiting[lowest.pk].waiting_reason == "waiting: 3 jobs of higher priority"


def test_a_users_jobs_share_their_owners_share():
    owner = user("ann")
    queued_job(owner, 3)
    second = queued_job(owner, 3)
    assert scheduler.standings()[0][second.pk].waiting_reason == "sharing its owner's share with 1 other job of theirs"


def test_a_lone_job_has_nothing_ahead_and_no_reason_to_wait():
    alone = queued_job(user("ann"), 4)
    assert scheduler.standing_of(alone) == scheduler.Standing(0, 0, pytest.approx(4 * 128 / 100), "")


def test_without_a_measured_rate_there_is_no_eta(monkeypatch):
    monkeypatch.setattr(scheduler, "offline_rows_per_s", lambda: 0.0)
    job = queued_job(user("ann"), 4)
    assert scheduler.standing_of(job).eta_s is None


def test_a_job_with_every_chunk_sent_stands_at_the_front(monkeypatch, committed):
    monkeypatch.setattr(scheduler, "offline_children", lambda: 5)
    job = queued_job(user("ann"), 2)
    committed(scheduler.refill)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING)
    job.refresh_from_db()
    assert scheduler.standing_of(job) == scheduler.Standing(0, 0, pytest.approx(2 * 128 / 100), "")


def test_a_job_sent_after_another_jobs_chunks_counts_them_in_its_eta(monkeypatch, committed):
    monkeypatch.setattr(scheduler, "offline_children", lambda: 1)  # one place: the big job's chunk takes it
    big = queued_job(user("ann"), 10)
    committed(scheduler.refill)
    small = queued_job(user("bob"), 1)
    Chunk.objects.filter(job=big, dispatched_at__isnull=False).update(status=ChunkStatus.RUNNING)  # claimed
    committed(scheduler.refill)  # the small job's one chunk goes next, behind the big one's running chunk
    Job.objects.filter(pk__in=[big.pk, small.pk]).update(status=JobStatus.RUNNING)
    small.refresh_from_db()
    assert scheduler.standing_of(small) == scheduler.Standing(0, 128, pytest.approx((128 + 128) / 100), "")


def test_the_api_shows_where_a_waiting_job_stands(committed):
    ann, bob = user("ann"), user("bob")
    queued_job(ann, 10, priority="high")
    mine = queued_job(bob, 2)
    client = APIClient()
    client.force_authenticate(bob)
    shown = client.get(f"/api/v1/jobs/{mine.pk}").json()
    assert shown["priority"] == "normal"
    assert shown["waiting_reason"] == "waiting: 1 job of higher priority"
    # Fresh state: one high chunk, then the newly busy normal band's first, then every other high chunk
    # (the normal band's next turn comes after 20 of them, 400:20) before bob's second.
    assert (shown["chunks_ahead"], shown["rows_ahead"]) == (1, 10 * 128)
    assert shown["eta_s"] == round((12 * 128) / 100, 1)


def test_a_job_queued_after_the_standings_were_computed_gets_its_own_not_the_front(monkeypatch):
    monkeypatch.setattr(scheduler, "offline_children", lambda: 1)
    queued_job(user("ann"), 10)
    scheduler.standings()  # computed (and cached) before bob's job exists
    late = queued_job(user("bob"), 1)
    standing = scheduler.standing_of(late)
    assert standing.waiting_reason == "sharing the offline workers with 1 other user's jobs of normal priority"
    # Not "all sent, nothing ahead" (its own 128 rows alone, 1.28 s): ann's next chunk goes first.
    assert (standing.chunks_ahead, standing.rows_ahead, standing.eta_s) == (1, 128, pytest.approx(2 * 128 / 100))
