"""The reply channel of online requests: a worker pushes JSON answers to Redis lists.

A request's message names its web process's inbox (`reply_to`, inference/web/inbox.py): the worker pushes
the answer there after the request's id, and one listener per web process hands it to the waiting caller.
Before, each waiting caller BLPOPed a list of its own: a pooled Redis connection held per waiting request
(WEB_REDIS_MAX_CONNECTIONS bounded a process's concurrency) and a command per request. A message without
`reply_to` (one published by hand, as tests do) is answered on its own list, `reply_key(id)`.

Why not Celery's result backend: waiting on it means its pub/sub result consumer, where an answer that
arrives while no one listens is lost; a list keeps it until it is read, and expires by itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis

from inference.core.keys import reply_key

REPLY_TTL_S = 60


def route_of(request: Any) -> dict[str, Any]:
    """The fields a reply to `request` carries for `queue_replies`: the slice it answers (`part`, see
    inference/dispatch/fair.py) and where it goes (`reply_to`, taken off before it is written)."""
    fields = {}
    if part := request.kwargs.get("part"):
        fields["part"] = part
    if inbox := request.kwargs.get("reply_to"):
        fields["reply_to"] = inbox
    return fields


def queue_replies(pipe: redis.client.Pipeline, replies: dict[str, dict[str, Any]]) -> None:
    """Queue answers for many requests on a pipeline (executed by the caller, with whatever else it writes):
    one RPUSH per inbox for all its answers, or a list of its own for an answer whose request named none."""
    by_inbox: dict[str, list[str]] = {}
    for task_id, payload in replies.items():
        inbox = payload.get("reply_to")
        if inbox:
            # "<id> <answer>": the inbox's listener routes by the id without parsing the answer, which
            # its own waiting request parses (an answer may be half a megabyte of embeddings).
            body = json.dumps({k: v for k, v in payload.items() if k != "reply_to"}, separators=(",", ":"))
            by_inbox.setdefault(inbox, []).append(f"{task_id} {body}")
        else:
            key = reply_key(task_id)
            pipe.rpush(key, json.dumps(payload, separators=(",", ":")))
            pipe.expire(key, REPLY_TTL_S)
    for inbox, bodies in by_inbox.items():
        pipe.rpush(inbox, *bodies)
        pipe.expire(inbox, REPLY_TTL_S)  # a web process that died leaves nothing behind for long


async def gather_reply(
    next_reply: Callable[[float], Awaitable[dict[str, Any] | None]], texts: int, deadline: float
) -> dict[str, Any] | None:
    """The whole answer for a request of `texts` texts, which the dispatcher may have cut into parts
    (each reply then carries `part: [start, end, total]`); None when it is not complete by `deadline`.
    `next_reply(timeout_s)` is the request's next reply, None when none came in time.

    The first failed part is the answer: the caller gets that error, not a partial result.
    """
    outputs: list[Any] = [None] * texts
    seen: set[int] = set()  # part starts already gathered: a redelivered duplicate is not counted twice
    covered = 0
    merged: dict[str, Any] | None = None
    while covered < texts:
        remaining_s = deadline - time.time()
        reply = await next_reply(remaining_s) if remaining_s > 0 else None
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
