"""Admission control: a bounded online backlog, shared by all web processes through Redis.

A request is refused at once, before anything is queued, when
  - no online worker serves its model (`no_worker`),
  - the model's backlog (queued plus in flight) is at its limit (`backlog_full`), or
  - the requests ahead of it cannot drain before its deadline at the measured rate (`deadline`).
The backlog is a sorted set of request ids scored by deadline, so an entry whose caller died
disappears once its deadline has passed: the count cannot leak.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import redis.asyncio as aredis

from inference.registry import ModelSpec
from inference.workers import WORKERS_KEY, alive_workers, drain_rate_per_s, rate_key

# Atomic across web processes: drop expired entries, count, check both limits, then add.
# ARGV: now, request id, deadline, limit, drain rate per s (0 = unknown), remaining seconds.
_ADMIT_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local ahead = redis.call('ZCARD', KEYS[1])
if ahead >= tonumber(ARGV[4]) then return {0, ahead} end
local rate = tonumber(ARGV[5])
if rate > 0 and ahead / rate > tonumber(ARGV[6]) then return {-1, ahead} end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('EXPIRE', KEYS[1], 3600)
return {1, ahead}
"""


LAST_RATE_TTL_S = 24 * 3600


def backlog_key(model: str) -> str:
    return f"inference:backlog:{model}"


def online_in_flight(client, models: list[str]) -> int:
    """Online requests admitted and not yet answered, over `models` (sync: for worker children)."""
    now = time.time()
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.zcount(backlog_key(model), now, "+inf")  # entries past their deadline are gone callers
    return sum(pipe.execute())


def last_rate_key(model: str) -> str:
    """Requests per busy child-second last measured for `model`: the estimate after an idle spell."""
    return f"inference:rate:last:{model}"


@dataclass(frozen=True)
class Decision:
    """What admission said, with the figures that a refusal message and Retry-After are made of."""

    admitted: bool
    reason: str | None
    backlog: int
    limit: int
    drain_rate_per_s: float | None
    retry_after_s: int = 0

    @property
    def predicted_wait_s(self) -> float | None:
        return None if not self.drain_rate_per_s else self.backlog / self.drain_rate_per_s

    def message(self, model: str) -> str:
        if self.reason == "no_worker":
            return f"no online worker is serving model {model!r}; retry later"
        if self.reason == "backlog_full":
            return f"model {model!r} has {self.backlog} requests waiting, its limit is {self.limit}; retry later"
        wait = self.predicted_wait_s or 0.0
        return (
            f"model {model!r} cannot meet this request's deadline: {self.backlog} requests ahead at "
            f"{self.drain_rate_per_s:.1f}/s is a {wait * 1000:.0f} ms wait; retry later or allow a longer deadline"
        )


def retry_after_s(reason: str, backlog: int, limit: int, rate_per_s: float | None, remaining_s: float) -> int:
    """Seconds until the refusal would likely not repeat, from the drain rate; at least 1."""
    if not rate_per_s:
        return 1
    if reason == "backlog_full":
        wait = (backlog - limit + 1) / rate_per_s
    else:  # deadline: until the queue ahead is short enough to drain within this deadline
        wait = backlog / rate_per_s - remaining_s
    return max(1, math.ceil(wait))


