"""Redis clients for this process: one sync client (workers, management commands), one async per event loop (web).

With REDIS_SENTINELS set, every client here asks the sentinels where the primary is (redis-py's
`Sentinel.master_for`) instead of connecting to REDIS_URL's host: after a failover a connection to the
old primary fails (refused, or READONLY once it is back as a replica, which redis-py turns into a
ConnectionError), and the next connection goes to the promoted replica. REDIS_URL still says the
password and database number. Celery's broker and result backend follow the same sentinels
(platform_/settings/base.py), and so does Django's cache (`SentinelCachePool` below).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from typing import Any

import redis
import redis.asyncio as aredis
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.sentinel
from django.conf import settings
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import parse_url
from redis.retry import Retry

logger = logging.getLogger(__name__)

_sync: tuple[int, redis.Redis] | None = None
_async: dict[tuple[int, bool], aredis.Redis] = {}

# A connection error is retried with jittered backoff from 10 ms to 1 s between tries, as redis-py
# does by default for a client it builds from a URL (a Sentinel-managed pool gets no retry unless given).
_BACKOFF_BASE_S, _BACKOFF_CAP_S = 0.01, 1.0
# The web tier's tries: redis-py's default, a few seconds at most. A predict call has a deadline of
# seconds, so it cannot wait out a failover; it answers 503 broker_unavailable (Retry-After: 1) instead.
_WEB_RETRIES = 10


class _SentinelConnection(redis.sentinel.SentinelManagedConnection):
    """redis-py's, except that every reconnection asks the sentinels where the primary is.

    redis-py's reconnects a dropped connection inside a command (send_packed_command) to the address it
    had, not through the sentinels: after a read timed out on a frozen primary (whose kernel still
    accepts connections), each retry went back to it and timed out again, for as many retries as given.
    A failed attempt also closes its socket, or the next one would take the open socket as connected.
    """

    def connect(self) -> None:
        return self.retry.call_with_retry(self._connect_retry, lambda error: self.disconnect())

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            self.connect()
        return super().send_packed_command(command, check_health)


class _AsyncSentinelConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    """As _SentinelConnection, for the web tier's async clients."""

    async def connect(self) -> None:
        return await self.retry.call_with_retry(self._connect_retry, lambda error: self.disconnect())

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await self.connect()
        return await super().send_packed_command(command, check_health)


def sentinel_mode() -> bool:
    return bool(settings.REDIS_SENTINELS)


def sentinel_addresses() -> list[tuple[str, int]]:
    """REDIS_SENTINELS ("host:port,host:port") as (host, port) pairs."""
    pairs = []
    for item in settings.REDIS_SENTINELS:
        host, _, port = item.strip().rpartition(":")
        pairs.append((host.strip("[]"), int(port)))
    return pairs


def _sentinel_kwargs() -> dict[str, Any]:
    """How to talk to the sentinels themselves (a sentinel's own password is not the data password)."""
    password = settings.REDIS_SENTINEL_PASSWORD
    return {"socket_timeout": 2.0, "socket_connect_timeout": 2.0, **({"password": password} if password else {})}


def _data_kwargs() -> dict[str, Any]:
    """What REDIS_URL says besides its address: database number, user and password."""
    parsed = parse_url(settings.REDIS_URL)
    return {k: parsed[k] for k in ("db", "username", "password") if parsed.get(k) is not None}


def _sync_retries() -> int:
    # The jittered backoff averages about half its cap once it reaches it: two tries a second.
    return max(_WEB_RETRIES, int(2 * settings.REDIS_FAILOVER_RETRY_S))


def get_redis() -> redis.Redis:
    """The process's sync client; a forked child never reuses its parent's sockets.

    With sentinels, its commands retry through a failover for about REDIS_FAILOVER_RETRY_S: workers
    write replies, heartbeats and counters with it, and a counter written between a batch's rows and
    its chunk's end must not fail the batch. A retried increment whose reply was lost may count twice:
    only counters are written that way, never a job row (rows are in the database).
    """
    global _sync
    if _sync is None or _sync[0] != os.getpid():
        _sync = (os.getpid(), new_redis(health_check_interval=30, retries=_sync_retries()))
    return _sync[1]


