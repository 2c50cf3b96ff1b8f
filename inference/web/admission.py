"""Admission control: a bounded online backlog priced in tokens, fair between clients, shared through Redis.

Every request is priced by what it will cost the model: its texts' token counts (inference/core/tokens.py).
A request is refused at once, before anything is queued, when
  - no online worker serves its model (503 `no_worker`);
  - it could not finish within its own deadline even on an empty queue (413 `request_too_large`:
    retrying cannot help; the message says what fits and what to do instead);
  - the model's backlog is at its limit in requests or tokens (503 `backlog_full`);
  - its client already holds its share of the backlog (429 `client_backlog_full`), so one client's
    excess is refused while other clients are still admitted;
  - it would not be served before its deadline (503 `deadline`). The wait is estimated as the
    dispatcher serves (inference/dispatch/fair.py: fair queuing by tokens): before this request is done,
    every other client is served at most as many tokens as this client has waiting, itself included.
    So a light client is not refused because a heavy one queued a lot.
The drain rate is tokens per busy child-second times the children alive: it does not collapse after
a burst of heavy requests, as a rate in requests did. The backlog is a sorted set of request ids
scored by deadline, so an entry whose caller died disappears once its deadline has passed (with its
tokens), and the counts cannot leak.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import redis.asyncio as aredis

from inference.core.backlog import PURGE_LUA, RELEASE_LUA
from inference.core.keys import (
    DISPATCHERS_KEY,
    WORKERS_KEY,
    backlog_keys,
    last_rate_key,
    rate_key,
)
from inference.core.registry import ModelSpec
from inference.core.workers import drain_rate_per_s, serving_workers
from platform_.redis import CoalescedScript

_ADMIT_LUA = (
    PURGE_LUA
    + """
-- A call run twice: redis-py resends a command, or a whole pipeline of them (platform_.redis.CoalescedScript),
-- when a connection error takes its reply. Already admitted and queued: neither again (the totals would
-- keep its cost for ever, since its release subtracts it once).
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then return {1, 0, 0, 0, 0} end
local n = redis.call('ZCARD', KEYS[1])
local cost = tonumber(ARGV[6])
local mine_field = 'c:' .. ARGV[7]
local totals = redis.call('HGETALL', KEYS[3])
local all, mine = 0, 0
for i = 1, #totals, 2 do
  if totals[i] == 'all' then all = tonumber(totals[i + 1]) elseif totals[i] == mine_field then mine = tonumber(totals[i + 1]) end
end
-- Fair queuing: before this request is done, each other client is served at most what this client
-- has waiting, this request included. `ahead` is that work without this request's own cost.
local ahead = mine
for i = 1, #totals, 2 do
  local f = totals[i]
  if string.sub(f, 1, 2) == 'c:' and f ~= mine_field then ahead = ahead + math.min(tonumber(totals[i + 1]), mine + cost) end
