"""Admission against a real Redis: priced in tokens, fair between clients, the backlog bound, the deadline
check, requests too large for any deadline, the dispatcher heartbeat, and Retry-After."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import pytest
import redis.asyncio as aredis

from inference.core.keys import DISPATCHERS_KEY, WORKERS_KEY, backlog_key, backlog_keys, backlog_tokens_key, rate_key
from inference.core.registry import ModelSpec
from inference.core.workers import drain_rate_per_s
from inference.web.admission import Admission, retry_after_s


def test_retry_after_follows_the_drain_rate():
    assert retry_after_s("backlog_full", backlog=10, limit=10, rate_per_s=None, remaining_s=1) == 1
    assert retry_after_s("backlog_full", backlog=60, limit=10, rate_per_s=10, remaining_s=1) == 6
    assert retry_after_s("deadline", backlog=50, limit=100, rate_per_s=10, remaining_s=2) == 3


def test_drain_rate_is_per_busy_child_second_times_children():
    buckets = [{"done": "50", "busy_s": "0.5"}, {"done": "50", "busy_s": "0.5"}, {}]
    assert drain_rate_per_s(buckets, children=2) == pytest.approx(200.0)
    assert drain_rate_per_s([{}], children=2) is None
    assert drain_rate_per_s(buckets, children=0) is None
    heavy = [{"done": "2", "tokens": "8000", "busy_s": "4.0"}]  # two heavy requests: 2,000 tokens per busy s
    assert drain_rate_per_s(heavy, children=1) == pytest.approx(0.5)  # in requests it collapses...
    assert drain_rate_per_s(heavy, children=1, unit="tokens") == pytest.approx(2000.0)  # ...in tokens it does not


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def model_name():
    return f"unit-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_url(redis_url):
    """Database 15 of the test Redis: fake worker entries here never reach the live stack (database 0)."""
    return redis_url.rsplit("/", 1)[0] + "/15"


async def _admission(
    redis_url: str, model: str, *, children: int, done: int, busy_s: float, dispatcher_age_s: float = 0.0, **kw
):
    """Fake serving children (and their dispatcher) and a drain rate of `done` tokens per `busy_s`."""
    client = aredis.Redis.from_url(redis_url, decode_responses=True)
    now = time.time()
    dispatcher = f"unit-dispatcher:{model}"
    await client.hset(DISPATCHERS_KEY, dispatcher, json.dumps({"queue": "online", "ts": now - dispatcher_age_s}))
    for child in range(children):
        entry = {"queue": "online", "models": [model], "ts": now, "dispatcher": dispatcher}
        await client.hset(WORKERS_KEY, f"unit:{model}:{child}", json.dumps(entry))
    if done:
        await client.hset(rate_key(model, int(now)), mapping={"done": done, "tokens": done, "busy_s": busy_s})
    return client, Admission(client, heartbeat_s=2.0, rate_window_s=10, cache_s=0, dispatcher_heartbeat_s=1.0, **kw)


def test_backlog_is_bounded_and_refusal_says_so(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(redis_url, model_name, children=1, done=0, busy_s=0)
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=3)
        deadline = time.time() + 30
        admitted = [await admission.admit(spec, f"r{i}", deadline, client=f"c{i}") for i in range(3)]
        refused = await admission.admit(spec, "r3", deadline, client="c3")
        await admission.release(model_name, "r0")
        after_release = await admission.admit(spec, "r4", deadline, client="c4")
        count = await client.zcard(backlog_key(model_name))
        await client.aclose()
        return admitted, refused, after_release, count

    admitted, refused, after_release, count = run(scenario())
    assert all(d.admitted for d in admitted)
    assert not refused.admitted and refused.reason == "backlog_full" and refused.status == 503
    assert refused.retry_after_s >= 1
    assert "limit is 3" in refused.message(model_name)
    assert after_release.admitted and count == 3


def test_the_backlog_is_bounded_in_tokens_too(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(
            redis_url, model_name, children=1, done=0, busy_s=0, max_backlog_tokens=1000
        )
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=100)
        deadline = time.time() + 30
        first = await admission.admit(spec, "a", deadline, cost=900, client="c1")
        second = await admission.admit(spec, "b", deadline, cost=200, client="c2")
        small = await admission.admit(spec, "c", deadline, cost=50, client="c2")
        await client.aclose()
        return first, second, small

    first, second, small = run(scenario())
    assert first.admitted
    assert not second.admitted and second.reason == "backlog_full" and second.limit == 1000
    assert small.admitted, "what still fits is admitted"


def test_expired_entries_do_not_hold_the_backlog_nor_their_tokens(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(
            redis_url, model_name, children=1, done=0, busy_s=0, max_backlog_tokens=100
        )
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=1)
        await admission.admit(spec, "gone", time.time() + 0.05, cost=100)  # its caller died; no release
        await asyncio.sleep(0.1)
        decision = await admission.admit(spec, "next", time.time() + 5, cost=100)
        await admission.release(model_name, "next")
        leftover = await client.hgetall(backlog_tokens_key(model_name))
        await client.aclose()
        return decision, leftover

    decision, leftover = run(scenario())
    assert decision.admitted
    assert leftover in ({}, {"all": "0"}), f"tokens leaked: {leftover}"


def test_deadline_that_cannot_be_met_is_refused_with_retry_after(redis_url, model_name):
    async def scenario():
        # 10 tokens per busy second on one child: 10/s.
        client, admission = await _admission(redis_url, model_name, children=1, done=10, busy_s=1.0)
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=100)
        for i in range(20):
            await admission.admit(spec, f"ahead{i}", time.time() + 60, client=f"c{i}")
        short = await admission.admit(spec, "short", time.time() + 0.5, client="me")  # 21 tokens at 10/s = 2.1 s
        long = await admission.admit(spec, "long", time.time() + 5, client="me")
        await client.aclose()
        return short, long

    short, long = run(scenario())
    assert not short.admitted and short.reason == "deadline" and short.status == 503
    assert short.predicted_wait_s == pytest.approx(2.1)
    assert short.retry_after_s == 2
    assert "2100 ms wait" in short.message("m")
    assert long.admitted


def test_a_light_client_is_admitted_beside_a_heavy_clients_backlog(redis_url, model_name):
    """Fair queuing: before a light request is done, the heavy client is served about as much as the
    light one, not its whole backlog; so the estimate, and the answer, differ by client."""

    async def scenario():
        client, admission = await _admission(redis_url, model_name, children=1, done=1000, busy_s=1.0)  # 1,000/s
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=100)
        for i in range(6):  # 1,200 tokens of the heavy client: 1.2 s of work
            await admission.admit(spec, f"heavy{i}", time.time() + 60, cost=200, client="heavy")
        heavy = await admission.admit(spec, "heavy-more", time.time() + 1.0, cost=200, client="heavy")
        light = await admission.admit(spec, "light", time.time() + 1.0, cost=20, client="light")
        await client.aclose()
        return heavy, light

    heavy, light = run(scenario())
    assert light.admitted and light.tokens_ahead == 40, "20 of its own plus at most 20 of the heavy client's"
    assert not heavy.admitted


def test_one_clients_excess_is_refused_with_429_while_others_are_admitted(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(
            redis_url, model_name, children=1, done=1000, busy_s=1.0, client_share=0.5, default_deadline_s=2.0
        )  # 1,000 tokens/s and a 2 s default deadline: one client may hold 1,000 tokens
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=100)
        deadline = time.time() + 10.0  # patient requests: the deadline rule would let them queue 10 s of work
        heavy = [await admission.admit(spec, f"h{i}", deadline, cost=300, client="heavy") for i in range(5)]
        other = await admission.admit(spec, "o", deadline, cost=300, client="other")
        await client.aclose()
        return heavy, other

    heavy, other = run(scenario())
    assert [d.admitted for d in heavy] == [True, True, True, False, False]
    refused = heavy[3]
    assert refused.status == 429 and refused.reason == "client_backlog_full"
    assert refused.retry_after_s >= 1
    message = refused.message("m")
    assert "900 tokens of requests waiting" in message and "this request costs 300" in message
    assert 900 < int(re.search(r"at most (\d+) tokens", message)[1]) <= 1000
    assert other.admitted


def test_a_request_that_cannot_fit_its_deadline_on_an_empty_queue_is_too_large(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(redis_url, model_name, children=2, done=1000, busy_s=1.0)  # 2,000/s
        spec = ModelSpec(name=model_name, task="embedding", path="x")
        huge = await admission.admit(spec, "huge", time.time() + 1.0, cost=5000)
        patient = await admission.admit(spec, "patient", time.time() + 5.0, cost=5000)
        await client.aclose()
        return huge, patient

    huge, patient = run(scenario())
    assert not huge.admitted and huge.status == 413 and huge.reason == "request_too_large"
    assert 1000 <= huge.limit <= 2000  # what fits in 1 s at 2,000 tokens/s, with a margin
    message = huge.message("m")
    assert "costs 5000 tokens" in message and "X-Deadline-Ms" in message and "/api/v1/jobs" in message
    assert patient.admitted, "the same request with a longer deadline fits"


def test_no_live_worker_is_refused(redis_url, model_name):
    async def scenario():
        client = aredis.Redis.from_url(redis_url, decode_responses=True)
        admission = Admission(client, heartbeat_s=2.0, rate_window_s=10, cache_s=0)
        decision = await admission.admit(ModelSpec(name=model_name, task="embedding", path="x"), "r", time.time() + 5)
        await client.aclose()
        return decision

    decision = run(scenario())
    assert not decision.admitted and decision.reason == "no_worker"


def test_children_whose_dispatcher_stopped_beating_do_not_count(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(redis_url, model_name, children=2, done=0, busy_s=0, dispatcher_age_s=10)
        decision = await admission.admit(ModelSpec(name=model_name, task="embedding", path="x"), "r", time.time() + 5)
        await client.aclose()
        return decision

    decision = run(scenario())
    assert not decision.admitted and decision.reason == "no_worker"


def test_headroom_keeps_part_of_the_deadline_for_the_request_itself(redis_url, model_name):
    async def scenario(headroom: float):
        client, _ = await _admission(redis_url, model_name, children=1, done=10, busy_s=1.0)
        admission = Admission(
            client, heartbeat_s=2.0, rate_window_s=10, cache_s=0, headroom=headroom, dispatcher_heartbeat_s=1.0
        )
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=100)
        await client.delete(*backlog_keys(model_name))
        for i in range(5):  # 5 ahead plus itself at 10/s: a 0.6 s wait
            await admission.admit(spec, f"ahead{i}", time.time() + 60, client=f"c{i}")
        decision = await admission.admit(spec, "me", time.time() + 0.8, client="me")
        await client.aclose()
        return decision

    assert run(scenario(1.0)).admitted
    refused = run(scenario(0.5))
    assert not refused.admitted and refused.reason == "deadline"


def test_a_refusal_is_held_briefly_for_the_same_caller_when_it_would_refuse_it_too(redis_url, model_name):
    async def scenario():
        client, _ = await _admission(redis_url, model_name, children=1, done=10, busy_s=1.0)  # 10/s
        admission = Admission(
            client, heartbeat_s=2.0, rate_window_s=10, cache_s=0, refusal_hold_s=0.3, dispatcher_heartbeat_s=1.0
        )
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=100)
        for i in range(10):  # 10 ahead plus itself at 10/s: a 1.1 s wait
            await admission.admit(spec, f"ahead{i}", time.time() + 60, client=f"c{i}")
        assert admission.held_refusal(model_name, "Token k", deadline_ms=500) is None  # nothing refused yet
        refused = await admission.admit(spec, "hurry", time.time() + 0.5, client="me", client_key="Token k")
        held = {ms: admission.held_refusal(model_name, "Token k", deadline_ms=ms) for ms in (200, 500, 5000)}
        someone_else = admission.held_refusal(model_name, "Token other", deadline_ms=200)
        await asyncio.sleep(0.35)
        after_hold = admission.held_refusal(model_name, "Token k", deadline_ms=200)
        await client.aclose()
        return refused, held, someone_else, after_hold

    refused, held, someone_else, after_hold = run(scenario())
    assert not refused.admitted and refused.reason == "deadline"
    assert held[200] is refused and held[500] is refused, "no more patient than the refused request: refused"
    assert held[5000] is None, "a 5 s deadline fits a 1 s queue: it must go to the full check"
    assert someone_else is None, "another client's wait is estimated on its own"
    assert after_hold is None, "the hold expires"


def test_after_an_idle_window_the_last_measured_rate_is_used(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(redis_url, model_name, children=2, done=10, busy_s=1.0)
        measured = await admission.capacity(model_name)
        now = int(time.time())
        await client.delete(*(rate_key(model_name, now - s) for s in range(3)))  # the window empties: idle
        after_idle = await admission.capacity(model_name)
        await client.aclose()
        return measured, after_idle

    measured, after_idle = run(scenario())
    assert measured == (2, pytest.approx(20.0))
    assert after_idle == (2, pytest.approx(20.0)), "a quiet spell must not turn the drain rate into 'unknown'"


def test_one_client_filling_the_request_limit_is_refused_alone(redis_url, model_name):
    """A client that sends many tiny requests meets its own request cap (429) before the model's
    global one, and its refusals are not held against other callers."""

    async def scenario():
        client, admission = await _admission(
            redis_url, model_name, children=1, done=0, busy_s=0, client_share=0.5, refusal_hold_s=5.0
        )
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=10)
        deadline = time.time() + 30
        flood = [await admission.admit(spec, f"t{i}", deadline, client="tiny", client_key="Token t") for i in range(7)]
        held_for_other = admission.held_refusal(model_name, "Token o", 2000)
        other = await admission.admit(spec, "o", deadline, client="other", client_key="Token o")
        await client.aclose()
        return flood, held_for_other, other

    flood, held_for_other, other = run(scenario())
    assert [d.admitted for d in flood] == [True] * 5 + [False] * 2
    assert flood[5].reason == "client_backlog_full" and "(5 requests)" in flood[5].message("m")
    assert held_for_other is None and other.admitted


def test_a_request_whose_deadline_has_passed_is_a_deadline_refusal_not_too_large(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(redis_url, model_name, children=1, done=1000, busy_s=1.0)
        decision = await admission.admit(ModelSpec(name=model_name, task="embedding", path="x"), "r", time.time() - 1)
        await client.aclose()
        return decision

    decision = run(scenario())
    assert not decision.admitted and decision.reason == "deadline" and decision.status == 503


def test_a_call_run_twice_admits_and_queues_once(redis_url, model_name):
    """redis-py resends a command (or a whole pipeline of admissions) when a connection error takes its
    reply: the second run must neither count the request's tokens again nor queue its message twice,
    or the totals keep its cost for ever (its release subtracts it once) and the worker runs it twice."""

    async def scenario():
        client, admission = await _admission(redis_url, model_name, children=1, done=0, busy_s=0)
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=10)
        queue = f"online.{model_name}"
        deadline = time.time() + 30
        for _ in range(2):  # the same call twice, as a resend makes it
            decision = await admission.admit(spec, "r1", deadline, cost=40, client="c1", message=b"m", queue=queue)
        totals = await client.hgetall(backlog_tokens_key(model_name))
        queued = await client.llen(queue)
        await admission.release(model_name, "r1")
        after = await client.hgetall(backlog_tokens_key(model_name))
        await client.delete(queue)
        await client.aclose()
        return decision, totals, queued, after

    decision, totals, queued, after = run(scenario())
    assert decision.admitted
    assert totals["all"] == "40" and totals["c:c1"] == "40" and totals["n:c1"] == "1"
    assert queued == 1
    assert after.get("all") == "0" and "c:c1" not in after and "n:c1" not in after
