"""A worker that loses its broker connection while a dispatch waits for a child serves again afterwards.

CI caught it in the Sentinel failover test: when the connection drops, Celery's consumer flushes the
pool, which drops every job no child has accepted yet without running a callback. The dispatcher counted
such a dispatch as running forever, so a worker with one child never dispatched again and every call
ran out its deadline (inference/dispatch/batching.py, `_reclaim_discarded`).

Here the case is made on purpose, on a stack of its own (its own Redis, so no other test sees the cut):
the online child is frozen (SIGSTOP) so the dispatch it is sent cannot be accepted, the worker's own
connections to Redis are closed by the server (CLIENT KILL), and the child is thawed.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import psutil
import pytest
import redis
import requests

from inference.core.keys import backlog_key
from tests.conftest import private_stack, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_stack(django_db_setup, django_db_blocker, models_file, tmp_path_factory):
    with private_stack("reconnect", django_db_blocker, models_file, tmp_path_factory) as stack:
        yield stack


def _cut_redis_connections_of(pid: int, client: redis.Redis) -> int:
    """Have the Redis server close every connection the process `pid` holds to it; how many it closed."""
    ports = {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.raddr}
    closed = 0
    for entry in client.client_list():
        host, _, port = entry["addr"].rpartition(":")
        if host == "127.0.0.1" and int(port) in ports:
            closed += client.client_kill_filter(_id=entry["id"])
    return closed


def test_a_dispatch_dropped_by_a_broker_reconnect_does_not_stop_the_worker(own_stack):
    stack = own_stack
    assert stack.predict("router", ["warm up the child"]).status_code == 200
    (child,) = stack.online_children()
    frozen = psutil.Process(child["pid"])
    log = stack.log_dir / "online.log"
    answer: dict = {}

    def call() -> None:
        answer["response"] = stack.predict("router", ["where is my parcel"], **{"X-Deadline-Ms": "20000"})

    frozen.suspend()
    try:
        caller = threading.Thread(target=call)
        caller.start()
        # The worker took the request (no-ack queue: gone from Redis) and, its one child looking free,
        # sent it to the frozen child at once (ONLINE_BATCH_WAIT_MS is 0).
        # Admitted (in the backlog ledger) and gone from the queue: taken. (The queue alone is empty before the
        # request is even sent.) Usually the worker sent it on to the frozen child's pipe at once; when the
        # child froze before the warm-up batch's result reached the worker, the worker holds it back instead.
        wait_until(
            lambda: (
                stack.redis.zcard(backlog_key("router")) == 1
                and stack.redis.llen("online.router") == 0
                and caller.is_alive()
            ),
            20,
            "the request taken",
            interval_s=0.02,
        )
        connected_before = log.read_text().count("Connected to redis://")
        assert _cut_redis_connections_of(stack.worker.pid, stack.redis) > 0
        # Reconnected: the consumer flushed the pool on the way (the frozen child never accepted the job).
        wait_until(
            lambda: log.read_text().count("Connected to redis://") > connected_before, 60, "the worker to reconnect"
        )
    finally:
        frozen.resume()

    caller.join(timeout=30)
    # Its caller has the answer: the thawed child ran the dispatch still in its pipe (the case of a dispatch
    # never written to a child, sent again, is the unit tests' below).
    assert answer["response"].status_code == 200, answer["response"].text
    # And the worker dispatches again: before the fix, each of these ran out its deadline (504).
    for text in ["the app crashes at login", "I was charged twice", "refund my order"]:
        response = stack.predict("router", [text], **{"X-Deadline-Ms": "10000"})
        assert response.status_code == 200, response.text
    assert requests.get(f"{stack.url}/api/v1/ready", timeout=5).status_code == 200
    # What happened, as the worker's log tells an operator (and proof that this test made the case).
    logged = log.read_text()
    kept = "it is in a child's pipe and that child runs it: kept" in logged
    assert not (kept and "dispatched again" in logged), "the child ran it: sending it again would compute it twice"
    assert response.json()["outputs"][0]["label"]


# The same write-off, decided in the worker's main process without a broker: the pool's jobs are billiard's
# own ApplyResults, dropped from the pool's cache as AsynPool.flush drops them.
class _Pool:
    """A prefork pool's surface as the dispatcher uses it: one child, apply_async into a job cache."""

    limit = 1
    num_processes = 1

    def __init__(self) -> None:
        self.cache: dict = {}
        self.jobs: list = []

    def apply_async(self, target, args, **callbacks):
        from billiard.pool import ApplyResult

        job = ApplyResult(self.cache, callbacks["callback"], error_callback=callbacks["error_callback"])
        self.jobs.append((job, args[1][0]))
        return job


