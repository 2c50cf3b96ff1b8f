"""The online pool grows and shrinks on predicted wait (inference/dispatch/autoscale.py), not on reserved tasks."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import redis
from kombu.asynchronous.timer import Timer

from inference.core.keys import WORKERS_KEY, backlog_tokens_key, last_rate_key
from inference.core.workers import alive_workers
from inference.dispatch.autoscale import (
    Policy,
    PredictedWaitAutoscaler,
    is_low,
    read_gauges,
    ready_children,
    target_procs,
)
from observability.keys import GAUGES_KEY
from tests.conftest import _start, _stop, wait_until

POLICY = Policy(grow_wait_s=0.5, shrink_wait_s=0.2, keepalive_s=30.0)


def target(**kw) -> int:
    figures = {"wait_s": 0.0, "queued": 0, "procs": 1, "min_procs": 1, "max_procs": 2, "starting": 0, "low_for_s": 0.0}
    return target_procs(**{**figures, **kw}, policy=POLICY)


# The decision, alone ----------------------------------------------------------------------------


def test_grows_by_one_child_when_the_predicted_wait_passes_its_share_of_the_deadline():
    assert target(wait_s=0.6) == 2
    assert target(wait_s=0.5) == 1  # at the threshold, not past it
    assert target(wait_s=3600.0, procs=2, max_procs=4) == 3  # one step at a time


def test_never_grows_past_max_nor_shrinks_below_min():
    assert target(wait_s=9.0, procs=2, max_procs=2) == 2
    assert target(wait_s=0.0, procs=1, low_for_s=999) == 1
    assert target(procs=0) == 1  # under min (a child died): back to min
    assert target(procs=3, max_procs=2) == 2


def test_before_any_rate_is_measured_it_grows_when_more_requests_are_admitted_than_children():
    assert target(wait_s=None, queued=2, procs=1) == 2
    assert target(wait_s=None, queued=1, procs=1) == 1
    assert not is_low(None, 1, 2, POLICY)
    assert is_low(None, 0, 2, POLICY)


def test_holds_while_a_new_child_is_still_loading_its_models():
    """The gauge does not count a child until it beats: growing again meanwhile would add children
    for load that the loading one is about to take."""
    assert target(wait_s=5.0, procs=2, max_procs=4, starting=1) == 2
    assert target(wait_s=0.0, procs=2, starting=1, low_for_s=999) == 2


def test_shrinks_by_one_only_after_the_wait_stayed_low_for_keepalive_seconds():
    assert target(wait_s=0.01, procs=2, low_for_s=29.9) == 2
    assert target(wait_s=0.01, procs=2, low_for_s=30.0) == 1
    assert target(wait_s=0.01, procs=4, max_procs=4, low_for_s=30.0) == 3


def test_low_means_the_wait_would_still_be_short_with_one_child_fewer():
    # 0.15 s over 2 children is 0.30 s over one: above the 0.2 s shrink mark, so not low (no flapping
    # between "grow at 0.5 s" and a shrink that would bring the wait straight back).
    assert not is_low(0.15, 0, 2, POLICY)
    assert is_low(0.09, 0, 2, POLICY)
    assert is_low(0.12, 0, 3, POLICY)  # 0.18 s over 2


# What the sampler wrote -------------------------------------------------------------------------


def test_read_gauges_sums_the_waits_of_the_queues_a_worker_consumes():
    raw = {
        "sampled_at": "100.5",
        "gauge|online.a|predicted_wait_s": "0.4",
        "gauge|online.a|waiting": "3",
        "gauge|online.a|in_flight": "2",
        "gauge|online.b|predicted_wait_s": "0.3",
        "gauge|online.b|waiting": "1",
        "gauge|online.c|predicted_wait_s": "50",  # another worker's queue
    }
    gauges = read_gauges(raw, ["online.a", "online.b"])
    assert gauges.wait_s == pytest.approx(0.7)
    assert (gauges.queued, gauges.sampled_at) == (6, 100.5)
    assert read_gauges({}, ["online.a"]) is None  # the sampler has not run yet


def test_a_queue_with_work_and_no_measured_rate_makes_the_wait_unknown():
    raw = {"sampled_at": "1", "gauge|online.a|predicted_wait_s": "0.1", "gauge|online.b|waiting": "4"}
    assert read_gauges(raw, ["online.a", "online.b"]).wait_s is None
    assert read_gauges({"sampled_at": "1"}, ["online.b"]).wait_s == 0.0  # no rate, but no work either


def test_ready_children_are_this_pools_children_that_beat_after_loading():
    now = time.time()

    def beat(pid: int, dispatcher: str, ts: float) -> str:
        return json.dumps({"pid": pid, "dispatcher": dispatcher, "ts": ts, "queue": "online", "models": ["identity"]})

    raw = {
        "h:11": beat(11, "h:1", now),
        "h:12": beat(12, "h:1", now - 60),  # stale: gone
        "h:13": beat(13, "h:2", now),  # another worker's child
        "h:14": beat(14, "h:1", now),  # a child shrunk away whose entry is still fresh
    }
    assert ready_children(raw, {11, 12, 15}, "h:1", heartbeat_s=2.0) == 1


# The autoscaler on a real Redis, with a stand-in pool -------------------------------------------


class FakePool:
    """A pool whose children are pids; `grow` forks nothing, the test beats for the new child."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = list(pids)
        self.next_pid = 1000

    @property
    def num_processes(self) -> int:
        return len(self.pids)

    @property
    def info(self) -> dict:
        return {"processes": list(self.pids)}

    def grow(self, n: int) -> None:
        for _ in range(n):
            self.next_pid += 1
            self.pids.append(self.next_pid)

    def shrink(self, n: int) -> None:
        del self.pids[-n:]

    def maintain_pool(self) -> None:
        pass


