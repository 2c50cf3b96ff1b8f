"""Admission against a real Redis: the backlog bound, the deadline check, and Retry-After."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
import redis.asyncio as aredis

from inference.admission import Admission, backlog_key, retry_after_s
from inference.registry import ModelSpec
from inference.workers import WORKERS_KEY, drain_rate_per_s, rate_key


def test_retry_after_follows_the_drain_rate():
    assert retry_after_s("backlog_full", backlog=10, limit=10, rate_per_s=None, remaining_s=1) == 1
    assert retry_after_s("backlog_full", backlog=60, limit=10, rate_per_s=10, remaining_s=1) == 6
    assert retry_after_s("deadline", backlog=50, limit=100, rate_per_s=10, remaining_s=2) == 3


def test_drain_rate_is_per_busy_child_second_times_children():
    buckets = [{"done": "50", "busy_s": "0.5"}, {"done": "50", "busy_s": "0.5"}, {}]
    assert drain_rate_per_s(buckets, children=2) == pytest.approx(200.0)
    assert drain_rate_per_s([{}], children=2) is None
    assert drain_rate_per_s(buckets, children=0) is None


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def model_name():
    return f"unit-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_url(redis_url):
    """Database 15 of the test Redis: fake worker entries here never reach the live stack (database 0)."""
    return redis_url.rsplit("/", 1)[0] + "/15"


async def _admission(redis_url: str, model: str, *, children: int, done: int, busy_s: float):
    client = aredis.Redis.from_url(redis_url, decode_responses=True)
    now = time.time()
    await client.hset(WORKERS_KEY, f"unit:{model}", json.dumps({"queue": "online", "models": [model], "ts": now}))
    for child in range(children - 1):
        await client.hset(
            WORKERS_KEY, f"unit:{model}:{child}", json.dumps({"queue": "online", "models": [model], "ts": now})
        )
    if done:
        await client.hset(rate_key(model, int(now)), mapping={"done": done, "busy_s": busy_s})
    return client, Admission(client, heartbeat_s=2.0, rate_window_s=10, cache_s=0)


def test_backlog_is_bounded_and_refusal_says_so(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(redis_url, model_name, children=1, done=0, busy_s=0)
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=3)
        deadline = time.time() + 30
        admitted = [await admission.admit(spec, f"r{i}", deadline) for i in range(3)]
        refused = await admission.admit(spec, "r3", deadline)
        await admission.release(model_name, "r0")
        after_release = await admission.admit(spec, "r4", deadline)
        count = await client.zcard(backlog_key(model_name))
        await client.aclose()
        return admitted, refused, after_release, count

    admitted, refused, after_release, count = run(scenario())
    assert all(d.admitted for d in admitted)
    assert not refused.admitted and refused.reason == "backlog_full"
    assert refused.retry_after_s >= 1
    assert "limit is 3" in refused.message(model_name)
    assert after_release.admitted and count == 3


def test_expired_entries_do_not_hold_the_backlog(redis_url, model_name):
    async def scenario():
        client, admission = await _admission(redis_url, model_name, children=1, done=0, busy_s=0)
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=1)
        await admission.admit(spec, "gone", time.time() + 0.05)  # its caller died; no release
        await asyncio.sleep(0.1)
        decision = await admission.admit(spec, "next", time.time() + 5)
        await client.aclose()
        return decision

    assert run(scenario()).admitted


def test_deadline_that_cannot_be_met_is_refused_with_retry_after(redis_url, model_name):
    async def scenario():
        # 10 requests per busy second on one child: 10/s.
        client, admission = await _admission(redis_url, model_name, children=1, done=10, busy_s=1.0)
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=100)
        for i in range(20):
            await admission.admit(spec, f"ahead{i}", time.time() + 60)
        short = await admission.admit(spec, "short", time.time() + 0.5)  # 20 ahead at 10/s = 2 s
        long = await admission.admit(spec, "long", time.time() + 5)
        await client.aclose()
        return short, long

    short, long = run(scenario())
    assert not short.admitted and short.reason == "deadline"
    assert short.predicted_wait_s == pytest.approx(2.0)
    assert short.retry_after_s == 2
    assert "2000 ms wait" in short.message("m")
    assert long.admitted


def test_no_live_worker_is_refused(redis_url, model_name):
    async def scenario():
        client = aredis.Redis.from_url(redis_url, decode_responses=True)
        admission = Admission(client, heartbeat_s=2.0, rate_window_s=10, cache_s=0)
        decision = await admission.admit(ModelSpec(name=model_name, task="embedding", path="x"), "r", time.time() + 5)
        await client.aclose()
        return decision

    decision = run(scenario())
    assert not decision.admitted and decision.reason == "no_worker"


def test_headroom_keeps_part_of_the_deadline_for_the_request_itself(redis_url, model_name):
    async def scenario(headroom: float):
        client, _ = await _admission(redis_url, model_name, children=1, done=10, busy_s=1.0)
        admission = Admission(client, heartbeat_s=2.0, rate_window_s=10, cache_s=0, headroom=headroom)
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=100)
        await client.delete(backlog_key(model_name))
        for i in range(5):  # 5 ahead at 10/s: a 0.5 s wait
            await admission.admit(spec, f"ahead{i}", time.time() + 60)
        decision = await admission.admit(spec, "me", time.time() + 0.8)
        await client.aclose()
        return decision

    assert run(scenario(1.0)).admitted
    refused = run(scenario(0.5))
    assert not refused.admitted and refused.reason == "deadline"


def test_a_refusal_is_held_briefly_for_requests_it_would_refuse_too(redis_url, model_name):
    async def scenario():
        client, _ = await _admission(redis_url, model_name, children=1, done=10, busy_s=1.0)  # 10/s
        admission = Admission(client, heartbeat_s=2.0, rate_window_s=10, cache_s=0, refusal_hold_s=0.3)
        spec = ModelSpec(name=model_name, task="embedding", path="x", max_backlog=100)
        for i in range(10):  # 10 ahead at 10/s: a 1 s wait
            await admission.admit(spec, f"ahead{i}", time.time() + 60)
        assert admission.held_refusal(model_name, deadline_ms=500) is None  # nothing refused yet
        refused = await admission.admit(spec, "hurry", time.time() + 0.5)
        held = {ms: admission.held_refusal(model_name, deadline_ms=ms) for ms in (200, 500, 5000)}
        await asyncio.sleep(0.35)
        after_hold = admission.held_refusal(model_name, deadline_ms=200)
        await client.aclose()
        return refused, held, after_hold

    refused, held, after_hold = run(scenario())
    assert not refused.admitted and refused.reason == "deadline"
    assert held[200] is refused and held[500] is refused, "no more patient than the refused request: refused"
    assert held[5000] is None, "a 5 s deadline fits a 1 s queue: it must go to the full check"
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
