"""Every message the offline path sends, by task name: the modules that decide what to send (lifecycle,
scheduler, callbacks) need not import jobs/tasks.py, which imports them to run the work.

Each send happens after the transaction that made its rows visible commits, so a worker never
receives an id it cannot read yet.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import transaction
from kombu import Exchange, Queue

from platform_.celery import app

# Job callbacks travel on a queue of their own, which the offline worker consumes beside `offline`
# (jobs/tasks.py says why). Its own exchange, for the reason platform_/celery.py gives.
CALLBACK_QUEUE = Queue("callbacks", Exchange("callbacks", type="direct"), routing_key="callbacks")
# Task names (jobs/tasks.py registers them); "jobs.*" is routed to the offline queue (platform_/celery.py).
RUN_CHUNK = "jobs.run_chunk"
INGEST_UPLOAD = "jobs.ingest_upload"
DELIVER_CALLBACK = "jobs.deliver_callback"


def chunks_after_commit(payload: Iterable[dict]) -> None:
    """Send one run message per chunk ({"chunk_id", "model", "rows"}) once the current transaction commits."""
    messages = list(payload)

    def send() -> None:
        for kwargs in messages:
            app.send_task(RUN_CHUNK, kwargs=kwargs)

    if messages:
        transaction.on_commit(send)


def ingest_after_commit(job_id: int) -> None:
    transaction.on_commit(lambda: app.send_task(INGEST_UPLOAD, kwargs={"job_id": job_id}))


def callback_attempt(job_id: int, ended_at: str, attempt: int, countdown_s: float = 0.0) -> None:
    """Queue delivery attempt `attempt` of the callback for this end of the job (now, not after commit)."""
    app.send_task(
        DELIVER_CALLBACK,
        kwargs={"job_id": job_id, "ended_at": ended_at, "attempt": attempt},
        queue=CALLBACK_QUEUE,
        countdown=countdown_s or None,
    )