@pytest.fixture
def own_redis(redis_url) -> redis.Redis:
    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/9", decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()


def scaler_on(client: redis.Redis, pool: FakePool, keepalive_s: float = 0.0, hub=None) -> PredictedWaitAutoscaler:
    queues = SimpleNamespace(consume_from={"online.identity": None})
    worker = SimpleNamespace(app=SimpleNamespace(amqp=SimpleNamespace(queues=queues)), hub=hub)
    scaler = PredictedWaitAutoscaler(pool, 3, 1, worker=worker)
    scaler.client = client
    scaler.policy = Policy(grow_wait_s=0.5, shrink_wait_s=0.2, keepalive_s=keepalive_s)
    return scaler


def beat_children(client: redis.Redis, pool: FakePool) -> None:
    me = f"{socket.gethostname()}:{os.getpid()}"  # the test process plays the worker's main process
    for pid in pool.pids:
        entry = {"pid": pid, "dispatcher": me, "ts": time.time(), "queue": "online", "models": ["identity"]}
        client.hset(WORKERS_KEY, f"h:{pid}", json.dumps(entry))


def sample(client: redis.Redis, wait_s: float, *, at: float | None = None) -> None:
    fields = {"gauge|online.identity|predicted_wait_s": wait_s, "gauge|online.identity|waiting": 0}
    client.hset(GAUGES_KEY, mapping={**fields, "sampled_at": time.time() if at is None else at})


def test_the_autoscaler_grows_on_the_gauge_and_waits_for_the_new_child_and_a_fresh_gauge(own_redis):
    pool = FakePool([1])
    scaler = scaler_on(own_redis, pool)
    beat_children(own_redis, pool)
    sample(own_redis, 2.0, at=time.time() + 2)  # sampled after the child was seen ready
    scaler.maybe_scale()
    assert pool.num_processes == 2
    # The new child has not beaten (it is loading its models): the wait is still high, no third child.
    sample(own_redis, 2.0)
    scaler.maybe_scale()
    assert pool.num_processes == 2 and scaler.info()["starting"] == 1
    # It beats: a gauge sampled before then did not count it and still holds the pool; a later one is acted on.
    beat_children(own_redis, pool)
    scaler.maybe_scale()
    assert pool.num_processes == 2
    sample(own_redis, 2.0, at=time.time() + 2)
    scaler.maybe_scale()
    assert pool.num_processes == 3


def test_the_autoscaler_holds_on_stale_gauges_and_shrinks_when_the_wait_is_low(own_redis):
    pool = FakePool([1, 2])
    scaler = scaler_on(own_redis, pool)
    beat_children(own_redis, pool)
    sample(own_redis, 0.0, at=time.time() - 60)  # no sampler for a minute: nothing is known
    scaler.maybe_scale()
    scaler.maybe_scale()
    assert pool.num_processes == 2 and scaler.info()["held"] == "no fresh gauges"
    sample(own_redis, 0.0, at=time.time() + 2)
    scaler.maybe_scale()
    scaler.maybe_scale()
    assert pool.num_processes == 1


