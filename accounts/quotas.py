"""Quotas and rates of online calls (predict, embeddings), per user and per key, beside the fair share.

- Requests per second: a token bucket per user (and per key with an override) in Redis, refilled at
  `requests_per_s` up to `burst`; one Lua script checks every bucket of the call and takes from all
  of them only when all have room, so a key's refusal does not spend its user's allowance.
- Tokens per UTC day: the day's tokens so far (added by accounts/usage.record with the usage, in the
  same round trip) against the limit. A call is priced after it runs, so the call that crosses the
  limit is answered and the next ones are refused until midnight UTC, as OpenAI's daily limits do.

A refusal is a 429 with Retry-After and the limit's name in the JSON: `rate_limited` or
`daily_tokens_exceeded`, `"limit": {"name", "applies_to", "value"}`. Redis down: the call is let
through (the admission after this would refuse it anyway with its own 503).

Limits come from settings (QUOTA_*) unless staff set an override (accounts.models.Quota); they are
read with the credential and cached with it, and an override saved tells every web process at once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from django.conf import settings

from accounts.keys import bucket_key, day_tokens_key
from platform_.redis import get_async_redis

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """One owner's limits (0: none)."""

    scope: str  # "user" or "key"
    owner_id: int
    requests_per_s: float
    burst: int
    tokens_per_day: int


def limits_for(user: Any, key_id: int | None) -> tuple[Limits, ...]:
    """The limits that apply to a call of this user through this key (a DB read: done with the credential's)."""
    from accounts.models import Quota

    overrides = {(q.user_id, q.api_key_id): q for q in Quota.objects.filter(user=user)}
    if key_id is not None:
        overrides.update({(q.user_id, q.api_key_id): q for q in Quota.objects.filter(api_key_id=key_id)})
    user_quota = overrides.get((user.pk, None))
    found = [
        Limits(
            "user",
            user.pk,
            _pick(user_quota, "requests_per_s", settings.QUOTA_REQUESTS_PER_S),
            int(_pick(user_quota, "burst", settings.QUOTA_BURST)),
            int(_pick(user_quota, "tokens_per_day", settings.QUOTA_TOKENS_PER_DAY)),
        )
    ]
    key_quota = overrides.get((None, key_id)) if key_id is not None else None
    if key_quota is not None:
        found.append(
            Limits(
                "key",
                key_id,
                key_quota.requests_per_s or 0.0,
                key_quota.burst or max(1, math.ceil(key_quota.requests_per_s or 0)),
                key_quota.tokens_per_day or 0,
            )
        )
    return tuple(found)


def _pick(quota: Any, name: str, default: float) -> float:
    value = getattr(quota, name, None) if quota is not None else None
    return default if value is None else value


# KEYS: the buckets, then the day's tokens hash. ARGV: the number of buckets; per bucket its rate per
# second and burst; then per daily limit its field and limit. Returns {0} when admitted, else
# {1, index of the bucket (1-based), wait in ms} or {2, index of the daily limit (1-based)}.
_ADMIT_LUA = """
local n = tonumber(ARGV[1])
local pos = 2 + 2 * n
local tokens_key = KEYS[n + 1]
local d = 1
while ARGV[pos] do
  local used = tonumber(redis.call('HGET', tokens_key, ARGV[pos]) or '0')
  if used >= tonumber(ARGV[pos + 1]) then return {2, d} end
  pos = pos + 2
  d = d + 1
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local levels = {}
for i = 1, n do
  local rate = tonumber(ARGV[2 * i])
  local burst = tonumber(ARGV[2 * i + 1])
  local state = redis.call('HMGET', KEYS[i], 'level', 'at_ms')
  local level = tonumber(state[1]) or burst
  local at_ms = tonumber(state[2]) or now_ms
  level = math.min(burst, level + math.max(0, now_ms - at_ms) * rate / 1000)
  if level < 1 then return {1, i, math.ceil((1 - level) * 1000 / rate)} end
  levels[i] = level - 1
end
for i = 1, n do
  local rate = tonumber(ARGV[2 * i])
  local burst = tonumber(ARGV[2 * i + 1])
  redis.call('HSET', KEYS[i], 'level', tostring(levels[i]), 'at_ms', now_ms)
  redis.call('PEXPIRE', KEYS[i], math.ceil(burst * 1000 / rate) + 1000)
end
return {0}
"""


def _seconds_to_midnight(now: datetime) -> int:
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, math.ceil((tomorrow - now).total_seconds()))


def _refusal(limit: Limits, name: str, value: float, code: str, detail: str, wait_s: int) -> Exception:
    from platform_.errors import ApiError

    return ApiError(
        429,
        code,
        detail,
        headers={"Retry-After": str(wait_s)},
        limit={"name": name, "applies_to": limit.scope, "value": value},
    )


async def admit(limits: tuple[Limits, ...]) -> None:
    """Take one call from each bucket, or raise the 429 of the first limit that refuses it."""
    buckets = [lim for lim in limits if lim.requests_per_s > 0]
    daily = [lim for lim in limits if lim.tokens_per_day > 0]
    if not buckets and not daily:
        return
    now = datetime.now(UTC)
    keys = [bucket_key(lim.scope, lim.owner_id) for lim in buckets] + [day_tokens_key(now.date())]
    args: list[Any] = [len(buckets)]
    for lim in buckets:
        args += [lim.requests_per_s, max(1, lim.burst)]
    for lim in daily:
        args += [f"{lim.scope}:{lim.owner_id}", lim.tokens_per_day]
    client = get_async_redis()
    try:
        # A Script runs by EVALSHA (loading itself once per server); making one costs a SHA-1 of the text.
        answer = await client.register_script(_ADMIT_LUA)(keys=keys, args=args)
    except redis.RedisError:
        logger.warning("quotas not checked: Redis unavailable")
        return
    if answer[0] == 1:
        limit = buckets[int(answer[1]) - 1]
        wait_s = max(1, math.ceil(int(answer[2]) / 1000))
        raise _refusal(
            limit,
            "requests_per_s",
            limit.requests_per_s,
            "rate_limited",
            f"too many requests: this {limit.scope} may make {limit.requests_per_s:g} per second "
            f"(bursts of {limit.burst}); try again in {wait_s} s",
            wait_s,
        )
    if answer[0] == 2:
        limit = daily[int(answer[1]) - 1]
        wait_s = _seconds_to_midnight(now)
        raise _refusal(
            limit,
            "tokens_per_day",
            limit.tokens_per_day,
            "daily_tokens_exceeded",
            f"this {limit.scope} has used its {limit.tokens_per_day} tokens for today (UTC); "
            f"the allowance renews at midnight UTC, in {wait_s} s",
            wait_s,
        )