def new_redis(*, retries: int = _WEB_RETRIES, **options: Any) -> redis.Redis:
    """A sync client of its own (`options` as redis.Redis takes them), REDIS_URL's server or the
    sentinels' primary; `retries` applies to the sentinels' primary only (REDIS_URL's keeps redis-py's)."""
    if not sentinel_mode():
        return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, **options)
    manager = redis.sentinel.Sentinel(sentinel_addresses(), sentinel_kwargs=_sentinel_kwargs())
    retry = Retry(ExponentialWithJitterBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S), retries)
    # A read timeout, so that a frozen primary is given up like a dead one (get_async_redis says why).
    options = {"socket_connect_timeout": 5, "socket_timeout": settings.REDIS_SOCKET_TIMEOUT_S, **options}
    return manager.master_for(
        settings.REDIS_SENTINEL_MASTER,
        decode_responses=True,
        retry=retry,
        connection_class=_SentinelConnection,
        **options,
        **_data_kwargs(),
    )


def get_async_redis(*, waits: bool = False) -> aredis.Redis:
    """The async client of the running event loop (uvicorn runs one loop per process); `waits=True`
    for the one that waits on replies (the inbox listener's BLPOP, inference/web/inbox.py).

    The read timeout is longer than the longest deadline: when each request BLPOPed its own answer,
    redis-py's default of 5 s turned every answer slower than that into a 503 while it was on its way,
    and other blocking reads may wait as long. Connecting keeps a short timeout.

    With sentinels, every other command goes through a second client whose read timeout is
    REDIS_SOCKET_TIMEOUT_S: a primary that froze, or whose host dropped off the network, closes no
    connection, and with the long timeout each admission would wait it out (15 s) before asking the
    sentinels where the primary went.
    """
    key = (id(asyncio.get_running_loop()), waits and sentinel_mode())
    client = _async.get(key)
    if client is None:
        options: dict[str, Any] = {
            "decode_responses": True,
            "max_connections": settings.WEB_REDIS_MAX_CONNECTIONS,
            "socket_timeout": settings.ONLINE_MAX_DEADLINE_MS / 1000 + 5,
            "socket_connect_timeout": 5,
        }
        if sentinel_mode():
            if not waits:
                options["socket_timeout"] = settings.REDIS_SOCKET_TIMEOUT_S
            manager = redis.asyncio.sentinel.Sentinel(sentinel_addresses(), sentinel_kwargs=_sentinel_kwargs())
            backoff = ExponentialWithJitterBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S)
            options["retry"] = redis.asyncio.retry.Retry(backoff, _WEB_RETRIES)
            options["connection_class"] = _AsyncSentinelConnection
            client = manager.master_for(settings.REDIS_SENTINEL_MASTER, **options, **_data_kwargs())
        else:
            client = aredis.Redis.from_url(settings.REDIS_URL, **options)
        _async[key] = client
    return client


class SentinelCachePool(redis.sentinel.SentinelConnectionPool):
    """Django's Redis cache (DRF's throttle counters) through the sentinels: Django builds its pool with
    `pool_class.from_url(LOCATION)`, and this one takes only the password and database from that URL."""

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> SentinelCachePool:
        parsed = {k: v for k, v in parse_url(url).items() if k in ("db", "username", "password")}
        manager = redis.sentinel.Sentinel(sentinel_addresses(), sentinel_kwargs=_sentinel_kwargs())
        retry = Retry(ExponentialWithJitterBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S), _WEB_RETRIES)
        timeouts = {"socket_timeout": settings.REDIS_SOCKET_TIMEOUT_S, "socket_connect_timeout": 5}
        options = {"connection_class": _SentinelConnection, **timeouts, **parsed, **kwargs}
        return cls(settings.REDIS_SENTINEL_MASTER, manager, retry=retry, **options)


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


