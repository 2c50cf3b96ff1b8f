"""Celery tasks of the online path (thin: the work is in inference/child/serving.py)."""

from __future__ import annotations

import logging
from typing import Any

from celery import signals
from django.conf import settings

from inference.child import worker_process
from inference.child.serving import serve_online
from inference.core.backlog import queue_release
from inference.core.planning import group_by
from inference.core.queues import apply_to_worker
from inference.core.registry import get_registry
from inference.core.replies import queue_replies, route_of
from inference.core.workers import record_batch
from inference.dispatch.batching import AdaptiveBatches
from inference.dispatch.fair import Limits, Work
from observability.sampler import tick as sample_tick
from platform_.celery import app
from platform_.periodic import Periodic
from platform_.redis import get_redis

logger = logging.getLogger(__name__)


class OnlineBatches(AdaptiveBatches):
    """Dispatch policy of the online queue, with the limits from settings and the registry."""

    abstract = True
    batch_wait_s = settings.ONLINE_BATCH_WAIT_MS / 1000
    batch_time_limit_s = settings.ONLINE_TIME_LIMIT_S

    def limits(self, model: str) -> Limits:
        spec = get_registry().get(model)
        if spec is None:
            return Limits(max_texts=1, max_tokens=1, contended_tokens=1)
        max_tokens = min(spec.max_batch_tokens, settings.ONLINE_DISPATCH_TOKENS)
        return Limits(
            max_texts=spec.max_batch_size,
            max_tokens=max_tokens,
            contended_tokens=min(max_tokens, settings.ONLINE_CONTENDED_DISPATCH_TOKENS),
        )

    def work_for(self, request: Any, received_s: float) -> Work:
        kwargs = request.kwargs
        # The web tier counted each text's tokens when it admitted the request (inference/core/tokens.py).
        costs = kwargs.get("tokens") or [1] * len(kwargs["inputs"])
        return Work(request, kwargs["model"], str(kwargs.get("client", "")), costs, received_s, kwargs["deadline"])

    def on_lost(self, requests: list[Any], reason: str) -> None:
        pipe = get_redis().pipeline(transaction=False)
        queue_replies(pipe, {r.id: {"ok": False, "error": reason, **route_of(r)} for r in requests})
        for model, group in group_by(requests, lambda r: r.kwargs["model"]).items():
            queue_release(pipe, model, [r.id for r in group])
        pipe.execute()

    def on_expired(self, requests: list[Any]) -> None:
        for model, group in group_by(requests, lambda r: r.kwargs["model"]).items():
            record_batch(get_redis(), model, done=0, texts=0, busy_s=0.0, expired=len(group), batch=False)


@app.task(
    base=OnlineBatches, name="inference.predict_online", ignore_result=True, send_events=settings.ONLINE_TASK_EVENTS
)
def predict_online(requests: list[Any]) -> None:
    with worker_process.busy():
        serve_online(requests, get_redis(), worker_process.state)


def _dispatchers() -> list[AdaptiveBatches]:
    return [task for task in app.tasks.values() if isinstance(task, AdaptiveBatches)]


@signals.worker_shutting_down.connect
def _stop_dispatching(**_: Any) -> None:
    """Batches already with a child finish; no new one starts (online and offline alike)."""
    for task in _dispatchers():
        task.stop_dispatching()


@signals.worker_shutdown.connect
def _hand_back_waiting(**_: Any) -> None:
    """Requests taken from a no-ack queue (online) but not started go back to it for another worker;
    offline chunks are acknowledged late, so kombu itself restores the unstarted ones."""
    handed = sum(task.hand_back(get_redis()) for task in _dispatchers())
    if handed:
        logger.warning("handed %d waiting online requests back to the queue", handed)


@signals.celeryd_after_setup.connect  # after -Q is applied, before the consumer starts and the pool forks
def _per_model_queues(instance: Any, **_: Any) -> None:
    """`-Q online` becomes the online queues of this worker's models (inference/core/queues.py)."""
    names = apply_to_worker(instance.app, get_registry(), settings.WORKER_MODELS)
    logger.info("consuming %s", ", ".join(names))


@signals.celeryd_after_setup.connect  # connected after _per_model_queues: it needs the queues applied
def _preload_models(**_: Any) -> None:
    """Models loaded once in the main process, before the pool forks: children start with them."""
    worker_process.preload()


@signals.worker_process_init.connect
def _load_models(**_: Any) -> None:
    worker_process.start()


@signals.worker_process_shutdown.connect
def _stop_heartbeat(**_: Any) -> None:
    worker_process.stop()


_sampler: Periodic | None = None


@signals.worker_ready.connect
def _start_sampler(**_: Any) -> None:
    """Every worker's main process samples queue depths; a Redis lock keeps it to one sample a second."""
    global _sampler
    _sampler = Periodic("metrics-sampler", 1.0, sample_tick)
    _sampler.start()


@signals.worker_shutdown.connect
def _stop_sampler(**_: Any) -> None:
    if _sampler:
        _sampler.stop()
