"""The offline scheduler: hands chunks to the broker in the order the fair-share policy chooses.

A job's chunks wait in the database (status queued, `dispatched_at` empty) until `refill` picks them
(jobs/fairshare.py decides which). Only JOBS_PREFETCH_CHUNKS chunks per live offline child are sent
ahead of the children, so the broker never holds a backlog in arrival order: a user who uploads
after a 1,000,000-row job waits for at most the chunks already sent, not for the whole job.

`refill` runs whenever a place may have opened or new work may compete for it: a worker child claims
chunks (jobs/runner.py), a job is queued or requeued (jobs/lifecycle.py), a job ends (the job_ended
signal), and on every reconciler tick (jobs/reconcile.py), which also takes back chunks whose message
was lost. It holds the SchedulerState row's lock while it picks, so pickers on several hosts take
turns and the policy's state (its virtual times) stays consistent.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Max, Sum
from django.utils import timezone

from inference.core.keys import WORKERS_KEY
from inference.core.workers import alive_workers
from jobs import enqueue, fairshare
from jobs.models import RUNNABLE, Chunk, ChunkStatus, Job, SchedulerState, UserShare
from platform_.redis import get_redis

logger = logging.getLogger(__name__)
_STATE_PK = 1


def band_weights() -> dict[str, float]:
    return dict(settings.JOBS_PRIORITY_WEIGHTS)


def offline_children() -> int:
    """Offline worker children alive on every host (their heartbeats); 1 when none is seen or Redis is down,
    so that chunks are waiting in the broker for the first child that starts."""
    try:
        raw = get_redis().hgetall(WORKERS_KEY)
    except redis.RedisError:
        return 1
    alive = alive_workers(raw, settings.WORKER_HEARTBEAT_S)
    return max(1, sum(1 for entry in alive if entry.get("queue") == "offline"))


def prefetch_limit() -> int:
    """Most chunks sent to the broker and not yet claimed by a child."""
    return offline_children() * max(1, settings.JOBS_PREFETCH_CHUNKS)


def weights_of(owner_ids: set[int]) -> dict[int, float]:
    shares = dict(UserShare.objects.filter(user_id__in=owner_ids).values_list("user_id", "weight"))
    return {owner: max(float(shares.get(owner, settings.JOBS_DEFAULT_WEIGHT)), 1e-3) for owner in owner_ids}


def waiting_queues() -> list[fairshare.JobQueue]:
    """Each runnable job's chunks not yet sent: how many, and their mean cost in tokens and rows."""
    groups = list(
        Chunk.objects.filter(status=ChunkStatus.QUEUED, dispatched_at__isnull=True, job__status__in=RUNNABLE)
        .values("job_id", "job__owner_id", "job__priority")
        .annotate(chunks=Count("pk"), cost=Sum("cost_tokens"), rows=Sum(F("end_index") - F("first_index")))
        .order_by("job_id")
    )
    weights = weights_of({g["job__owner_id"] for g in groups})
    return [
        fairshare.JobQueue(
            job_id=g["job_id"],
            owner=g["job__owner_id"],
            band=g["job__priority"],
            weight=weights[g["job__owner_id"]],
            chunks=g["chunks"],
            cost_per_chunk=(g["cost"] or 0) / g["chunks"],
            rows_per_chunk=(g["rows"] or 0) / g["chunks"],
        )
        for g in groups
    ]


def sent_ahead() -> int:
    """Chunks sent to the broker that no child has claimed yet."""
    return Chunk.objects.filter(
        status=ChunkStatus.QUEUED, dispatched_at__isnull=False, job__status__in=RUNNABLE
    ).count()


# How long a picker waits for another's turn: the web's cancel calls refill too, and must not hang behind a
# picker that stopped (a frozen or cut-off worker); what gives up is retried by the reconciler's next tick.
_LOCK_WAIT_MS = 3_000
# A picker stopped while holding the lock loses its database session, and the lock, after this: until then
# no process can hand out chunks (seen on the live stack: a SIGSTOPped worker's reconciler held it).
_HOLDER_IDLE_MS = 10_000


