"""Celery task events for dispatched batches, so Flower counts and lists them.

celery-batches sends no task events: its strategy only buffers each message, and its trace runs the
batch in a child under a uuid of its own that nothing reports. Flower, which builds its task list and
its per-worker counters (succeeded, failed, active) from the task-received / task-started /
task-succeeded / task-failed events workers send, therefore showed no task however much work ran.

Here the worker's main process reports each dispatched batch (the unit a child runs) as one task under
a fresh uuid: `task-received` when the batch is handed to the pool, `task-started` when a child accepts
it, `task-succeeded` (with its runtime) when it returns, `task-failed` when the child died or passed
the batch time limit, or when the batch function raised (celery-batches' trace logs and swallows the
exception; `apply_batch` below tells the main process). Flower thus counts batches, not requests: each
task's kwargs say how many requests (offline: chunks) and texts (rows) it carried; request counts by
status are on the dashboard and /metrics.

Per batch, and published in bulk, to keep the per-request cost flat. Celery's own dispatcher publishes
buffered task events once per event-loop turn, which on a lightly loaded worker is one Redis PUBLISH
per event (measured: ~0.6 ms of the main process's CPU per batch of one request, about half of its
whole per-request cost). Here events are built as the dispatcher would build them and published
together at most every `flush_interval_s` (0.5 s), as one `task.multi` message, which Flower and
Celery's event receivers already read; what a batch costs is three small dicts. The events follow the
worker's own switches (`worker_send_task_events`; `celery control enable_events / disable_events`,
which Flower sends) and the task's `send_events`. Events still buffered when a worker stops are lost.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.events import Event
from celery.utils.time import utcoffset
from celery_batches.trace import apply_batches_task
from kombu.utils.uuid import uuid

logger = logging.getLogger(__name__)


class BatchEvents:
    """Task events of one batching task's dispatches, buffered and published together every
    `flush_interval_s` through its worker's event dispatcher (one Redis PUBLISH for all of them)."""

    #: Longest an event waits before it is published: how far Flower may lag behind the batches.
    flush_interval_s = 0.5
    #: Published at once when this many events are waiting.
    max_buffered = 240

    def __init__(self, consumer: Any, task: Any) -> None:
        # The consumer, not its dispatcher: a broker reconnect replaces `consumer.event_dispatcher`.
        self._consumer = consumer
        self._task = task
        self._buffer: list[dict[str, Any]] = []
        self._flush_armed = False

    def _eventer(self) -> Any:
        eventer = getattr(self._consumer, "event_dispatcher", None)
        if eventer is None or not eventer.enabled or not self._task.send_events:
            return None
        if eventer.groups and "task" not in eventer.groups:  # task events switched off
            return None
        return eventer

    def dispatched(self, requests: list[Any]) -> Batch | None:
        """A batch of these (Simple)Requests went to the pool: `task-received`. None when events are off."""
        eventer = self._eventer()
        if eventer is None:
            return None
        batch = Batch(uuid(), time.monotonic())
        self._add(
            eventer,
            "task-received",
            uuid=batch.id,
            name=self._task.name,
            args="()",
            kwargs=self._summary(requests),
            root_id=batch.id,
            parent_id=None,
            retries=0,
            eta=None,
            expires=None,
        )
        return batch

    def _summary(self, requests: list[Any]) -> str:
        """What Flower shows as the batch's kwargs: its models, requests (chunks, offline) and texts (rows)."""
        try:
            models = sorted({str(r.kwargs.get("model", "")) for r in requests})
            texts = sum(self._task.request_texts(r) for r in requests)
        except Exception:  # a summary must never stop a dispatch
            return repr({"requests": len(requests)})
        return repr({"models": models, "requests": len(requests), "texts": texts})

    def started(self, batch: Batch | None, pid: int) -> None:
        """A child accepted the batch: `task-started`."""
        eventer = self._eventer() if batch else None
        if eventer is not None:
            batch.started_s = time.monotonic()
            # No pid field of its own: an event carries its sender's (the main process), as Celery's does.
            self._add(eventer, "task-started", uuid=batch.id)

    def finished(self, batch: Batch | None, result: Any) -> None:
        """The child returned: `task-succeeded`, or `task-failed` when `apply_batch` reports an error."""
        eventer = self._eventer() if batch else None
        if eventer is None:
            return
        runtime_s = time.monotonic() - (batch.started_s or batch.dispatched_s)
        if isinstance(result, BatchFailed):
            self._add(
                eventer, "task-failed", uuid=batch.id, exception=result.exception, traceback="", runtime=runtime_s
            )
        else:
            self._add(eventer, "task-succeeded", uuid=batch.id, result="None", runtime=runtime_s)

    def lost(self, batch: Batch | None, exc: Any) -> None:
        """The child died or passed the batch time limit: `task-failed`."""
        eventer = self._eventer() if batch else None
        if eventer is not None:
            self._add(eventer, "task-failed", uuid=batch.id, exception=repr(exc), traceback="")

    def _add(self, eventer: Any, event_type: str, **fields: Any) -> None:
        """Buffer one event, built as the dispatcher builds it; it is published at the next flush."""
        try:
            self._buffer.append(
                Event(
                    event_type,
                    hostname=eventer.hostname,
                    utcoffset=utcoffset(),
                    pid=eventer.pid,
                    clock=eventer.clock.forward(),
                    **fields,
                )
            )
            if len(self._buffer) >= self.max_buffered:
                self.flush()
            elif not self._flush_armed:
                self._consumer.timer.call_after(self.flush_interval_s, self.flush)
                self._flush_armed = True
        except Exception:  # a failure to report must never stop dispatching or acknowledging the batch
            logger.warning("could not record %s for a batch", event_type, exc_info=True)

    def flush(self) -> None:
        """Publish the buffered events as one `task.multi` message, as Celery's dispatcher does its own."""
        self._flush_armed = False
        events, self._buffer = self._buffer, []
        eventer = self._eventer() if events else None
        if eventer is None:
            return
        try:
            with eventer.mutex:
                eventer._publish(events, eventer.producer, "task.multi")
        except Exception:
            logger.warning("could not publish %d task events", len(events), exc_info=True)


class Batch:
    """One dispatched batch as the events know it: its uuid and when it was dispatched and started."""

    __slots__ = ("id", "dispatched_s", "started_s")

    def __init__(self, batch_id: str, dispatched_s: float) -> None:
        self.id, self.dispatched_s, self.started_s = batch_id, dispatched_s, 0.0


class BatchFailed(tuple):
    """What `apply_batch` returns to the main process when the batch function raised: (exception repr,)."""

    @property
    def exception(self) -> str:
        return self[0]


# In a worker child: the exception of the batch that celery-batches' trace is running, if it raised.
_raised: list[BaseException] = []


def apply_batch(task: Any, args: Any, loglevel: int, logfile: Any) -> Any:
    """Run a batch in a child as celery-batches does, returning `BatchFailed` if the batch function raised.

    celery-batches' trace catches the exception, logs it and returns None, so the main process could
    not tell a failed batch from a good one: the trace is given the task behind a thin wrapper that
    remembers what the call raised (the trace still logs it as before).
    """
    _raised.clear()
    result = apply_batches_task(_Recording(task), args, loglevel, logfile)
    if _raised:
        return BatchFailed((repr(_raised[0]),))
    return result


class _Recording:
    """The task as the trace sees it: calling it runs the task and remembers what it raised."""

    def __init__(self, task: Any) -> None:
        self._task = task

    def __call__(self, *args: Any) -> Any:
        try:
            return self._task(*args)
        except BaseException as exc:
            _raised.append(exc)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)
