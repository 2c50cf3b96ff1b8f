"""Redis clients for this process: one sync client (workers, management commands), one async per event loop (web)."""

from __future__ import annotations

import asyncio
import os

import redis
import redis.asyncio as aredis
from django.conf import settings

_sync: tuple[int, redis.Redis] | None = None
_async: dict[int, aredis.Redis] = {}


def get_redis() -> redis.Redis:
    """The process's sync client; a forked child never reuses its parent's sockets."""
    global _sync
    if _sync is None or _sync[0] != os.getpid():
        client = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, health_check_interval=30)
        _sync = (os.getpid(), client)
    return _sync[1]


def get_async_redis() -> aredis.Redis:
    """The async client of the running event loop (uvicorn runs one loop per process).

    Each waiting predict call holds one pooled connection in BLPOP, so the pool is sized for the
    web tier's concurrency, not for its CPU count. That BLPOP lasts up to the request's deadline, so the
    read timeout must be longer than the longest deadline: redis-py's default of 5 s turned every answer
    slower than that into a 503 while it was on its way. Connecting keeps a short timeout.
    """
    loop_id = id(asyncio.get_running_loop())
    client = _async.get(loop_id)
    if client is None:
        client = aredis.Redis.from_url(
            settings.REDIS_URL,
            decode_responses=True,
            max_connections=settings.WEB_REDIS_MAX_CONNECTIONS,
            socket_timeout=settings.ONLINE_MAX_DEADLINE_MS / 1000 + 5,
            socket_connect_timeout=5,
        )
        _async[loop_id] = client
    return client


# Applies Increments (below): KEYS are the hashes; ARGV[1] is the number of increments, then
# (key index, field, value) for each, then (key index, seconds) for each expiry.
_INCREMENTS_LUA = """
local n = tonumber(ARGV[1])
local i = 2
for _ = 1, n do
  local key, field, value = KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2]
  if string.find(value, '[.eEn]') then
    redis.call('HINCRBYFLOAT', key, field, value)
  else
    redis.call('HINCRBY', key, field, value)
  end
  i = i + 3
end
while i < #ARGV do
  redis.call('EXPIRE', KEYS[tonumber(ARGV[i])], ARGV[i + 1])
  i = i + 2
end
"""


class Increments:
    """Many HINCRBY / HINCRBYFLOAT / EXPIRE commands, sent as one script call.

    It takes the calls a pipeline would (so the functions that write counters can write to either),
    and `queue_on(pipe)` turns them into a single EVAL. A worker child writes some twenty counters per
    batch: as commands, each is packed and its reply parsed in Python, which cost more CPU than the
    batch itself on a model that costs nothing (benchmarks/overhead.py).
    """

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}
        self._increments: list[str] = []
        self._expiries: dict[int, int] = {}

    def _key(self, key: str) -> str:
        return str(self._keys.setdefault(key, len(self._keys) + 1))

    def hincrby(self, key: str, field: str, value: int) -> None:
        self._increments += [self._key(key), field, str(int(value))]

    def hincrbyfloat(self, key: str, field: str, value: float) -> None:
        self._increments += [self._key(key), field, repr(float(value))]

    def expire(self, key: str, seconds: int) -> None:
        self._expiries[int(self._key(key))] = int(seconds)

    def queue_on(self, pipe: redis.client.Pipeline) -> None:
        if not self._increments and not self._expiries:
            return
        expiries = [str(v) for pair in self._expiries.items() for v in pair]
        pipe.eval(
            _INCREMENTS_LUA, len(self._keys), *self._keys, len(self._increments) // 3, *self._increments, *expiries
        )
