"""Once a second, writes the gauges no request carries: queue depths, workers alive, host CPU and load.

Runs in every Celery worker's main process (a platform_.periodic.Periodic started in inference/tasks.py);
a Redis lock makes one sample per second whichever workers are up. Queue depth is the first warning of
a jam, so it is sampled even when nobody watches the dashboard. What to sample comes from the apps'
registered gauge sources; the host's CPU and load are this module's own: they tell a saturated host
from a lock. On several hosts they are those of the host whose worker took the lock that second.
"""

from __future__ import annotations

import logging
import os
import time

from observability import registry
from observability.keys import GAUGES_KEY, second_key
from observability.metrics import HISTORY_S
from platform_.redis import get_redis

logger = logging.getLogger(__name__)
_cpu_primed = False


def host_gauges() -> dict[str, float]:
    """Cores, CPU busy (all cores, since this process last asked) and load averages of this host."""
    global _cpu_primed
    import psutil

    gauges = {"gauge|host|cores": float(os.cpu_count() or 1)}
    busy = psutil.cpu_percent(None)
    if _cpu_primed:  # the first call has nothing to compare with and says 0.0
        gauges["gauge|host|cpu_pct"] = busy
    _cpu_primed = True
    try:
        load1, load5, _ = os.getloadavg()
        gauges["gauge|host|load1"], gauges["gauge|host|load5"] = load1, load5
    except OSError:
        pass  # no load average on this platform
    return gauges


def sample_once(client=None) -> dict[str, float]:
    """Every registered gauge plus the host's, into this second's hash and the latest-gauges hash."""
    client = client or get_redis()
    gauges = host_gauges()
    for source in registry.gauge_sources():
        gauges.update(source(client))
    key = second_key(int(time.time()))
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, mapping=gauges)
    pipe.expire(key, HISTORY_S)
    pipe.hset(GAUGES_KEY, mapping={**gauges, "sampled_at": time.time()})
    pipe.execute()
    return gauges


_last_run: dict[object, float] = {}


def tick() -> None:
    """The sampler's tick: gauges every second, each app's housekeeping at its own interval."""
    sample_once()
    now = time.time()
    for work, interval_s in registry.housekeeping():
        if now - _last_run.get(work, 0.0) >= interval_s:
            _last_run[work] = now
            work()
