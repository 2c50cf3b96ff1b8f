"""The lean online path (issue 10) as a user and an operator see it: the identity probe answers through
the whole real path, an answered request stops counting against admission without the web tier's help,
online messages leave no acknowledgement bookkeeping in Redis, and expired entries leave the backlog with
their tokens."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import requests

from inference.core.backlog import queue_purge
from inference.core.keys import WORKERS_KEY, backlog_cost_key, backlog_key, backlog_keys, backlog_tokens_key, reply_key
from inference.core.registry import ModelSpec
from inference.core.tokens import token_counts
from inference.web.publish import task_message
from platform_.redis import Increments
from tests.conftest import MINILM, _start, _stop, wait_until


def wait_for(condition, timeout_s: float = 10.0):
    """The condition's value once it holds, or its last (false) value after `timeout_s`, for an assert
    that says what was seen."""
    try:
        return wait_until(condition, timeout_s, "a condition", interval_s=0.05)
    except TimeoutError:
        return condition()


def test_identity_answers_each_texts_length_and_the_tokens_admission_priced(stack):
    texts = ["hello world", "Ünïcödé tëxt, with punctuation!", "word " * 400]
    response = stack.predict("identity", texts)
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    spec = ModelSpec(name="identity", task="identity", path=MINILM, max_seq_length=128)
    assert [o["chars"] for o in outputs] == [len(t) for t in texts]
    assert [o["tokens"] for o in outputs] == token_counts(spec, texts)
    assert outputs[2]["tokens"] == 128  # truncated to the model's max_seq_length, as the model would be
    models = requests.get(f"{stack.url}/api/v1/models", headers=stack.headers(), timeout=10).json()["models"]
    assert {"name": "identity", "task": "identity"}.items() <= next(
        m for m in models if m["name"] == "identity"
    ).items()


def _online_unacked(client: redis.Redis) -> list[str]:
    """kombu's unacked entries that hold an online message."""
    found = []
    for raw in client.hvals("unacked"):
        message, _exchange, routing_key = json.loads(raw)
        if routing_key.startswith("online."):
            found.append(message["headers"]["id"])
    return found


def test_answered_requests_stop_counting_and_leave_no_ack_bookkeeping(stack):
    for _ in range(20):
        assert stack.predict("identity", ["a short text", "another one"]).status_code == 200

    def released() -> bool:
        tokens = stack.redis.hgetall(backlog_tokens_key("identity"))
        return not stack.redis.zcard(backlog_key("identity")) and int(tokens.get("all", 0)) == 0

    # Nothing waits for a deadline here: the worker released each request as it wrote the answer.
    assert wait_for(released, timeout_s=2.0), stack.redis.hgetall(backlog_tokens_key("identity"))
    assert not stack.redis.hlen(backlog_cost_key("identity"))
    assert _online_unacked(stack.redis) == []


def test_a_busy_worker_leaves_what_it_cannot_hold_in_the_queue_for_other_workers(stack):
    """Consumed without acks, nothing in kombu bounds what a worker pulls: the dispatcher's gate does
    (its prefetch, 64 in the test stack). The rest stays in Redis, where another worker can take it."""
    children = [child["pid"] for child in stack.online_children()]
    sent, held_at_most = 150, 64
    tokens = [stack.token, stack.other_token, stack.third_token]
    for pid in children:
        os.kill(pid, signal.SIGSTOP)  # busy children: the worker's main process keeps consuming
    try:
        with ThreadPoolExecutor(max_workers=sent) as pool:
            calls = [
                pool.submit(stack.predict, "identity", [f"text {i}"], token=tokens[i % 3], **{"X-Deadline-Ms": "9000"})
                for i in range(sent)
            ]
            # One dispatch (at most a batch of 32) went to a stopped child; the gate holds 64 more.
            left = wait_for(lambda: stack.redis.llen("online.identity") >= sent - held_at_most - 32, timeout_s=5.0)
            queued = stack.redis.llen("online.identity")
            for pid in children:
                os.kill(pid, signal.SIGCONT)
            statuses = [call.result().status_code for call in calls]
    finally:
        for pid in children:
            os.kill(pid, signal.SIGCONT)
    assert left, f"the worker pulled all but {queued} of {sent} messages"
    assert statuses == [200] * sent  # and once the children run again, every request is answered


