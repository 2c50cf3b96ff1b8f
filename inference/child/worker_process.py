"""Worker child lifecycle: load models (every wanted version) and start the heartbeat and the version
keeper at child start, stop them at child exit.

Connected to Celery's worker_process_init / worker_process_shutdown in inference/tasks.py, so it
runs in prefork children only: never in the worker's parent nor in the web process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings

from inference.child import runtime, versions
from inference.core.queues import served_models
from inference.core.registry import get_registry
from inference.core.workers import Heartbeat, WorkerState
from platform_.celery import app, worker_role
from platform_.redis import get_redis

logger = logging.getLogger(__name__)
state: WorkerState | None = None
_heartbeat: Heartbeat | None = None


def start() -> None:
    """Load this child's models (with warm-up), then announce it."""
    global state, _heartbeat
    registry = get_registry()
    unknown = sorted(set(settings.WORKER_MODELS) - set(registry.names()))
    if unknown:
        raise RuntimeError(f"WORKER_MODELS names unknown models: {unknown}")
    consumed = app.amqp.queues.consume_from or app.amqp.queues  # rewritten by inference/core/queues.py
    names = served_models(consumed, registry, settings.WORKER_MODELS)
    if not names:
        raise RuntimeError(
            f"this worker consumes {sorted(consumed)}: no queue there carries a model of the models file"
        )
    client = get_redis()
    errors: dict[str, dict] = {}
    # Every version the deployment wants (active, target, canary), verified, so a child started during a
    # swap or a canary serves all of them from its first request.
    runtime.load(versions.initial_specs(client, registry, names, errors))
    # Which queue this worker consumes (online or offline), shown on /models and the dashboard.
    state = WorkerState(
        queue=worker_role(), models=runtime.loaded(), versions=runtime.loaded_versions(), version_errors=errors
    )
    _heartbeat = Heartbeat(client, state, settings.WORKER_HEARTBEAT_S)
    _heartbeat.start()
    versions.keeper = versions.VersionKeeper(
        client,
        registry,
        names,
        state,
        _heartbeat.beat,
        poll_s=settings.INFERENCE_VERSION_POLL_S,
        drain_s=settings.INFERENCE_VERSION_DRAIN_S,
        load_nice=settings.INFERENCE_VERSION_LOAD_NICE,
    )
    versions.keeper.start()
    logger.info("worker child %s ready on %s with %s", state.worker_id, state.queue, state.versions)


@contextmanager
def busy() -> Iterator[None]:
    """Mark this child busy while it runs a batch (the heartbeat shows it on the dashboard)."""
    if state:
        state.state, state.batches = "busy", state.batches + 1
    try:
        yield
    finally:
        if state:
            state.state = "idle"


def stop() -> None:
    if versions.keeper:
        versions.keeper.stop()
    if _heartbeat:
        _heartbeat.stop()