def test_an_offline_worker_keeps_celerys_own_rule(own_redis):
    """Celery's rule counts reserved requests: celery-batches reserves none, so the pool stays at min."""
    pool = FakePool([1])
    scaler = scaler_on(own_redis, pool)
    scaler.worker.app.amqp.queues.consume_from = {"offline": None}
    sample(own_redis, 3600.0)
    scaler.maybe_scale()
    assert pool.num_processes == 1


def test_the_tick_survives_a_broker_reconnect_that_clears_the_event_loops_timers(own_redis):
    timer = Timer()
    scaler = scaler_on(own_redis, FakePool([1]), hub=SimpleNamespace(call_repeatedly=timer.call_repeatedly))
    assert len(timer) == 1
    timer.clear()  # what Celery's event loop does on a connection error; it re-arms only its own check
    scaler._ticked_at -= 60  # that check comes a keepalive later and finds the tick silent
    scaler.maybe_scale()
    assert len(timer) == 1
    scaler.maybe_scale()  # the tick is fresh: not armed twice
    assert len(timer) == 1


# A real worker started with --autoscale=2,1 -----------------------------------------------------


def test_a_worker_started_with_autoscale_grows_on_predicted_wait_and_shrinks_after_idle(stack, redis_url, tmp_path):
    """The pool grows to 2 children when the sampler predicts a long wait (a backlog of 60 s of work at
    the measured rate, written where admission keeps it) and shrinks back to 1 once the wait has
    stayed low for the keepalive."""
    own_db = redis_url.rsplit("/", 1)[0] + "/10"  # its own queue and gauges: the stack's worker stays out
    client = redis.Redis.from_url(own_db, decode_responses=True)
    client.flushdb()
    command = [str(Path(sys.executable).parent / "celery"), "-A", "platform_", "worker", "-Q", "online.identity"]
    command += ["--autoscale=2,1", "--without-gossip", "--without-mingle", "-n", f"autoscale-{os.getpid()}@%h"]
    command += ["--loglevel", "INFO"]
    env = {k: v for k, v in stack.env.items() if k not in ("WORKER_QUEUE", "WORKER_MODELS")}
    env |= {"REDIS_URL": own_db, "WORKER_HEARTBEAT_S": "1", "AUTOSCALE_KEEPALIVE_S": "3", "AUTOSCALE_INTERVAL_S": "0.5"}
    log = tmp_path / "worker.log"
    worker = _start(command, env, log)
    main = psutil.Process(worker.pid)
    dispatcher = f"{socket.gethostname()}:{worker.pid}"

    def children_beating() -> int:
        alive = alive_workers(client.hgetall(WORKERS_KEY), 1.0)
        return sum(1 for w in alive if w["dispatcher"] == dispatcher)

    def pool_size() -> int:
        return len(main.children())

    def sampled_at() -> float:
        return float(client.hget(GAUGES_KEY, "sampled_at") or 0)

    def wait_for(predicate, timeout_s: float, what: str) -> None:
        try:
            wait_until(predicate, timeout_s, what)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; worker log:\n{log.read_text()[-3000:]}") from None

    try:
        wait_for(lambda: children_beating() == 1 and sampled_at() > 0, 90, "the worker's first child and gauges")
        # Quiet queue: the sampler writes a zero wait twice more and the pool stays at its minimum.
        quiet_from = time.time()
        wait_for(lambda: sampled_at() > quiet_from + 2, 30, "two more samples")
        assert (pool_size(), children_beating()) == (1, 1), "grew on a quiet queue"

        client.set(last_rate_key("identity"), 1000)  # tokens per busy child-second
        client.hset(backlog_tokens_key("identity"), "all", 60_000)  # 60 s of work for one child
        high_from = time.monotonic()
        wait_for(lambda: children_beating() == 2, 60, "a second child, loaded and beating")
        grew_s = time.monotonic() - high_from
        assert pool_size() == 2
        wait = float(client.hget(GAUGES_KEY, "gauge|online.identity|predicted_wait_s"))
        assert wait > 2.5, "the gauge the autoscaler reads (deadline 10 s, grow at 0.25 of it)"

        client.delete(backlog_tokens_key("identity"))  # the backlog is answered: the wait drops to 0
        idle_from = time.monotonic()
        wait_for(lambda: pool_size() == 1 and children_beating() == 1, 60, "the pool back at 1 child")
        shrank_s = time.monotonic() - idle_from
    finally:
        _stop(worker)
        client.flushdb()
    assert grew_s < 30
    assert shrank_s >= 3, "not before the keepalive"
