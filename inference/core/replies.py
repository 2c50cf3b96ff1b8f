"""The reply channel of online requests: a worker pushes one JSON answer to a per-request Redis list.

Why not Celery's result backend: waiting on it means its pub/sub result consumer, shared by every
waiting request of a web process. A list per request lets each caller BLPOP on its own key, an
answer that arrives before the caller starts waiting is not lost, and the key expires by itself.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis
import redis.asyncio as aredis

from inference.core.keys import reply_key

REPLY_TTL_S = 60


def queue_replies(pipe: redis.client.Pipeline, replies: dict[str, dict[str, Any]]) -> None:
    """Queue answers for many requests on a pipeline (executed by the caller, with whatever else it writes)."""
    for task_id, payload in replies.items():
        key = reply_key(task_id)
        pipe.rpush(key, json.dumps(payload, separators=(",", ":")))
        pipe.expire(key, REPLY_TTL_S)


async def wait_reply(client: aredis.Redis, task_id: str, timeout_s: float) -> dict[str, Any] | None:
    """The answer, or None when none came within timeout_s."""
    if timeout_s <= 0:
        return None
    # BLPOP's timeout has millisecond resolution; 0 would mean forever.
    item = await client.blpop([reply_key(task_id)], timeout=max(timeout_s, 0.001))
    return None if item is None else json.loads(item[1])


async def gather_reply(client: aredis.Redis, task_id: str, texts: int, deadline: float) -> dict[str, Any] | None:
    """The whole answer for a request of `texts` texts, which the dispatcher may have cut into parts
    (each reply then carries `part: [start, end, total]`); None when it is not complete by `deadline`.

    The first failed part is the answer: the caller gets that error, not a partial result.
    """
    outputs: list[Any] = [None] * texts
    seen: set[int] = set()  # part starts already gathered: a redelivered duplicate is not counted twice
    covered = 0
    merged: dict[str, Any] | None = None
    while covered < texts:
        reply = await wait_reply(client, task_id, deadline - time.time())
        if reply is None or not reply["ok"]:
            return reply
        start, end, _ = reply.get("part") or (0, texts, texts)
        if start in seen:
            continue
        seen.add(start)
        outputs[start:end] = reply["outputs"]
        covered += end - start
        if merged is None:
            merged = reply
        else:  # the request's timing: from its first part's queueing to its last part's inference
            first, last = merged["timing"], reply["timing"]
            last["queue_wait_ms"] = first["queue_wait_ms"]
            last["batch_size"] = max(first["batch_size"], last["batch_size"])
            merged = reply
    if merged is None or any(output is None for output in outputs):
        return {"ok": False, "error": "the worker's answer was incomplete", "code": "worker_failed"}
    merged["outputs"] = outputs
    merged.pop("part", None)
    return merged