class Admission:
    """Admits and releases online requests for one web process; caches the drain-rate estimate briefly."""

    def __init__(
        self,
        client: aredis.Redis,
        *,
        heartbeat_s: float,
        rate_window_s: int,
        cache_s: float = 0.5,
        headroom: float = 1.0,
        refusal_hold_s: float = 0.0,
    ) -> None:
        self.client = client
        # After a refusal, the same answer is given for this long without asking Redis (see held_refusal).
        self.refusal_hold_s = refusal_hold_s
        self._held: dict[str, tuple[float, Decision]] = {}
        # The share of a request's remaining time the queue ahead may take: the rest is for its own
        # inference, and for the drain rate to be lower than measured (as it is under overload).
        self.headroom = headroom
        self.heartbeat_s = heartbeat_s
        self.rate_window_s = rate_window_s
        self.cache_s = cache_s
        self._script = client.register_script(_ADMIT_LUA)
        self._capacity: dict[str, tuple[float, int, float | None]] = {}

    async def capacity(self, model: str) -> tuple[int, float | None]:
        """(children alive serving the model, drain rate per second or None when not yet measured)."""
        now = time.time()
        cached = self._capacity.get(model)
        if cached and now - cached[0] < self.cache_s:
            return cached[1], cached[2]
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(WORKERS_KEY)
        pipe.get(last_rate_key(model))
        second = int(now)
        for offset in range(self.rate_window_s):
            pipe.hgetall(rate_key(model, second - offset))
        workers_raw, last_per_child, *buckets = await pipe.execute()
        children = sum(
            1
            for w in alive_workers(workers_raw, self.heartbeat_s, now)
            if w["queue"] == "online" and model in w["models"]
        )
        rate = drain_rate_per_s(buckets, children)
        if rate is not None:
            await self.client.set(last_rate_key(model), rate / children, ex=LAST_RATE_TTL_S)
        elif last_per_child and children:
            # Idle for the whole window: the last measured rate, not "unknown". Unknown would admit up
            # to max_backlog at once, and a burst after a quiet spell would queue past its deadline.
            rate = float(last_per_child) * children
        self._capacity[model] = (now, children, rate)
        return children, rate

    def held_refusal(self, model: str, deadline_ms: float) -> Decision | None:
        """This process's last refusal for `model`, if it is recent and would apply to this request too.

        No I/O: under overload most requests are refused, and asking Redis each time cost the web
        tier CPU that the workers needed. Safe for goodput: the hold is never longer than the work the
        refused request saw queued ahead of it (see admit); a backlog_full refusal applies to any
        request; a deadline refusal to a request whose deadline the same rule, on the same figures
        (queue ahead, drain rate), would refuse.
        """
        held = self._held.get(model)
        if held is None or time.monotonic() >= held[0]:
            return None
        decision = held[1]
        if decision.reason == "backlog_full":
            return decision
        wait_s = decision.predicted_wait_s
        return decision if wait_s is not None and wait_s > self.headroom * deadline_ms / 1000 else None

    async def admit(self, spec: ModelSpec, request_id: str, deadline: float) -> Decision:
        children, rate = await self.capacity(spec.name)
        if children == 0:
            return Decision(
                False, "no_worker", 0, spec.max_backlog, None, retry_after_s=max(1, math.ceil(3 * self.heartbeat_s))
            )
        now = time.time()
        remaining_s = (deadline - now) * self.headroom
        code, ahead = await self._script(
            keys=[backlog_key(spec.name)],
            args=[now, request_id, deadline, spec.max_backlog, rate or 0, remaining_s],
        )
        if code == 1:
            self._held.pop(spec.name, None)
            return Decision(True, None, int(ahead), spec.max_backlog, rate)
        reason = "backlog_full" if code == 0 else "deadline"
        retry = retry_after_s(reason, int(ahead), spec.max_backlog, rate, remaining_s)
        decision = Decision(False, reason, int(ahead), spec.max_backlog, rate, retry_after_s=retry)
        if self.refusal_hold_s > 0:
            # The queue that caused a deadline refusal holds more than `remaining_s` of work, so a hold
            # no longer than that cannot let the workers run dry (short deadlines get short holds).
            hold_s = min(self.refusal_hold_s, remaining_s) if reason == "deadline" else self.refusal_hold_s
            if hold_s > 0:
                self._held[spec.name] = (time.monotonic() + hold_s, decision)
        return decision

    async def release(self, model: str, request_id: str) -> None:
        await self.client.zrem(backlog_key(model), request_id)