end
local fair = ahead + cost
-- The client's own share first: one client filling a global limit must be told so, not everyone.
local limit = tonumber(ARGV[10])
local mine_n = tonumber(redis.call('HGET', KEYS[3], 'n:' .. ARGV[7]) or '0')
if mine > 0 and (mine + cost > limit or mine_n >= tonumber(ARGV[11])) then return {-2, n, all, mine, fair} end
if n >= tonumber(ARGV[4]) or (n > 0 and all + cost > tonumber(ARGV[5])) then return {0, n, all, mine, fair} end
local rate = tonumber(ARGV[8])
-- The work ahead must drain within `headroom` of the deadline, and with this request's own work
-- within the share a request alone may use (the 413 bound, so no request is refused forever).
if rate > 0 and (ahead / rate > tonumber(ARGV[9]) or fair / rate > tonumber(ARGV[12])) then
  return {-1, n, all, mine, fair}
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[6] .. ':' .. ARGV[7])
redis.call('HINCRBY', KEYS[3], 'all', cost)
redis.call('HINCRBY', KEYS[3], mine_field, cost)
redis.call('HINCRBY', KEYS[3], 'n:' .. ARGV[7], 1)
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], 3600) end
-- KEYS[4], when given: the queue the admitted request's message (ARGV[13]) goes onto, in the same
-- round trip and atomically with its admission.
if KEYS[4] then redis.call('LPUSH', KEYS[4], ARGV[13]) end
return {1, n, all, mine, fair}
"""
)

LAST_RATE_TTL_S = 24 * 3600
# A request alone must fit in this share of its deadline at the full drain rate: the rest is for
# the hops around the model and for the rate dipping.
ALONE_SHARE = 0.8


@dataclass(frozen=True)
class Decision:
    """What admission said, with the figures that a refusal message and Retry-After are made of."""

    admitted: bool
    reason: str | None
    backlog: int  # requests ahead
    limit: int  # the limit that was hit (requests, or tokens for the token limits)
    drain_rate_per_s: float | None  # tokens per second, all serving children together
    retry_after_s: int = 0
    cost: int = 0  # this request's tokens
    tokens_ahead: int = 0  # tokens served before this request would be done (fair estimate)
    client_tokens: int = 0  # tokens this client already has waiting
    status: int = 503
    client_requests: int = 0  # the most requests one client may have waiting
    cost_at_least: bool = False  # counting stopped once the cost was past what fits

    @property
    def predicted_wait_s(self) -> float | None:
        return None if not self.drain_rate_per_s else self.tokens_ahead / self.drain_rate_per_s

    def message(self, model: str) -> str:
        if self.reason == "no_worker":
            return f"no online worker is serving model {model!r}; retry later"
        if self.reason == "backlog_full":
            return (
                f"model {model!r} has {self.backlog} requests waiting, its limit is {self.limit} "
                f"(requests, or tokens for a token limit); retry later"
            )
        if self.reason == "client_backlog_full":
            return (
                f"this client already has {self.client_tokens} tokens of requests waiting for model {model!r}; "
                f"one client may hold at most {self.limit} tokens ({self.client_requests} requests) at a time "
                f"and this request costs {self.cost}; "
                f"retry once earlier requests are answered, or send fewer texts at a time"
            )
        if self.reason == "request_too_large":
            costs = f"at least {self.cost}" if self.cost_at_least else f"{self.cost}"
            return (
                f"this request costs {costs} tokens, and at most {self.limit} fit within its deadline "
                f"for model {model!r} even with nothing else queued; split it into smaller requests, "
                f"allow a longer deadline with X-Deadline-Ms (within the server's maximum), "
                f"or submit it as a job (POST /api/v1/jobs)"
            )
        wait = self.predicted_wait_s or 0.0
        rate = self.drain_rate_per_s or 0.0
        return (
            f"model {model!r} cannot meet this request's deadline: {self.tokens_ahead} tokens would be served "
            f"before it is done, at {rate:.0f} tokens/s a {wait * 1000:.0f} ms wait; "
            f"retry later or allow a longer deadline"
        )


def retry_after_s(reason: str, backlog: int, limit: int, rate_per_s: float | None, remaining_s: float) -> int:
    """Seconds until the refusal would likely not repeat, from the drain rate (in the unit of
    `backlog` and `limit`); at least 1."""
    if not rate_per_s:
        return 1
    if reason in ("backlog_full", "client_backlog_full"):
        wait = (backlog - limit + 1) / rate_per_s
    else:  # deadline: until the work ahead is short enough to drain within this deadline
        wait = backlog / rate_per_s - remaining_s
    return max(1, math.ceil(wait))


class Admission:
    """Admits and releases online requests for one web process; caches the capacity estimate briefly."""

    def __init__(
        self,
        client: aredis.Redis,
        *,
        heartbeat_s: float,
        rate_window_s: int,
        cache_s: float = 0.5,
        headroom: float = 1.0,
        refusal_hold_s: float = 0.0,
        dispatcher_heartbeat_s: float = 1.0,
        max_backlog_tokens: int = 1 << 40,
        client_share: float = 1.0,
        default_deadline_s: float = 2.0,
        request_overhead: int = 0,
    ) -> None:
        self.client = client
        # After a refusal, the same answer is given for this long without asking Redis (see held_refusal).
        self.refusal_hold_s = refusal_hold_s
        self._held: dict[tuple[str, str], tuple[float, Decision]] = {}
        # The share of a request's remaining time the work ahead may take: the rest is for its own
        # dispatch, and for the drain rate to be lower than measured (as it is under overload).
        self.headroom = headroom
        self.heartbeat_s = heartbeat_s
        self.dispatcher_heartbeat_s = dispatcher_heartbeat_s
        self.rate_window_s = rate_window_s
        self.cache_s = cache_s
        self.max_backlog_tokens = max_backlog_tokens
        self.client_share = client_share
        # A client's share is of what the model can drain within the default deadline: a property of
        # the model, not of one request's own (short) deadline, which the deadline rule checks.
        self.default_deadline_s = default_deadline_s
        # A request no bigger than twice the fixed cost of one is never "too large": when it does not
        # fit its deadline, the deadline is the problem (503 deadline), not its size.
        self.request_overhead = request_overhead
        # Coalesced: the admissions a pass of the event loop starts share one round trip.
        self._admit_script = CoalescedScript(client, _ADMIT_LUA)
        self._release_script = client.register_script(RELEASE_LUA)
        self._capacity: dict[str, tuple[float, int, float | None]] = {}

    async def capacity(self, model: str) -> tuple[int, float | None]:
        """(children serving the model, drain rate in tokens per second or None when not yet measured)."""
        now = time.time()
        cached = self._capacity.get(model)
        if cached and now - cached[0] < self.cache_s:
            return cached[1], cached[2]
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(WORKERS_KEY)
        pipe.hgetall(DISPATCHERS_KEY)
        pipe.get(last_rate_key(model))
        second = int(now)
        for offset in range(self.rate_window_s):
            pipe.hgetall(rate_key(model, second - offset))
        workers_raw, dispatchers_raw, last_per_child, *buckets = await pipe.execute()
        children = sum(
            1
            for w in serving_workers(workers_raw, dispatchers_raw, self.heartbeat_s, self.dispatcher_heartbeat_s, now)
            if w["queue"] == "online" and model in w["models"]
        )
        rate = drain_rate_per_s(buckets, children, unit="tokens")
        if rate is not None:
            await self.client.set(last_rate_key(model), rate / children, ex=LAST_RATE_TTL_S)
        elif last_per_child and children:
            # Idle for the whole window: the last measured rate, not "unknown". Unknown would admit up
            # to the backlog limit at once, and a burst after a quiet spell would queue past its deadline.
            rate = float(last_per_child) * children
        self._capacity[model] = (now, children, rate)
        return children, rate

    def held_refusal(self, model: str, client_key: str, deadline_ms: float) -> Decision | None:
        """This process's last refusal of this caller for `model`, if it is recent and would apply to
        this request too.

        No I/O: under overload most requests are refused, and asking Redis each time cost the web
        tier CPU that the workers needed. Safe for goodput: the hold is never longer than the work the
        refused request saw queued ahead of it (see admit); a backlog_full or client share refusal
        applies to the same caller's next requests; a deadline refusal only to a request whose deadline
        the same rule, on the same figures, would refuse.
        """
        held = self._held.get((model, client_key))
        if held is None or time.monotonic() >= held[0]:
            return None
        decision = held[1]
        if decision.reason in ("backlog_full", "client_backlog_full"):
            return decision
        wait_s = decision.predicted_wait_s
        return decision if wait_s is not None and wait_s > self.headroom * deadline_ms / 1000 else None

    def _hold(self, model: str, client_key: str, decision: Decision, remaining_s: float) -> None:
        if self.refusal_hold_s <= 0:
            return
        # The work that caused a deadline refusal takes longer than `remaining_s` to drain, so a hold no
        # longer than that cannot let the workers run dry (short deadlines get short holds).
        hold_s = min(self.refusal_hold_s, remaining_s) if decision.reason == "deadline" else self.refusal_hold_s
        if hold_s <= 0:
            return
        if len(self._held) > 10_000:
            self._held.clear()
        # Always this caller's own hold: another client's request may still be admitted (a global limit
        # that this client filled is re-checked for the next caller, not held against it).
        self._held[(model, client_key)] = (time.monotonic() + hold_s, decision)

    def alone_fits(self, rate: float | None, remaining_s: float) -> int:
        """The most tokens one request may cost and still finish within `remaining_s` on an empty queue."""
        if not rate:
            return self.max_backlog_tokens
        return min(self.max_backlog_tokens, int(rate * remaining_s * ALONE_SHARE))

    def too_large(self, cost: int, fits: int, rate: float | None, *, at_least: bool = False) -> Decision:
        """413: the request could not finish within its own deadline even on an empty queue."""
        return Decision(False, "request_too_large", 0, fits, rate, cost=cost, status=413, cost_at_least=at_least)

    async def admit(
        self,
        spec: ModelSpec,
        request_id: str,
        deadline: float,
        *,
        cost: int = 1,
        client: str = "",
        client_key: str = "",
        message: bytes | None = None,
        queue: str = "",
    ) -> Decision:
        """Admit `request_id` (costing `cost` tokens, sent by `client`) or say why not.

        `client_key` is how the early refusal path recognises the same caller from headers alone.
        With `message`, an admitted request's message is pushed onto `queue` by the same script: one
        round trip instead of two, and nothing is ever admitted without being queued or the reverse.
        A `redis.RedisError` leaves it unknown whether either happened (release, then answer 503).
        """
        children, rate = await self.capacity(spec.name)
        if children == 0:
            retry = max(1, math.ceil(3 * self.dispatcher_heartbeat_s))
            return Decision(False, "no_worker", 0, spec.max_backlog, None, retry_after_s=retry, cost=cost)
        now = time.time()
        remaining_s = deadline - now
        if remaining_s <= 0:
            return Decision(False, "deadline", 0, spec.max_backlog, rate, 1, cost)
        max_tokens = self.max_backlog_tokens
        alone_fits = self.alone_fits(rate, remaining_s)
        if cost > alone_fits and cost > 2 * self.request_overhead:
            return self.too_large(cost, alone_fits, rate)
        usable_s = remaining_s * self.headroom
        # A client may hold `client_share` of what the model drains within the default deadline. At the
        # default deadline the deadline rule (at `headroom` of it) binds first for a lone client; the share
        # bounds a client whose requests ask for long deadlines, and what any one client can queue.
        share_of = max_tokens if not rate else min(max_tokens, rate * self.default_deadline_s)
        client_limit = max(1, int(self.client_share * share_of))
        client_requests = max(1, int(self.client_share * spec.max_backlog))
        keys = backlog_keys(spec.name)
        code, ahead, all_tokens, mine, fair = await self._admit_script(
            keys=keys if message is None else [*keys, queue],
            args=[
                now,
                request_id,
                deadline,
                spec.max_backlog,
                max_tokens,
                cost,
                client,
                rate or 0,
                usable_s,
                client_limit,
                client_requests,
                remaining_s * ALONE_SHARE,
                *(() if message is None else (message,)),
            ],
        )
        ahead, all_tokens, mine, fair = int(ahead), int(all_tokens), int(mine), int(fair)
        if code == 1:
            self._held.pop((spec.name, client_key), None)
            return Decision(True, None, ahead, spec.max_backlog, rate, cost=cost, tokens_ahead=fair, client_tokens=mine)
        if code == 0:
            if ahead >= spec.max_backlog:
                limit, excess_tokens = spec.max_backlog, (ahead - spec.max_backlog + 1) * all_tokens / max(ahead, 1)
            else:
                limit, excess_tokens = max_tokens, all_tokens + cost - max_tokens
            retry = max(1, math.ceil(excess_tokens / rate)) if rate else 1
            decision = Decision(False, "backlog_full", ahead, limit, rate, retry, cost, fair, mine)
        elif code == -2:
            retry = retry_after_s("client_backlog_full", mine + cost, client_limit, rate, usable_s)
            decision = Decision(
                False, "client_backlog_full", ahead, client_limit, rate, retry, cost, fair, mine, 429, client_requests
            )
        else:
            retry = retry_after_s("deadline", fair, 0, rate, usable_s)
            decision = Decision(False, "deadline", ahead, spec.max_backlog, rate, retry, cost, fair, mine)
        self._hold(spec.name, client_key, decision, usable_s)
        return decision

    async def release(self, model: str, request_id: str) -> None:
        """Forget an admitted request whose caller gives up on it (the worker releases the answered ones)."""
        await self._release_script(keys=backlog_keys(model), args=[request_id])
