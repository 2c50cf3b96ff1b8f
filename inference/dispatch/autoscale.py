"""Autoscaling on one host with Celery's own engine: the online pool grows and shrinks on predicted wait.

`celery worker --autoscale=MAX,MIN` resizes the prefork pool with the class named by the
`worker_autoscaler` setting (CELERY_WORKER_AUTOSCALER in platform_/settings/base.py names this module's
`PredictedWaitAutoscaler`). Celery's own rule sizes the pool on `len(state.reserved_requests)`, the
tasks received and not yet finished. That count means nothing here: a celery-batches task buffers
requests in the worker's main process and hands many of them to a child as one pool job, and never
registers them as reserved, so Celery's autoscaler sees 0 whatever the load and never grows.

What matters to a caller is how long its request will wait: the queue's admitted backlog in tokens
over the drain rate measured in tokens per busy child-second, shared by the children serving it
(`inference.core.queues.predicted_wait_s`). The metrics sampler (observability/sampler.py, running
inference/web/monitoring.py's gauges) writes it once a second per online queue into
`observability.keys.GAUGES_KEY`; the autoscaler of each online worker
reads it from its main process (its event loop, every AUTOSCALE_INTERVAL_S) and decides with
`target_procs`, a pure function:

- grow by one child when the predicted wait of the queues the worker consumes passes
  AUTOSCALE_GROW_WAIT_SHARE of ONLINE_DEADLINE_MS (0.25: before admission starts refusing at its
  headroom, 0.35), or, before any rate was measured, when more requests are admitted than children;
- shrink by one child once the wait has stayed low for AUTOSCALE_KEEPALIVE_S, low meaning that
  with one child fewer it would still be under AUTOSCALE_SHRINK_WAIT_SHARE of the deadline (the gap
  between the two shares keeps the pool from flapping);
- hold while a child is still starting. A new child is useless until worker_process_init has loaded
  its models (seconds for a transformer on a CPU), and the gauge does not count it until it beats:
  growing again meanwhile would add children for load that the first one is about to take. The
  autoscaler waits for every child of its pool to beat in `inference:workers` and for a gauge
  sampled after that, then decides again. Stale gauges (no sampler running) also hold.

Under a load past what the pool can serve, admission keeps the backlog near its bound (0.35 of the
deadline ahead) whatever the pool's size, so the gauge stays past the grow mark and the pool stays at
MAX while the load lasts, without flapping. The autoscaler does not see CPU: MAX must be what the host
can run (children x TORCH_THREADS <= cores), or it adds children that only split the same cores.
Measured in docs/benchmarks.md ("Autoscaling on predicted wait").

Online workers never go below one child, whatever MIN says: admission refuses every request of a
model no child serves (`no_worker`), so the backlog a zero-child pool would have to grow on never
forms. An offline worker (one consuming no online queue) keeps Celery's default rule, unchanged. With
the offline batches task it never grows either (no reserved requests), so `--autoscale` on an
offline worker just keeps MIN children: the offline worker's share of the host is set with -c and
OFFLINE_NICE, on purpose, since offline children compete with online ones for the same cores.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from celery.worker.autoscale import Autoscaler
from django.conf import settings

from inference.core.keys import WORKERS_KEY
from inference.core.workers import alive_workers, dispatcher_id
from observability.keys import GAUGES_KEY
from platform_.celery import ONLINE_QUEUE, is_online_queue
from platform_.celery import app as celery_app
from platform_.redis import get_redis

logger = logging.getLogger(__name__)
# The sampler's period (inference/tasks.py starts it): a gauge written this long after a child was seen
# ready was computed after it, so it counts that child.
SAMPLER_PERIOD_S = 1.0


@dataclass(frozen=True)
class Policy:
    """The thresholds, in seconds."""

    grow_wait_s: float  # grow when the predicted wait passes this
    shrink_wait_s: float  # low when the wait with one child fewer would stay under this
    keepalive_s: float  # shrink after the wait stayed low this long

    @classmethod
    def from_settings(cls) -> Policy:
        deadline_s = settings.ONLINE_DEADLINE_MS / 1000
        return cls(
            grow_wait_s=settings.AUTOSCALE_GROW_WAIT_SHARE * deadline_s,
            shrink_wait_s=settings.AUTOSCALE_SHRINK_WAIT_SHARE * deadline_s,
            keepalive_s=settings.AUTOSCALE_KEEPALIVE_S,
        )


def is_high(wait_s: float | None, queued: int, procs: int, policy: Policy) -> bool:
    """Whether the load asks for one more child: the predicted wait passes the grow threshold, or, with
    no drain rate measured yet, more requests are admitted than there are children to start them."""
    if wait_s is None:
        return queued > procs
    return wait_s > policy.grow_wait_s


def is_low(wait_s: float | None, queued: int, procs: int, policy: Policy) -> bool:
    """Whether one child fewer would do: the wait, spread over one child fewer, stays under the shrink
    threshold (no drain rate yet: nothing is admitted at all)."""
    if wait_s is None:
        return queued == 0
    if procs <= 1:
        return wait_s <= policy.shrink_wait_s
    return wait_s * procs / (procs - 1) <= policy.shrink_wait_s


def target_procs(
    *,
    wait_s: float | None,
    queued: int,
    procs: int,
    min_procs: int,
    max_procs: int,
    starting: int,
    low_for_s: float,
    policy: Policy,
) -> int:
    """How many children the pool should have, one step at a time.

    wait_s: predicted wait of the worker's queues in seconds (None: no drain rate measured yet);
    queued: requests admitted and not yet answered on them; procs: children now; starting: children
    that have not loaded their models yet (or whose arrival no gauge has seen yet); low_for_s: how long
    the wait has been low (`is_low`), 0 while it is not.
    """
    if procs < min_procs:
        return min_procs
    if procs > max_procs:
        return max_procs
    if starting > 0:
        return procs  # the new child helps once loaded: judge the load again then
    if procs < max_procs and is_high(wait_s, queued, procs, policy):
        return procs + 1
    if procs > min_procs and low_for_s >= policy.keepalive_s:
        return procs - 1
    return procs


@dataclass(frozen=True)
class Gauges:
    """The sampler's figures for the queues a worker consumes, summed."""

    wait_s: float | None  # None: some queue has work and no measured rate
    queued: int
    sampled_at: float


