"""An API key's `last_used_at`, written without a database write per request.

Each web process notes a key's use in a Redis hash at most once per API_KEY_LAST_USED_RESOLUTION_S
(one HSET per key per minute per process, whatever the request rate); the sampler's housekeeping
(observability/sampler.py, one run per interval across the fleet) moves the hash into the database.
So `last_used_at` lags by up to the resolution plus the flush interval: fine for "was this key used
this week", which is what a user asks of it.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import redis
from django.conf import settings

from accounts.keys import LAST_USED_KEY
from platform_.redis import get_async_redis, get_redis

logger = logging.getLogger(__name__)

_noted_at: dict[int, float] = {}  # key id -> when this process last wrote it (monotonic)


def _due(key_id: int | None) -> bool:
    if key_id is None:
        return False
    now = time.monotonic()
    if now - _noted_at.get(key_id, -1e9) < settings.API_KEY_LAST_USED_RESOLUTION_S:
        return False
    if len(_noted_at) > 100_000:
        _noted_at.clear()
    _noted_at[key_id] = now
    return True


async def touch(key_id: int | None) -> None:
    """Note that a key was just used (async web paths). Redis down: the note is skipped, not the call."""
    if _due(key_id):
        try:
            await get_async_redis().hset(LAST_USED_KEY, str(key_id), int(time.time()))
        except redis.RedisError:
            logger.warning("last_used_at of key %s not noted: Redis unavailable", key_id)


def touch_sync(key_id: int | None) -> None:
    """The same for DRF's sync views."""
    if _due(key_id):
        try:
            get_redis().hset(LAST_USED_KEY, str(key_id), int(time.time()))
        except redis.RedisError:
            logger.warning("last_used_at of key %s not noted: Redis unavailable", key_id)


def flush() -> int:
    """Move the noted uses into ApiKey.last_used_at (never backwards); the number of keys written."""
    from accounts.models import ApiKey

    client = get_redis()
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(LAST_USED_KEY)
    pipe.delete(LAST_USED_KEY)
    noted, _ = pipe.execute()
    written = 0
    for key_id, epoch_s in noted.items():
        used_at = datetime.fromtimestamp(int(epoch_s), tz=UTC)
        written += ApiKey.objects.filter(pk=int(key_id)).exclude(last_used_at__gte=used_at).update(last_used_at=used_at)
    return written