def _bound_lock_waits() -> None:
    """PostgreSQL: bound both sides of the scheduler's lock, for this transaction only."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('lock_timeout', %s, true), set_config('idle_in_transaction_session_timeout', %s, true)",
            [f"{_LOCK_WAIT_MS}ms", f"{_HOLDER_IDLE_MS}ms"],
        )


def _locked_state() -> SchedulerState:
    row = SchedulerState.objects.select_for_update().filter(pk=_STATE_PK).first()
    if row is None:
        SchedulerState.objects.get_or_create(pk=_STATE_PK)
        row = SchedulerState.objects.select_for_update().get(pk=_STATE_PK)
    return row


def refill() -> int:
    """Send the chunks the policy picks until the prefetch limit is reached; how many were sent."""
    limit = prefetch_limit()  # Redis is read before the lock is taken
    outermost = not connection.in_atomic_block  # the bounds last as long as the transaction: only our own
    with transaction.atomic():
        if outermost:
            _bound_lock_waits()
        row = _locked_state()
        places = limit - sent_ahead()
        if places <= 0:
            return 0
        queues = waiting_queues()
        state = fairshare.ShareState.from_json(row.state)
        if not queues:
            if row.state:  # idle: the next busy period starts from a clean slate
                row.state = {}
                row.save(update_fields=["state", "updated_at"])
            return 0
        picks = fairshare.pick(state, queues, places, band_weights())
        chunks = _chunks_for(picks)
        now = timezone.now()
        Chunk.objects.filter(pk__in=[c.pk for c in chunks]).update(dispatched_at=now, enqueued_at=now)
        row.state = state.as_json()
        row.save(update_fields=["state", "updated_at"])
        enqueue.chunks_after_commit({"chunk_id": c.pk, "model": c.job.model, "rows": c.size} for c in chunks)
    return len(chunks)


def _chunks_for(picks: list[fairshare.Pick]) -> list[Chunk]:
    """The chunks behind the picks: each job's next ones by row order, in the order the jobs were picked."""
    wanted = Counter(p.job_id for p in picks)
    by_job: dict[int, list[Chunk]] = {}
    for job_id, count in wanted.items():
        by_job[job_id] = list(
            Chunk.objects.filter(job_id=job_id, status=ChunkStatus.QUEUED, dispatched_at__isnull=True)
            .select_related("job")
            .order_by("first_index")[:count]
        )
    ordered = []
    for p in picks:
        if by_job.get(p.job_id):
            ordered.append(by_job[p.job_id].pop(0))
    return ordered


def refill_quietly() -> None:
    """refill, for callers whose own work must not fail with it (the reconciler picks up what this misses)."""
    try:
        refill()
    except Exception:
        logger.warning("offline scheduler: refill failed; the reconciler will retry", exc_info=True)
        if not connection.in_atomic_block:  # a session ended by _HOLDER_IDLE_MS: reconnect at the next query
            connection.close_if_unusable_or_obsolete()


def refill_after_commit() -> None:
    transaction.on_commit(refill_quietly)


def on_job_ended(job: Job, **_: Any) -> None:
    """A job ended: its chunks sent ahead (if cancelled) no longer hold places, which go to other jobs."""
    refill_after_commit()


# Where jobs stand ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Standing:
    """A waiting or running job's place in the offline backlog, as the API and pages show it."""

    chunks_ahead: int | None  # other jobs' chunks to be handed out before this job's next one
    rows_ahead: int | None  # other jobs' rows handed out before this job's last chunk
    eta_s: float | None  # from the measured offline rate; None while no rate is known
    waiting_reason: str  # empty when the job is running with nothing ahead of it


_cache: tuple[float, dict[int, Standing], float] | None = None
# The forecast simulates every waiting chunk: computed once for every job, and reused this long.
_STANDING_TTL_S = 3.0


def _has_unsent_chunks(job: Job) -> bool:
    return Chunk.objects.filter(job=job, status=ChunkStatus.QUEUED, dispatched_at__isnull=True).exists()


def standings(fresh: bool = False) -> tuple[dict[int, Standing], float]:
    """Every waiting job's standing, and the offline rows/s they were computed with (cached for a moment:
    pages poll, and the forecast is of the whole backlog); `fresh` computes them again now."""
    global _cache
    now = time.monotonic()
    if fresh or _cache is None or now - _cache[0] >= _STANDING_TTL_S:
        rate = offline_rows_per_s()
        _cache = (now, _compute_standings(rate), rate)
    return _cache[1], _cache[2]