def test_a_worker_that_shuts_down_hands_back_the_requests_it_held(stack, redis_url, tmp_path):
    """Without acks kombu restores nothing at shutdown: the dispatcher puts back what it never started."""
    own_db = redis_url.rsplit("/", 1)[0] + "/13"  # its own queue: the stack's worker must not take these
    client = redis.Redis.from_url(own_db, decode_responses=True)
    client.flushdb()
    command = [str(Path(sys.executable).parent / "celery"), "-A", "platform_", "worker", "-Q", "online", "-c", "1"]
    command += [
        "--prefetch-multiplier",
        "64",
        "--without-gossip",
        "--without-mingle",
        "-n",
        f"handback-{os.getpid()}@%h",
    ]
    env = {**stack.env, "REDIS_URL": own_db, "WORKER_QUEUE": "online", "WORKER_MODELS": "identity"}
    worker = _start(command, env, tmp_path / "worker.log")
    try:
        assert wait_for(lambda: client.hlen(WORKERS_KEY) == 1, timeout_s=60), (tmp_path / "worker.log").read_text()
        child = json.loads(next(iter(client.hvals(WORKERS_KEY))))["pid"]
        os.kill(child, signal.SIGSTOP)  # busy: the first request goes to it, the rest wait in the dispatcher
        ids = [f"handback-{i}" for i in range(20)]

        def push(task_id: str) -> None:
            kwargs = {"model": "identity", "inputs": ["hi"], "tokens": [3], "client": "c", "deadline": time.time() + 60}
            client.lpush(
                "online.identity", task_message(task_id, "online.identity", {**kwargs, "enqueued_at": time.time()})
            )

        def rpops() -> int:
            return int(client.info("commandstats").get("cmdstat_rpop", {}).get("calls", 0))

        before = rpops()
        push(ids[0])
        # Taken by a BRPOP, then the burst's RPOP found nothing more; the dispatch to the stopped child
        # follows in the same step of the worker's loop, before it reads Redis again.
        assert wait_for(lambda: client.llen("online.identity") == 0 and rpops() > before)
        for task_id in ids[1:]:
            push(task_id)
        assert wait_for(lambda: client.llen("online.identity") == 0)  # all taken (fewer than its prefetch of 64)
        worker.send_signal(signal.SIGTERM)  # warm shutdown
        os.kill(child, signal.SIGCONT)
        worker.wait(timeout=60)
    finally:
        _stop(worker)
    answered = {task_id for task_id in ids if client.exists(reply_key(task_id))}
    queued = {json.loads(raw)["headers"]["id"] for raw in client.lrange("online.identity", 0, -1)}
    assert answered == {ids[0]}  # the one the child had was finished
    assert queued == set(ids[1:])  # the ones the dispatcher held are back in the queue, none lost
    client.flushdb()


def test_a_caller_that_hung_up_stops_counting_once_its_work_is_done_not_at_its_deadline(stack):
    stack.pause_worker()  # the request waits in the queue, as behind a busy worker
    try:
        stack.hang_up("identity", "a caller that gives up", deadline_ms=9000, after_s=0.5)
        assert int(stack.redis.hget(backlog_tokens_key("identity"), "all") or 0) > 0  # still counted
    finally:
        stack.resume_worker()
    hung_up_at = time.monotonic()
    assert wait_for(lambda: int(stack.redis.hget(backlog_tokens_key("identity"), "all") or 0) == 0, timeout_s=8.0)
    assert time.monotonic() - hung_up_at < 5.0  # released by the worker's answer, well before the 9 s deadline


def test_expired_entries_leave_the_backlog_with_their_tokens(redis_client):
    model = f"purge-{time.time_ns()}"
    keys = backlog_keys(model)
    now = time.time()
    # Two admitted requests whose callers vanished (one past its deadline) and one still live.
    redis_client.zadd(keys[0], {"gone": now - 1, "live": now + 60})
    redis_client.hset(keys[1], mapping={"gone": "70:a", "live": "30:b"})
    redis_client.hset(keys[2], mapping={"all": 100, "c:a": 70, "n:a": 1, "c:b": 30, "n:b": 1})
    pipe = redis_client.pipeline(transaction=False)
    queue_purge(pipe, model, now)
    assert pipe.execute() == [1]
    assert redis_client.hgetall(keys[2]) == {"all": "30", "c:b": "30", "n:b": "1"}
    assert redis_client.hgetall(keys[1]) == {"live": "30:b"}
    redis_client.delete(*keys)


@pytest.mark.django_db
def test_the_sampler_purges_through_admission_so_tokens_do_not_leak(redis_client, settings):
    from inference.web.monitoring import queue_depths

    model = "identity"
    keys = backlog_keys(model)
    redis_client.zadd(keys[0], {"sampler-gone": time.time() - 1})
    redis_client.hset(keys[1], "sampler-gone", "55:z")
    redis_client.hincrby(keys[2], "all", 55)
    redis_client.hincrby(keys[2], "c:z", 55)
    redis_client.hincrby(keys[2], "n:z", 1)
    queue_depths(redis_client)
    assert not redis_client.hexists(keys[1], "sampler-gone")
    assert "c:z" not in redis_client.hgetall(keys[2])


def test_increments_leave_redis_as_the_commands_would(redis_client):
    key, other = f"incr-{time.time_ns()}", f"incr2-{time.time_ns()}"
    counters = Increments()
    counters.hincrby(key, "n", 3)
    counters.hincrby(key, "n", -1)
    counters.hincrbyfloat(key, "seconds", 0.25)
    counters.hincrbyfloat(other, "tiny", 1e-05)
    counters.expire(key, 60)
    pipe = redis_client.pipeline(transaction=False)
    counters.queue_on(pipe)
    pipe.execute()
    assert redis_client.hgetall(key) == {"n": "2", "seconds": "0.25"}
    assert float(redis_client.hget(other, "tiny")) == pytest.approx(1e-05)
    assert 0 < redis_client.ttl(key) <= 60 and redis_client.ttl(other) == -1
    redis_client.delete(key, other)
