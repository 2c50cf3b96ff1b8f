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
    web tier's concurrency, not for its CPU count.
    """
    loop_id = id(asyncio.get_running_loop())
    client = _async.get(loop_id)
    if client is None:
        client = aredis.Redis.from_url(
            settings.REDIS_URL, decode_responses=True, max_connections=settings.WEB_REDIS_MAX_CONNECTIONS
        )
        _async[loop_id] = client
    return client