def standing_of(job: Job) -> Standing | None:
    """A queued or running job's standing; None for a job being read or ended."""
    if job.status not in RUNNABLE:
        return None
    waiting, rate = standings()
    if job.pk not in waiting and _has_unsent_chunks(job):  # queued after the standings were computed
        waiting, rate = standings(fresh=True)
    if job.pk in waiting:
        return waiting[job.pk]
    # Nothing of it waits: its last chunks are sent or running, behind the other jobs' chunks sent before
    # them (a small job arriving beside a big one waits for the big one's batch in progress and the chunk
    # sent ahead: its ETA says so, not only its own rows' time).
    remaining = job.total_rows - job.done_rows - job.failed_rows
    ahead = rows_sent_before(job)
    return Standing(0, ahead, (ahead + remaining) / rate if rate else None, "")


def rows_sent_before(job: Job) -> int:
    """Other jobs' rows in chunks sent no later than this job's last one and not yet done: they run first.

    A running chunk counts whole (its rows' progress is not tracked per chunk), so this errs long by at most
    the batch in progress.
    """
    in_flight = Chunk.objects.filter(
        status__in=[ChunkStatus.QUEUED, ChunkStatus.RUNNING], dispatched_at__isnull=False, job__status__in=RUNNABLE
    )
    last = in_flight.filter(job=job).aggregate(last=Max("dispatched_at"))["last"]
    if last is None:
        return 0
    before = in_flight.filter(dispatched_at__lte=last).exclude(job=job)
    return before.aggregate(rows=Sum(F("end_index") - F("first_index")))["rows"] or 0


def _compute_standings(rate: float) -> dict[int, Standing]:
    queues = waiting_queues()
    if not queues:
        return {}
    row = SchedulerState.objects.filter(pk=_STATE_PK).first()
    state = fairshare.ShareState.from_json(row.state if row else {})
    forecasts = fairshare.forecast(state, queues, band_weights())
    in_flight_rows = (
        Chunk.objects.filter(status__in=[ChunkStatus.QUEUED, ChunkStatus.RUNNING], dispatched_at__isnull=False)
        .filter(job__status__in=RUNNABLE)
        .aggregate(rows=Sum(F("end_index") - F("first_index")))["rows"]
        or 0
    )
    out: dict[int, Standing] = {}
    for queue in queues:
        forecast = forecasts.get(queue.job_id)
        reason = waiting_reason(queue, queues)
        if forecast is None:
            out[queue.job_id] = Standing(None, None, None, reason)
            continue
        rows_to_finish = forecast.rows_to_finish + in_flight_rows
        eta = rows_to_finish / rate if rate else None
        out[queue.job_id] = Standing(forecast.chunks_ahead, round(forecast.rows_ahead), eta, reason)
    return out


def waiting_reason(queue: fairshare.JobQueue, queues: list[fairshare.JobQueue]) -> str:
    """Why a job is not getting every offline worker, in words."""
    rank = fairshare.band_rank(queue.band)
    higher = [q for q in queues if fairshare.band_rank(q.band) < rank]
    if higher:
        n = len(higher)
        return f"waiting: {n} job{'s' if n != 1 else ''} of higher priority"
    others = {q.owner for q in queues if q.band == queue.band and q.owner != queue.owner}
    if others:
        n = len(others)
        whose = "user's" if n == 1 else "users'"
        return f"sharing the offline workers with {n} other {whose} jobs of {queue.band} priority"
    own = [q for q in queues if q.owner == queue.owner and q.band == queue.band and q.job_id != queue.job_id]
    if own:
        n = len(own)
        return f"sharing its owner's share with {n} other job{'s' if n != 1 else ''} of theirs"
    return ""


def offline_rows_per_s() -> float:
    """Rows per second the offline workers have been writing (all jobs; the last minute's mean)."""
    from jobs.monitoring import offline_rate_per_s  # monitoring reads the shared metrics

    return offline_rate_per_s()
