"""One reply inbox per web process: the answers to all its online requests arrive on one Redis list.

Before, every waiting request BLPOPed a list of its own: one Redis command and one pooled connection held
per waiting request, so a process's concurrency was bounded by its Redis connections
(WEB_REDIS_MAX_CONNECTIONS) and each answer cost a round trip of its own. Now a request's message names
this process's inbox (`reply_to`), a worker pushes all the answers of a batch to it in one RPUSH
(inference/core/replies.py), and one listener per event loop reads them (BLPOP, then whatever else is
there in one LPOP) and hands each, by the request id it starts with, to the request waiting for it,
which parses it (the listener never parses a whole answer: one of 64 embeddings is half a megabyte). An answer whose caller stopped waiting
(deadline, hang-up) finds no one and is dropped; the inbox expires REPLY_TTL_S after its last answer, so
a process that died leaves nothing behind for long.

A request registers (`expect`) before its message is published, so an answer can never arrive unseen.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import uuid
import weakref
from typing import Any

import redis.asyncio as aredis
from django.conf import settings

from inference.core.keys import inbox_key

logger = logging.getLogger(__name__)

# How long one BLPOP of the listener blocks: only how soon it notices a broken connection when idle.
LISTEN_S = 1.0
# Answers read at once after a wake-up. Bounded: an answer may be half a megabyte (64 embeddings), and
# the process holds what it reads until its request parses it.
DRAIN = 64
# Pause after a Redis error before listening again (waiting callers meanwhile run into their deadlines).
RETRY_S = 0.2


class Inbox:
    """The answers of one event loop's requests, by request id."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._waiting: dict[str, asyncio.Queue[str]] = {}
        self._listener: asyncio.Task | None = None

    def expect(self, task_id: str, client: aredis.Redis) -> asyncio.Queue[str]:
        """Start holding `task_id`'s answers; call `forget` when done with them."""
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen(client))
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._waiting[task_id] = queue
        return queue

    def forget(self, task_id: str) -> None:
        self._waiting.pop(task_id, None)

    async def next_reply(self, queue: asyncio.Queue[str], timeout_s: float) -> dict[str, Any] | None:
        """The next answer on `queue`, parsed here (in the waiting request's own task, not the listener's),
        or None when none came within `timeout_s`."""
        if queue.empty():
            try:
                async with asyncio.timeout(timeout_s):
                    body = await queue.get()
            except TimeoutError:
                return None
        else:
            body = queue.get_nowait()
        try:
            reply = json.loads(body)
            if isinstance(reply, dict) and "ok" in reply:
                return reply
        except ValueError:
            pass
        logger.warning("inbox %s: an answer that is not one: %.200r", self.key, body)
        return {"ok": False, "error": "the worker's answer could not be read", "code": "worker_failed"}

    def deliver(self, raw: str) -> None:
        """Hand "<id> <answer>" to the request waiting for it; an answer nobody waits for is dropped."""
        task_id, space, body = raw.partition(" ")
        if not space:
            logger.warning("inbox %s: dropped an answer without a request id: %.200r", self.key, raw)
            return
        queue = self._waiting.get(task_id)
        if queue is not None:
            queue.put_nowait(body)

    async def _listen(self, client: aredis.Redis) -> None:
        # A BLPOP unanswered this long past its own timeout is on a server that froze or went off the
        # network (no reset): give that connection up, so that after a Sentinel failover the listener
        # finds the new primary within REDIS_SOCKET_TIMEOUT_S, not the waiting client's long read timeout.
        stalled_s = LISTEN_S + settings.REDIS_SOCKET_TIMEOUT_S
        failing = False
        while True:
            try:
                async with asyncio.timeout(stalled_s):
                    item = await client.blpop([self.key], timeout=LISTEN_S)
                if item is not None:
                    self.deliver(item[1])
                    for raw in await client.lpop(self.key, DRAIN) or ():
                        self.deliver(raw)
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception:  # a Redis fault: waiting callers get 504 at their deadlines, as before
                if not failing:
                    logger.exception("reading the reply inbox %s failed; retrying", self.key)
                failing = True
                await asyncio.sleep(RETRY_S)


# One inbox per event loop (uvicorn runs one per process; tests may run several in one process).
_inboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_inbox() -> Inbox:
    loop = asyncio.get_running_loop()
    inbox = _inboxes.get(loop)
    if inbox is None:
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        inbox = _inboxes[loop] = Inbox(inbox_key(owner))
    return inbox
