"""Flower's configuration: read by `celery -A platform_ flower` from its working directory (the repository
root under `make run`, /app in the image), as Flower reads ./flowerconfig.py by default.

The Broker tab lists the queues Flower learns from workers' answers to a broadcast `inspect
active_queues`, asked once when Flower starts and again only when someone refreshes the Workers page;
it falls back to the app's declared queues only when no worker answered at all. The offline worker
runs at the lowest CPU priority, its dispatcher included (OFFLINE_NICE, for its process and its
autogroup, which the pool children share: jobs/tasks.py), so on a busy host it often answers after
Flower's one-second inspect timeout: measured on 2 cores under a 16-client online load while a
20,000-row job ran, 9 of 16 one-second inspects missed it, none once its priority was restored. The
online worker answered, so the fallback did not apply, and the offline queue vanished from the tab
until a later refresh caught an answer. The tab now always lists every queue the platform has (the
offline queue and each online queue of the models file) besides those workers report, and inspects
wait 3 s instead of 1 (a Workers refresh takes that long).
"""

from __future__ import annotations

# Flower applies every top-level name of this file that is one of its options (`logging` is one), so
# everything else here is private.
import logging as _logging
from collections.abc import Callable as _Callable
from typing import Any as _Any

inspect_timeout = 3000.0  # ms
# Tasks Flower keeps in memory (its default, 100,000, is never reached in a short run and grows it for
# hours: each dispatched batch is one task here). The 30-minute soak (docs/benchmarks.md) saw Flower
# go from 113 to 321 MB at about 40 batches/s, the only process of the platform that kept growing.
max_tasks = 10000

_logger = _logging.getLogger("flowerconfig")


def _platform_queue_names() -> list[str]:
    """Every queue a worker of this platform consumes: `offline` and each online queue of the models file."""
    from inference.core.queues import online_queues
    from inference.core.registry import get_registry
    from platform_.celery import OFFLINE_QUEUE

    return [OFFLINE_QUEUE, *online_queues(get_registry())]


def _with_platform_queues(reported: _Callable[[_Any], list[str]]) -> _Callable[[_Any], list[str]]:
    def get_active_queue_names(handler: _Any) -> list[str]:
        names = set(reported(handler))
        try:
            names |= set(_platform_queue_names())
        except Exception:  # an unreadable models file must not break the Broker tab
            _logger.warning("could not read the platform's queues; showing the workers' only", exc_info=True)
        # `online` stands for "the online queues of my models" on a worker's -Q and is never a list itself.
        names.discard("online")
        return sorted(names)

    get_active_queue_names.platform_queues = True  # type: ignore[attr-defined]
    return get_active_queue_names


def _install() -> None:
    """Make Flower's Broker tab list the platform's queues (idempotent)."""
    from flower.views import BaseHandler

    if not getattr(BaseHandler.get_active_queue_names, "platform_queues", False):
        BaseHandler.get_active_queue_names = _with_platform_queues(BaseHandler.get_active_queue_names)


try:
    _install()
except ImportError:  # read where Flower is not installed
    pass
