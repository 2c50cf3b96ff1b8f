"""The online backlog's ledger in Redis: the parts every process shares.

The web tier admits into it (inference/web/admission.py), a child releases each request the moment
its answer is written (on the same pipeline as the reply), the offline runner reads how much online
work is in flight, and monitoring purges expired entries. The keys are in inference/core/keys.py.
"""

from __future__ import annotations

import time

import redis

from inference.core.keys import backlog_key, backlog_keys

# Shared by both scripts: drop the entries of `ids` from the token totals (KEYS[2] id -> "cost:client",
# KEYS[3] "all" and "c:<client>" -> tokens).
FORGET_LUA = """
local function forget(ids)
  for _, id in ipairs(ids) do
    local v = redis.call('HGET', KEYS[2], id)
    if v then
      local sep = string.find(v, ':', 1, true)
      local cost = tonumber(string.sub(v, 1, sep - 1))
      local who = string.sub(v, sep + 1)
      redis.call('HINCRBY', KEYS[3], 'all', -cost)
      if redis.call('HINCRBY', KEYS[3], 'c:' .. who, -cost) <= 0 then redis.call('HDEL', KEYS[3], 'c:' .. who) end
      if redis.call('HINCRBY', KEYS[3], 'n:' .. who, -1) <= 0 then redis.call('HDEL', KEYS[3], 'n:' .. who) end
      redis.call('HDEL', KEYS[2], id)
    end
  end
end
"""

# Atomic across web processes: forget expired entries, then check every limit, then add.
# ARGV: now, id, deadline, max requests, max tokens, cost, client, rate (tokens/s, 0 = unknown),
#       usable seconds, client limit (tokens), client limit (requests), seconds a request alone may use.
# KEYS[3] also counts each client's requests ("n:<client>").
# Returns {code, requests ahead, tokens ahead, the client's tokens ahead, tokens served before this one}.
# Forget the entries whose deadline (their score) is before ARGV[1], with their tokens.
PURGE_LUA = (
    FORGET_LUA
    + """
local now = tonumber(ARGV[1])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  forget(expired)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
end
"""
)

# ARGV: the ids of requests that were answered (or will never run). Idempotent: an id already
# forgotten (released before, or purged at its deadline) changes nothing.
RELEASE_LUA = (
    FORGET_LUA
    + """
redis.call('ZREM', KEYS[1], unpack(ARGV))
forget(ARGV)
"""
)


def online_in_flight(client, models: list[str]) -> int:
    """Online requests admitted and not yet answered, over `models` (sync: for worker children)."""
    now = time.time()
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.zcount(backlog_key(model), now, "+inf")  # entries past their deadline are gone callers
    return sum(pipe.execute())


def queue_purge(pipe: redis.client.Pipeline, model: str, now: float) -> None:
    """Forget the model's entries whose deadline has passed (their tokens too), then count what is left:
    the pipeline's result for this call is the number of requests still admitted."""
    pipe.eval(PURGE_LUA + "return redis.call('ZCARD', KEYS[1])", 3, *backlog_keys(model), now)


def queue_release(pipe: redis.client.Pipeline, model: str, request_ids: list[str]) -> None:
    """Release answered requests from the backlog, queued on a worker's pipeline with their replies:
    the request stops counting against admission the moment its answer is written, and the web tier
    spends no round trip of its own on it."""
    if request_ids:
        # EVAL, not EVALSHA: a pipeline cannot recover from NOSCRIPT, and Redis caches the compiled
        # script by its hash anyway.
        pipe.eval(RELEASE_LUA, 3, *backlog_keys(model), *request_ids)