class CoalescedScript:
    """A Lua script whose calls made in one pass of the event loop go to Redis in one pipeline.

    Under load a web process starts several predict calls per pass of its loop (a batch's answers
    wake their callers together, and they call again together), and each call ran the admission
    script in a round trip of its own: a socket write and a read in this process and in Redis, the
    largest self time in a profile of the web tier at 32 clients (docs/benchmarks.md, issue 23).
    The first call of a pass schedules the send for the next pass; every call made meanwhile joins it.
    A lone call waits for nothing: the next pass comes as soon as the current one ends. A pass's calls
    run in Redis in the order they were made. A Redis error reaches every call of its pipeline (each its
    own copy), as it would have reached each alone; one call's script error reaches that call only; a
    caller that hung up before its pass was sent is not sent.

    redis-py resends a whole pipeline when a connection error takes its replies, so a script called
    through here must be safe to run twice (the admission script is: inference/web/admission.py).
    One instance per client (so per event loop: get_async_redis gives each loop its own client).
    """

    # A pipeline's calls run back to back in Redis, and its payload (each admitted request's message) is
    # packed into one buffer here: bounded in calls and in bytes, so a pass with hundreds of calls, or a
    # client's few large requests, make no giant buffer (a call larger than the bytes goes alone).
    MAX_PER_ROUND_TRIP = 64
    MAX_BYTES_PER_ROUND_TRIP = 1 << 20

    def __init__(self, client: aredis.Redis, text: str) -> None:
        self.client = client
        self.script = client.register_script(text)
        self._pending: list[_Call] = []
        self._sending: set[asyncio.Task] = set()  # held: a task nobody references can be collected
        # Calls and round trips so far: what the coalescing saved (tests/platform/test_coalesced_script.py reads them).
        self.calls = 0
        self.round_trips = 0

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((keys, args, future))
        if len(self._pending) == 1:
            loop.call_soon(self._send_pending)
        return await future

    def _send_pending(self) -> None:
        pending, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send_in_order(pending))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_in_order(self, pending: list[_Call]) -> None:
        """One pipeline after the other, so Redis runs the pass's calls in the order they were made. After
        a Redis error the rest are not sent: they get the same error at once, not a retry budget each."""
        try:
            for part in self._round_trips(pending):
                error = await self._send(part)
                if error is not None:
                    _fail(pending, error)
                    return
        except BaseException as error:  # cancelled (the loop is shutting down): no caller is left waiting
            _fail(pending, redis.ConnectionError(f"not sent: {error!r}"))
            raise

    def _round_trips(self, pending: list[_Call]) -> Iterator[list[_Call]]:
        """`pending` cut, in order, into pipelines within MAX_PER_ROUND_TRIP calls and MAX_BYTES_PER_ROUND_TRIP."""
        part: list[_Call] = []
        size = 0
        for call in pending:
            call_size = sum(len(v) for v in (*call[0], *call[1]) if isinstance(v, str | bytes))
            if part and (len(part) == self.MAX_PER_ROUND_TRIP or size + call_size > self.MAX_BYTES_PER_ROUND_TRIP):
                yield part
                part, size = [], 0
            part.append(call)
            size += call_size
        if part:
            yield part

    async def _send(self, part: list[_Call]) -> Exception | None:
        """Run `part`'s calls and answer each; the error that stopped the round trip, if one did."""
        part = [call for call in part if not call[2].done()]  # its caller hung up before it was sent
        if not part:
            return None
        self.calls += len(part)
        self.round_trips += 1
        try:
            if len(part) == 1:
                keys, args, _ = part[0]
                results: list[Any] = [await self.script(keys=keys, args=args)]
            else:
                results = await self._pipelined(part)
        except redis.RedisError as error:
            return error
        except Exception as error:  # a bug here must not become every caller's 500: a 503 it is, logged once
            logger.exception("coalesced script calls failed")
            return redis.RedisError(f"script call failed: {error!r}")
        for (_, _, future), result in zip(part, results, strict=True):
            if future.done():  # its caller hung up meanwhile
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
        return None

    async def _pipelined(self, part: list[_Call]) -> list[Any]:
        """EVALSHA of every call in one round trip. Not redis-py's pipeline scripts, which check that each
        script exists with a round trip of their own before every pipeline. A server that lost the script
        (a restart, a failover) answers NOSCRIPT: it is loaded once, and those calls sent again together."""
        results = await self._evalsha(part)
        missing = [n for n, result in enumerate(results) if isinstance(result, redis.exceptions.NoScriptError)]
        if missing:
            await self.client.script_load(self.script.script)
            for n, result in zip(missing, await self._evalsha([part[n] for n in missing]), strict=True):
                results[n] = result
        return results

    async def _evalsha(self, part: list[_Call]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for keys, args, _ in part:
            pipe.evalsha(self.script.sha, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)


_Call = tuple[list[Any], list[Any], asyncio.Future]


def _fail(calls: list[_Call], error: Exception) -> None:
    """`error` to every call still waiting, each its own copy (one instance raised in many requests would
    gather all their tracebacks), caused by the original."""
    for _, _, future in calls:
        if future.done():
            continue
        try:
            own = type(error)(*error.args)
            own.__cause__ = error
        except Exception:  # an exception type that cannot be rebuilt from its args: the same one, then
            own = error
        future.set_exception(own)
