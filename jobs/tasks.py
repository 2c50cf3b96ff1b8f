"""Celery tasks of the offline path (thin: the work is in jobs/lifecycle.py, jobs/runner.py and jobs/reconcile.py)."""

from __future__ import annotations

from typing import Any

from celery import signals
from django.conf import settings

from inference import worker_process
from inference.batching import AdaptiveBatches
from jobs.keys import RECONCILER
from jobs.lifecycle import run_ingest
from jobs.reconcile import reconcile
from jobs.runner import requeue_lost, run_chunks
from platform_.celery import app, worker_role
from platform_.cpu import lower_cpu_priority
from platform_.periodic import Periodic


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


_reconciler: Periodic | None = None


@signals.celeryd_after_setup.connect  # after -Q is applied, before the pool forks its children
def _lower_priority(**_: Any) -> None:
    if worker_role() == "offline":
        lower_cpu_priority(settings.OFFLINE_NICE)


@signals.worker_ready.connect
def _start_reconciler(**_: Any) -> None:
    global _reconciler
    if worker_role() == "offline":
        _reconciler = Periodic(RECONCILER, settings.JOBS_RECONCILE_S, reconcile)
        _reconciler.start()


@signals.worker_shutdown.connect
def _stop_reconciler(**_: Any) -> None:
    if _reconciler:
        _reconciler.stop()
