"""Housekeeping threads in the Celery workers' main processes (queue sampler, jobs reconciler).

A thread, not a beat task: a task would wait behind long batches in the pool. A Redis lock that
expires just before the next tick makes one run per interval however many workers are up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import close_old_connections

from platform_.redis import get_redis

logger = logging.getLogger(__name__)


class Periodic:
    """Runs `work` every `interval_s` seconds until stop(); a failed run is logged and the next one tries again."""

    def __init__(self, name: str, interval_s: float, work: Callable[[], object]) -> None:
        self.name, self.interval_s, self.work = name, interval_s, work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if get_redis().set(f"periodic:{self.name}:lock", "1", nx=True, px=int(self.interval_s * 900)):
                    self.work()
            except Exception:
                logger.exception("%s failed; trying again in %.0f s", self.name, self.interval_s)
            finally:
                close_old_connections()
