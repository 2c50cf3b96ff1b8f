"""Worker child lifecycle: load models (every wanted version) and start the heartbeat and the version
keeper at child start, stop them at child exit.

Connected to Celery's worker_process_init / worker_process_shutdown in inference/tasks.py, so it
runs in prefork children only: never in the worker's parent nor in the web process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings

from inference.child import cores, memory, runtime, versions
from inference.core.queues import served_models
from inference.core.registry import Registry, get_registry
from inference.core.workers import Heartbeat, WorkerState
from platform_.celery import app, worker_role
from platform_.redis import get_redis

logger = logging.getLogger(__name__)
state: WorkerState | None = None
_heartbeat: Heartbeat | None = None


def _served(registry: Registry) -> list[str]:
    """The models this worker serves: those of the queues it consumes, within WORKER_MODELS."""
    unknown = sorted(set(settings.WORKER_MODELS) - set(registry.names()))
    if unknown:
        raise RuntimeError(f"WORKER_MODELS names unknown models: {unknown}")
    consumed = app.amqp.queues.consume_from or app.amqp.queues  # rewritten by inference/core/queues.py
    names = served_models(consumed, registry, settings.WORKER_MODELS)
    if not names:
        raise RuntimeError(
            f"this worker consumes {sorted(consumed)}: no queue there carries a model of the models file"
        )
    return names


def preload() -> None:
    """In the worker's main process, before the pool forks: load and warm this worker's models once.

    Every child forked afterwards (the first ones, a replacement, one the autoscaler adds) starts with
    them in memory, shared copy-on-write, and serves within about a second instead of importing torch
    and loading for 7 to 13 s (issue 23, item 4). CPU models only (CUDA does not survive a fork), with
    one intra-op thread here, so no OpenMP thread exists to be lost in the fork. A failure here is
    logged and left to the children, which load their own as before and report it as before.
    """
    if not settings.INFERENCE_PRELOAD:
        return
    try:
        registry = get_registry()
        specs = versions.initial_specs(get_redis(), registry, _served(registry), {})
        if not runtime.preloadable(specs):
            logger.info("models not preloaded (a GPU model: each child loads its own)")
            return
        started = time.perf_counter()
        runtime.load(specs, threads=1)
        import torch

        # The fork is safe only while no OpenMP thread exists here (a parent that ran an op on 2 threads
        # left its forked child hung in its first parallel op, torch 2.13 CPU, measured).
        if torch.get_num_threads() != 1:
            raise RuntimeError(f"the main process runs {torch.get_num_threads()} torch threads before the fork")
    except Exception:
        logger.exception("preloading the models failed; each worker child loads its own")
        runtime.unload_all()
        return
    logger.info(
        "preloaded %s in %.2f s: children start with them", runtime.loaded_versions(), time.perf_counter() - started
    )


def start() -> None:
    """Load this child's models (with warm-up; what the main process preloaded is already here), then
    announce it."""
    global state, _heartbeat
    registry = get_registry()
    names = _served(registry)
    client = get_redis()
    errors: dict[str, dict] = {}
    # Every version the deployment wants (active, target, canary), verified, so a child started during a
    # swap or a canary serves all of them from its first request.
    specs = versions.initial_specs(client, registry, names, errors)
    runtime.load(specs)
    # Idle cores lend their threads to a lone online pass (issue 23, item 1).
    least = max(s.torch_threads for s in specs)
    cores.start(least=least, most=settings.TORCH_MAX_THREADS, elastic=worker_role() == "online")
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
        memory.trim_if_due()


def stop() -> None:
    cores.stop()
    if versions.keeper:
        versions.keeper.stop()
    if _heartbeat:
        _heartbeat.stop()
