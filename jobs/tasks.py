"""Celery tasks of the offline path (thin: the work is in jobs/lifecycle.py, jobs/runner.py, jobs/reconcile.py,
jobs/callbacks.py and jobs/retention.py), and the offline worker's housekeeping threads."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import signals
from django import db
from django.conf import settings

from inference.child import worker_process
from inference.dispatch.batching import AdaptiveBatches
from jobs import batches, callbacks, enqueue, retention
from jobs.keys import RECONCILER
from jobs.lifecycle import run_ingest
from jobs.models import Chunk, ChunkStatus
from jobs.reconcile import reconcile
from jobs.runner import requeue_lost, run_chunks
from platform_.celery import app, worker_role
from platform_.cpu import lower_cpu_priority
from platform_.periodic import Periodic

logger = logging.getLogger(__name__)


class OfflineBatches(AdaptiveBatches):
    """Chunks from any job accumulate and go to a free child together, up to JOBS_DISPATCH_ROWS rows."""

    abstract = True
    batch_time_limit_s = settings.OFFLINE_TIME_LIMIT_S

    def max_texts(self, model: str) -> int:
        return settings.JOBS_DISPATCH_ROWS

    def request_texts(self, request: Any) -> int:
        return int(request.kwargs["rows"])

    def on_lost(self, requests: list[Any], reason: str) -> None:
        requeue_lost([int(r.kwargs["chunk_id"]) for r in requests])

    def ran_anyway(self, requests: list[Any]) -> list[Any]:
        """The chunks a child claimed (AdaptiveBatches._settle_dropped, at shutdown): their messages are of no
        more use (a claim needs a queued chunk; one left running by a dead child goes back to the scheduler
        through the reconciler). The ones still queued keep their messages, which kombu restores."""
        queued = set(
            Chunk.objects.filter(
                pk__in=[int(r.kwargs["chunk_id"]) for r in requests], status=ChunkStatus.QUEUED
            ).values_list("pk", flat=True)
        )
        return [r for r in requests if int(r.kwargs["chunk_id"]) not in queued]


# acks_late: a chunk's message is acknowledged after its batch ends, so a crash redelivers it.
@app.task(base=OfflineBatches, name="jobs.run_chunk", ignore_result=True, acks_late=True)
def run_chunk(requests: list[Any]) -> None:
    with worker_process.busy():
        run_chunks(requests)


# A plain task on the offline queue, so the offline worker runs it without a flag of its own. Not
# acks_late: a worker that dies mid-ingest leaves the job `ingesting` with stale progress, and the
# reconciler queues the ingest again (which starts over from the stored upload).
@app.task(name="jobs.ingest_upload", ignore_result=True, time_limit=settings.OFFLINE_TIME_LIMIT_S)
def ingest_upload(job_id: int) -> None:
    with worker_process.busy():
        run_ingest(job_id)


# Job callbacks travel on a queue of their own (jobs.enqueue.CALLBACK_QUEUE), which the offline worker consumes beside `offline`.
# `offline` is one FIFO list, and the worker takes a message from it only when a batch's chunks are
# acknowledged (its prefetch is full of chunks): a callback there waits behind every chunk queued
# before it, hours behind a large backlog (tests/jobs/test_callbacks.py: routed to `offline`, a
# callback arrived only after another job's 5,000 queued rows had run). On its own list it is taken
# at the worker's next free prefetch slot, and handed to a thread once the child finishes its batch in progress.


# Not acks_late: an attempt lost with its worker is sent again by the reconciler once overdue
# (callbacks.resend_lost), never redelivered mid-POST.
@app.task(name="jobs.deliver_callback", ignore_result=True)
def deliver_callback(job_id: int, ended_at: str, attempt: int) -> None:
    # The POST runs on a thread of this child, not on the child itself: the child also runs every
    # user's chunks, and a receiver that answers slowly (up to JOBS_CALLBACK_TIMEOUT_S an attempt, a
    # deadline callbacks.post enforces) must cost those jobs nothing. The threads bound how many
    # attempts run at once in a child.
    _deliveries().submit(_deliver, job_id, ended_at, attempt)


_delivery_pool: ThreadPoolExecutor | None = None


def _deliveries() -> ThreadPoolExecutor:
    global _delivery_pool
    if _delivery_pool is None:  # made in the child that first needs it: threads do not survive fork
        _delivery_pool = ThreadPoolExecutor(settings.JOBS_CALLBACK_THREADS, thread_name_prefix="callback")
    return _delivery_pool


def _deliver(job_id: int, ended_at: str, attempt: int) -> None:
    try:
        retry_in_s = callbacks.attempt(job_id, ended_at, attempt)
        if retry_in_s is not None:
            enqueue.callback_attempt(job_id, ended_at, attempt + 1, countdown_s=retry_in_s)
    except Exception:  # the reconciler sends a lost attempt again
        logger.exception("job %s: callback attempt %d failed unexpectedly", job_id, attempt)
    finally:
        db.connection.close()  # this thread's own connection


_reconciler: Periodic | None = None
_expirer: Periodic | None = None
_finalizer: Periodic | None = None


@signals.celeryd_after_setup.connect  # after -Q is applied, before the pool forks its children
def _lower_priority(**_: Any) -> None:
    if worker_role() == "offline":
        lower_cpu_priority(settings.OFFLINE_NICE)


@signals.celeryd_after_setup.connect  # before the consumer starts; inference/core/queues.py keeps named queues
def _consume_callbacks(instance: Any, **_: Any) -> None:
    if worker_role() == "offline":
        instance.app.amqp.queues.select_add(enqueue.CALLBACK_QUEUE)


@signals.worker_ready.connect
def _start_reconciler(**_: Any) -> None:
    global _reconciler, _finalizer
    if worker_role() == "offline":
        _reconciler = Periodic(RECONCILER, settings.JOBS_RECONCILE_S, reconcile)
        _reconciler.start()
        _start_expirer()
        # Batches are finalized (their output files written from the rows) here in the main process: in
        # the child it would hold every user's chunks for as long as a big batch's files take to write.
        _finalizer = Periodic(batches.FINALIZER, settings.JOBS_BATCH_FINALIZE_S, batches.run)
        _finalizer.start()


def _start_expirer() -> None:
    global _expirer
    if settings.JOBS_RESULT_TTL_DAYS > 0:
        _expirer = Periodic(retention.EXPIRER, settings.JOBS_EXPIRE_INTERVAL_S, retention.run)
        _expirer.start()


@signals.worker_shutdown.connect
def _stop_reconciler(**_: Any) -> None:
    for thread in (_reconciler, _expirer, _finalizer):
        if thread:
            thread.stop()