class _Request:
    """What the dispatcher reads of a Celery request."""

    def __init__(self, request_id: str, texts: int, *, late: bool = False) -> None:

        self.id = request_id
        self.name = "inference.predict_online"
        self.kwargs = {"model": "router", "inputs": ["x"] * texts, "deadline": None, "client": "c"}
        self._payload = ((), self.kwargs, {})
        self.delivery_info = {"routing_key": "online.router"}
        self.hostname = self.reply_to = self.correlation_id = None
        self.request_dict = {"kwargs": self.kwargs}
        self.task = SimpleNamespace(acks_late=late)
        self.acked = 0

    def acknowledge(self) -> None:
        self.acked += 1


@pytest.fixture
def dispatcher():
    from inference.dispatch.batching import AdaptiveBatches
    from inference.dispatch.events import BatchEvents

    class Dispatcher(AdaptiveBatches):
        name = "test.reclaim"
        lost: list

        def on_lost(self, requests, reason):
            self.lost.extend((r.id, reason) for r in requests)

    task = Dispatcher()
    task._pool, task.lost = _Pool(), []
    task._events = BatchEvents(None, task)
    return task


def _queue(task, *requests) -> None:
    for request in requests:
        task._received_at[request.id] = 0.0
        task.policy.add(task.work_for(request, 0.0))
    task._dispatch()


def test_a_dispatch_that_never_reached_a_child_is_sent_again_once_the_pool_drops_it(dispatcher):
    task = dispatcher
    _queue(task, _Request("a", 2), _Request("b", 1))
    ((job, sent),) = task._pool.jobs
    assert {r.id for r in sent} == {"a", "b"}
    _queue(task, _Request("c", 1))
    assert len(task._pool.jobs) == 1, "one child, busy: c waits"
    job.discard()  # what AsynPool.flush does to a job no child accepted (and never written: no _write_to)
    task._dispatch()
    ((_, again),) = task._pool.jobs[1:]
    assert sorted(r.id for r in again) == ["a", "b", "c"], "sent again with what waited, in one dispatch"
    assert task.lost == []


def test_after_a_reconnect_what_the_pool_dropped_is_dispatched_without_waiting_for_a_message(dispatcher):
    # CI: the request taken back was only dispatched when the next message came, and its caller, the only
    # one waiting, ran out its deadline first.
    task = dispatcher
    _queue(task, _Request("a", 1))
    ((job, _),) = task._pool.jobs
    job.discard()
    later: list = []
    task._timer = type("Timer", (), {"call_after": lambda self, s, fun: later.append(fun)})()
    task._after_reconnect()
    assert len(later) == 1 and len(task._pool.jobs) == 1
    later[0]()
    assert [sorted(r.id for r in sent) for _, sent in task._pool.jobs] == [["a"], ["a"]]


def test_a_dropped_dispatch_in_a_childs_pipe_is_kept_and_run_once(dispatcher):
    task = dispatcher
    _queue(task, _Request("a", 1))
    ((job, _),) = task._pool.jobs
    job._write_to = SimpleNamespace(_is_alive=lambda: True)  # AsynPool wrote it to a live child's pipe
    job.discard()
    _queue(task, _Request("b", 1))
    assert job._job in task._pool.cache, "back in the pool's cache: the child's ACK and result reach it"
    assert [sorted(r.id for r in sent) for _, sent in task._pool.jobs] == [["a"]], "b waits: the child runs a"
    job._accepted = True
    job._set(None, (True, None))
    assert [sorted(r.id for r in sent) for _, sent in task._pool.jobs] == [["a"], ["b"]]


def test_a_dropped_dispatch_whose_child_died_is_sent_again(dispatcher):
    task = dispatcher
    _queue(task, _Request("a", 1))
    ((job, _),) = task._pool.jobs
    job._write_to = SimpleNamespace(_is_alive=lambda: False)
    job.discard()
    task._dispatch()
    assert [sorted(r.id for r in sent) for _, sent in task._pool.jobs] == [["a"], ["a"]]


def test_a_dropped_offline_chunk_is_left_to_the_broker_and_a_running_dispatch_is_kept(dispatcher):
    task = dispatcher
    _queue(task, _Request("chunk", 1, late=True))
    ((job, _),) = task._pool.jobs
    job._accepted = True  # a child has it: it stays in the cache, and the slot stays busy
    _queue(task, _Request("waits", 1))
    assert len(task._pool.jobs) == 1
    task._pool.cache.clear()  # now dropped unaccepted (the same as discard)
    job._accepted = False
    task._dispatch()
    assert [sorted(r.id for r in sent) for _, sent in task._pool.jobs[1:]] == [["waits"]], "not the chunk"
