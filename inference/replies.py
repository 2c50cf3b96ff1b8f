"""The reply channel of online requests: a worker pushes one JSON answer to a per-request Redis list.

Why not Celery's result backend: waiting on it means its pub/sub result consumer, shared by every
waiting request of a web process. A list per request lets each caller BLPOP on its own key, an
answer that arrives before the caller starts waiting is not lost, and the key expires by itself.
"""

from __future__ import annotations

import json
from typing import Any

import redis
import redis.asyncio as aredis

REPLY_TTL_S = 60


def reply_key(task_id: str) -> str:
    return f"inference:reply:{task_id}"


def push_replies(client: redis.Redis, replies: dict[str, dict[str, Any]]) -> None:
    """Deliver answers for many requests in one round trip."""
    if not replies:
        return
    pipe = client.pipeline(transaction=False)
    for task_id, payload in replies.items():
        key = reply_key(task_id)
        pipe.rpush(key, json.dumps(payload, separators=(",", ":")))
        pipe.expire(key, REPLY_TTL_S)
    pipe.execute()


async def wait_reply(client: aredis.Redis, task_id: str, timeout_s: float) -> dict[str, Any] | None:
    """The answer, or None when none came within timeout_s."""
    if timeout_s <= 0:
        return None
    # BLPOP's timeout has millisecond resolution; 0 would mean forever.
    item = await client.blpop([reply_key(task_id)], timeout=max(timeout_s, 0.001))
    return None if item is None else json.loads(item[1])
