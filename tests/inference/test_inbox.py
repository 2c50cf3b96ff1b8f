"""The reply inbox (inference/web/inbox.py) and the worker's side of it (inference/core/replies.py), on real Redis.

What a caller notices: its own answer (and every part of a sliced request) reaches it, whoever else is
waiting in the same process; an answer nobody waits for any more is dropped, not handed to someone else;
a process holds many waiting requests on one Redis connection; Redis going away and coming back costs
the callers waiting meanwhile, not the process's later requests.
"""

from __future__ import annotations

import asyncio
import json
import time

import redis
import redis.asyncio as aredis

from inference.core.keys import reply_key
from inference.core.replies import REPLY_TTL_S, gather_reply, queue_replies
from inference.web.inbox import Inbox


def push(client: redis.Redis, replies: dict[str, dict]) -> None:
    pipe = client.pipeline(transaction=False)
    queue_replies(pipe, replies)
    pipe.execute()


def test_a_batch_of_answers_goes_to_each_inbox_in_one_push_and_unrouted_answers_to_their_own_lists(redis_client):
    a, b = "inference:inbox:test-a", "inference:inbox:test-b"
    redis_client.delete(a, b, reply_key("lone"))
    pipe = redis_client.pipeline(transaction=False)
    queue_replies(
        pipe,
        {
            "r1": {"ok": True, "outputs": [1], "reply_to": a},
            "r2": {"ok": True, "outputs": [2], "reply_to": b, "part": [0, 1, 2]},
            "r3": {"ok": True, "outputs": [3], "reply_to": a},
            "lone": {"ok": True, "outputs": [4]},
        },
    )
    commands = [args[0] for args, _ in pipe.command_stack]
    pipe.execute()
    assert commands.count("RPUSH") == 3  # one per inbox, one for the request that named none

    def routed(raw: str) -> tuple[str, dict]:
        task_id, _, body = raw.partition(" ")
        return task_id, json.loads(body)

    assert [routed(x) for x in redis_client.lrange(a, 0, -1)] == [
        ("r1", {"ok": True, "outputs": [1]}),
        ("r3", {"ok": True, "outputs": [3]}),
    ]
    assert routed(redis_client.lrange(b, 0, -1)[0]) == ("r2", {"ok": True, "outputs": [2], "part": [0, 1, 2]})
    assert json.loads(redis_client.lpop(reply_key("lone"))) == {"ok": True, "outputs": [4]}
    assert 0 < redis_client.ttl(a) <= REPLY_TTL_S


def run(coro):
    return asyncio.run(coro)


def test_many_waiting_requests_each_get_their_own_answers_through_one_connection(redis_url, redis_client):
    key = f"inference:inbox:test-many-{time.time_ns()}"

    async def main():
        client = aredis.from_url(redis_url, decode_responses=True, max_connections=3)
        inbox = Inbox(key)
        ids = [f"req-{i}" for i in range(200)]
        queues = {i: inbox.expect(i, client) for i in ids}
        # Sliced requests: the odd ones come in two parts, answered in separate batches, last part first.
        timing = {"queue_wait_ms": 1.0, "batch_size": 1}
        first = {
            i: {"ok": True, "outputs": [i], "reply_to": key, "part": [0, 1, 2], "timing": timing} for i in ids[1::2]
        }
        second = {
            i: {"ok": True, "outputs": [f"{i}+"], "reply_to": key, "part": [1, 2, 2], "timing": timing}
            for i in ids[1::2]
        }
        whole = {i: {"ok": True, "outputs": [i], "reply_to": key} for i in ids[::2]}
        waiting = [
            gather_reply(lambda t, q=queues[i]: inbox.next_reply(q, t), 2 if n % 2 else 1, time.time() + 10)
            for n, i in enumerate(ids)
        ]
        tasks = [asyncio.ensure_future(w) for w in waiting]
        await asyncio.sleep(0)
        await asyncio.to_thread(push, redis_client, second)
        await asyncio.to_thread(push, redis_client, {**whole, **first})
        answers = await asyncio.gather(*tasks)
        await client.aclose()
        return ids, answers

    ids, answers = run(main())
    for n, (i, answer) in enumerate(zip(ids, answers, strict=True)):
        assert answer["ok"], answer
        assert answer["outputs"] == ([i, f"{i}+"] if n % 2 else [i])


def test_an_answer_nobody_waits_for_is_dropped_and_the_next_caller_gets_only_its_own(redis_url, redis_client):
    key = f"inference:inbox:test-drop-{time.time_ns()}"

    async def main():
        client = aredis.from_url(redis_url, decode_responses=True)
        inbox = Inbox(key)
        gone = inbox.expect("gone", client)
        assert await inbox.next_reply(gone, 0.05) is None  # its deadline passed
        inbox.forget("gone")
        mine = inbox.expect("mine", client)
        await asyncio.to_thread(
            push,
            redis_client,
            {
                "gone": {"ok": True, "outputs": ["late"], "reply_to": key},
                "mine": {"ok": True, "outputs": ["x"], "reply_to": key},
            },
        )
        got = await inbox.next_reply(mine, 5)
        extra = await inbox.next_reply(mine, 0.2)
        await client.aclose()
        return got, extra

    got, extra = run(main())
    assert got == {"ok": True, "outputs": ["x"]} and extra is None
    assert redis_client.llen(key) == 0


def test_garbage_in_the_inbox_is_logged_and_a_garbled_answer_is_an_error_not_a_crash(redis_url, redis_client, caplog):
    key = f"inference:inbox:test-garbage-{time.time_ns()}"

    async def main():
        client = aredis.from_url(redis_url, decode_responses=True)
        inbox = Inbox(key)
        mine = inbox.expect("mine", client)
        await client.rpush(key, "no-id-at-all", "someone-else {}", "mine [1, 2]")
        await asyncio.to_thread(push, redis_client, {"mine": {"ok": True, "outputs": [1], "reply_to": key}})
        garbled = await inbox.next_reply(mine, 5)
        got = await inbox.next_reply(mine, 5)
        await client.aclose()
        return garbled, got

    garbled, got = run(main())
    assert garbled == {"ok": False, "error": "the worker's answer could not be read", "code": "worker_failed"}
    assert got == {"ok": True, "outputs": [1]}
    assert caplog.text.count("dropped an answer without a request id") == 1


def test_the_listener_comes_back_after_its_connection_is_killed(redis_url, redis_client):
    """Redis drops the listener's connection (a restart, a failover): the next requests still get answers."""
    key = f"inference:inbox:test-kill-{time.time_ns()}"
    name = f"inbox-test-{time.time_ns()}"

    def kill_listener() -> int:
        ids = [c["id"] for c in redis_client.client_list() if c.get("name") == name]
        for client_id in ids:
            redis_client.client_kill_filter(_id=client_id)
        return len(ids)

    async def main():
        client = aredis.from_url(redis_url, decode_responses=True, client_name=name)
        inbox = Inbox(key)
        before = inbox.expect("before", client)
        await asyncio.to_thread(push, redis_client, {"before": {"ok": True, "outputs": [1], "reply_to": key}})
        assert await inbox.next_reply(before, 5) == {"ok": True, "outputs": [1]}
        assert await asyncio.to_thread(kill_listener) >= 1
        after = inbox.expect("after", client)
        await asyncio.to_thread(push, redis_client, {"after": {"ok": True, "outputs": [2], "reply_to": key}})
        got = await inbox.next_reply(after, 10)
        await client.aclose()
        return got

    assert run(main()) == {"ok": True, "outputs": [2]}