def read_gauges(raw: Mapping[str, str], queues: Sequence[str]) -> Gauges | None:
    """The predicted wait and admitted requests of `queues` from the gauges hash (None before the
    sampler's first write).

    Waits are summed: the children of one worker serve all its queues, so their work adds up (exact
    when the same children serve every queue; a max would undercount shared children).
    """
    if "sampled_at" not in raw:
        return None
    wait_s: float | None = 0.0
    queued = 0
    for name in queues:
        mine = int(float(raw.get(f"gauge|{name}|waiting") or 0) + float(raw.get(f"gauge|{name}|in_flight") or 0))
        queued += mine
        wait = raw.get(f"gauge|{name}|predicted_wait_s")
        if wait is None:
            if mine > 0:
                wait_s = None  # work at a rate never measured
        elif wait_s is not None:
            wait_s += float(wait)
    return Gauges(wait_s, queued, float(raw["sampled_at"]))


def ready_children(raw: Mapping[str, str], pids: set[int], dispatcher: str, heartbeat_s: float) -> int:
    """Children of this pool that have loaded their models: those beating in `inference:workers`
    (a child beats once worker_process_init has loaded its models) under this dispatcher."""
    return sum(1 for w in alive_workers(raw, heartbeat_s) if w.get("dispatcher") == dispatcher and w.get("pid") in pids)


class PredictedWaitAutoscaler(Autoscaler):
    """Celery's Autoscaler, deciding on the predicted wait of the worker's online queues (module docstring)."""

    def __init__(self, pool: Any, max_concurrency: int, min_concurrency: int = 0, worker: Any = None, **kwargs: Any):
        kwargs.setdefault("keepalive", settings.AUTOSCALE_KEEPALIVE_S)
        super().__init__(pool, max_concurrency, min_concurrency, worker=worker, **kwargs)
        self.policy = Policy.from_settings()
        self.interval_s = settings.AUTOSCALE_INTERVAL_S
        self.stale_s = settings.AUTOSCALE_STALE_S
        self._low_since: float | None = None
        self._ready_at = 0.0  # when every child of the pool last became ready
        self._last: dict[str, Any] = {}
        self.client: redis.Redis | None = None  # None: the process's client (platform_.redis)
        self._tick: Any = None
        self._ticked_at = 0.0
        self._arm()

    def _arm(self) -> None:
        """(Re)start the tick on the worker's event loop.

        Celery checks every `keepalive` seconds and on each task message, which celery-batches never
        reports: this ticks every `interval_s` instead. A broker reconnect clears the loop's timers and
        Celery re-arms only its own check; that check finds this tick gone (`maybe_scale`) and re-arms
        it. Without an event loop (thread mode), Celery's own thread calls maybe_scale every second.
        """
        hub = getattr(self.worker, "hub", None)
        if hub is None:
            return
        if self._tick is not None:
            self._tick.cancel()  # stalled but still queued: never two ticks
        self._ticked_at = time.monotonic()
        self._tick = hub.call_repeatedly(self.interval_s, self._on_tick)

    def _on_tick(self) -> None:
        self._ticked_at = time.monotonic()
        self.maybe_scale()

    def maybe_scale(self, req: Any = None) -> None:
        if self._tick is not None and time.monotonic() - self._ticked_at > 3 * self.interval_s:
            logger.info("autoscale: the tick stopped (a broker reconnect clears the event loop's timers): re-arming")
            self._arm()
        super().maybe_scale(req)

    def online_queues(self) -> list[str]:
        """The online queues this worker consumes (its -Q, as inference/core/queues.py rewrote it)."""
        app = getattr(self.worker, "app", None) or celery_app
        consumed = app.amqp.queues.consume_from or app.amqp.queues
        return [name for name in consumed if is_online_queue(name) and name != ONLINE_QUEUE]

    def _pids(self) -> set[int] | None:
        """The pool's child pids (None where the pool does not say: no readiness check then)."""
        try:
            return set(self.pool.info.get("processes", ())) or None
        except Exception:
            return None

    def _maybe_scale(self, req: Any = None) -> bool | None:
        queues = self.online_queues()
        if not queues:
            return super()._maybe_scale(req)  # offline: Celery's own rule
        try:
            return self._scale_online(queues)
        except redis.RedisError as exc:
            logger.warning("autoscale: cannot read the gauges (%r); the pool stays at %d", exc, self.processes)
            return None

    def _scale_online(self, queues: list[str]) -> bool:
        client = self.client or get_redis()
        now = time.time()
        procs = self.processes
        gauges = read_gauges(client.hgetall(GAUGES_KEY), queues)
        if gauges is None or now - gauges.sampled_at > self.stale_s:
            self._low_since = None
            self._last = {"held": "no fresh gauges"}
            return False
        pids = self._pids()
        starting = 0
        if pids is not None:
            raw = client.hgetall(WORKERS_KEY)
            ready = ready_children(raw, pids, dispatcher_id(), settings.WORKER_HEARTBEAT_S)
            starting = max(0, procs - ready)
        if starting:
            self._ready_at = 0.0
        elif not self._ready_at:
            self._ready_at = now
        if not starting and gauges.sampled_at < self._ready_at + SAMPLER_PERIOD_S:
            starting = 1  # no gauge has counted the newest child yet
        if is_low(gauges.wait_s, gauges.queued, procs, self.policy) and not starting:
            self._low_since = self._low_since or now
        else:
            self._low_since = None
        low_for_s = now - self._low_since if self._low_since else 0.0
        target = target_procs(
            wait_s=gauges.wait_s,
            queued=gauges.queued,
            procs=procs,
            min_procs=max(1, self.min_concurrency),
            max_procs=max(1, self.max_concurrency),
            starting=starting,
            low_for_s=low_for_s,
            policy=self.policy,
        )
        self._last = {"wait_s": gauges.wait_s, "queued": gauges.queued, "starting": starting, "low_for_s": low_for_s}
        if target == procs:
            return False
        wait = "unknown" if gauges.wait_s is None else f"{gauges.wait_s:.2f} s"
        if target > procs:
            logger.info(
                "autoscale: predicted wait %s, %d admitted: growing to %d children", wait, gauges.queued, target
            )
            self.scale_up(target - procs)
            self._ready_at = 0.0
        else:
            logger.info("autoscale: wait low for %.0f s (%s): shrinking to %d children", low_for_s, wait, target)
            self._shrink(procs - target)
            if self.processes < procs:
                self._low_since = None  # the next step down waits its own keepalive
        return True

    def info(self) -> dict[str, Any]:
        return {**super().info(), **self._last}
