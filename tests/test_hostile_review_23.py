"""Hostile review of issue 23's changes: the reconnect write-off (inference/dispatch/batching.py) and the
shared board of passes (inference/child/cores.py).

Unit tests only (no broker, no stack): the pool's jobs are billiard's own ApplyResults, dropped from the
pool's cache as celery/concurrency/asynpool.py AsynPool.flush drops them.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest


class _Pool:
    """A prefork pool's surface as the dispatcher uses it: apply_async into a job cache, and the AsynPool
    outbound buffer a job waits in until it is written to a child."""

    def __init__(self, children: int = 1) -> None:
        self.limit = self.num_processes = children
        self.cache: dict = {}
        self.jobs: list = []
        self.outbound: list = []

    def apply_async(self, target, args, **callbacks):
        from billiard.pool import ApplyResult

        job = ApplyResult(self.cache, callbacks["callback"], error_callback=callbacks["error_callback"])
        self.jobs.append((job, args[1][0]))
        self.outbound.append(job)
        return job

    def write(self, job) -> None:
        """AsynPool wrote the job to a child's pipe (it sets _write_to as it starts writing)."""
        self.outbound.remove(job)
        job._write_to = object()

    def accept(self, job) -> None:
        """The child's ACK was read: the job stays in the cache until its result comes."""
        if job in self.outbound:
            self.write(job)
        job._accepted = True

    def flush(self, maintain=lambda: None) -> None:
        """AsynPool.flush, in its order: drop every job not accepted, clear the outbound buffer, maintain the
        pool (joining exited children, which runs their jobs' error callbacks), and clear the outbound
        buffer again in its `finally`."""
        for job in list(self.cache.values()):
            if not job._accepted:
                job.discard()
        self.outbound.clear()
        try:
            maintain()
        finally:
            self.outbound.clear()


class _Request:
    def __init__(self, request_id: str, texts: int = 1) -> None:
        self.id = request_id
        self.name = "inference.predict_online"
        self.kwargs = {"model": "router", "inputs": ["x"] * texts, "deadline": None, "client": "c"}
        self._payload = ((), self.kwargs, {})
        self.delivery_info = {"routing_key": "online.router"}
        self.hostname = self.reply_to = self.correlation_id = None
        self.request_dict = {"kwargs": self.kwargs}
        self.task = SimpleNamespace(acks_late=False)

    def acknowledge(self) -> None:
        pass


class _Timer:
    def __init__(self) -> None:
        self.due: list = []

    def call_after(self, seconds, fun, *args):
        self.due.append(fun)
        return fun

    def run(self) -> None:
        while self.due:
            self.due.pop(0)()


def _dispatcher(children: int = 1):
    from inference.dispatch.batching import AdaptiveBatches
    from inference.dispatch.events import BatchEvents

    class Dispatcher(AdaptiveBatches):
        name = "test.hostile23"

        def on_lost(self, requests, reason):
            self.lost.extend(r.id for r in requests)

    task = Dispatcher()
    task._pool, task.lost = _Pool(children), []
    task._events = BatchEvents(None, task)
    task._timer = _Timer()
    task._unacked_queues = frozenset({"online.router"})
    return task


def _queue(task, *requests) -> None:
    for request in requests:
        task._received_at[request.id] = 0.0
        task.policy.add(task.work_for(request, 0.0))
    task._dispatch()


def _ids(sent) -> list[str]:
    return sorted(r.id for r in sent)


def test_a_request_waiting_behind_a_written_off_dispatch_is_dispatched_after_the_reconnect():
    """Fixed: the dispatch in the child's pipe is kept (back in the pool's cache, its slot busy), and b,
    waiting behind it, is dispatched when the child's result comes, with no other message needed."""
    task = _dispatcher(children=1)
    _queue(task, _Request("a"))
    ((job, _),) = task._pool.jobs
    task._pool.write(job)  # in the (frozen) child's pipe, not accepted yet
    _queue(task, _Request("b"))  # the one child is busy: b waits
    assert len(task._pool.jobs) == 1
    task._pool.flush()  # the broker connection is lost
    task._after_reconnect()  # Strategy, on the new connection
    task._timer.run()
    assert len(task._pool.jobs) == 1, "the child still runs a: b is not queued behind it"
    task._pool.accept(job)  # the thawed child takes a and answers it
    job._set(None, (True, None))
    task._timer.run()
    assert [_ids(sent) for _, sent in task._pool.jobs] == [["a"], ["b"]]


def test_a_dispatch_sent_from_a_callback_inside_the_pool_flush_is_not_stranded():
    task = _dispatcher(children=2)
    _queue(task, _Request("x", 1))
    _queue(task, _Request("b", 1))
    (job_x, sent_x), (job_b, sent_b) = task._pool.jobs
    assert (_ids(sent_x), _ids(sent_b)) == (["x"], ["b"])
    task._pool.accept(job_x)  # child 1 runs x; child 2 has not taken b yet

    def child_1_found_dead() -> None:  # billiard's mark_as_worker_lost, as maintain_pool runs it
        job_x._set(None, (False, RuntimeError("WorkerLostError: the child exited")))

    task._pool.flush(maintain=child_1_found_dead)
    task._after_reconnect()
    task._timer.run()
    assert task.lost == ["x"]
    live = [job for job, _ in task._pool.jobs if job in task._pool.outbound or job._accepted]
    sent_b_again = [sent for job, sent in task._pool.jobs if job in live and "b" in _ids(sent)]
    assert sent_b_again, "b is in no job the pool will write: stranded in the cache"
    assert len(task._sent) <= len(live)


def test_a_dispatch_left_to_the_child_keeps_the_pool_callbacks():
    task = _dispatcher(children=1)
    _queue(task, _Request("a"))
    ((job, _),) = task._pool.jobs
    task._pool.write(job)
    task._pool.flush()
    task._after_reconnect()
    task._timer.run()
    assert job._job in task._pool.cache, "the child's ACK and result (or its death) no longer reach the dispatcher"


# -- the board of passes ------------------------------------------------------------------------------------


def test_a_stale_slot_with_a_reused_pid_is_not_counted_as_a_busy_child(tmp_path):
    from inference.child.cores import Board

    board = Board(tmp_path / "board")
    stale = 7
    # A child that died mid-pass (SIGKILL by the time limit, the OOM killer) left owner == busy == its pid;
    # the pid is now this process's.
    board._owners[stale] = board._busy[stale] = os.getpid()
    assert board.claim() == 0
    assert board.busy_children() == 0, "nobody is in a pass"
    with board.in_pass() as busy:
        assert busy == 1


def test_a_board_is_shared_only_by_processes_that_see_the_same_file(tmp_path):
    """Turned out fine: the board survives a file of the current size left by an earlier run (dead owners
    are reclaimed, a stale overlap stamp only delays elastic threads by QUIET_S)."""
    from inference.child.cores import SLOTS, Board

    path = tmp_path / "board"
    first = Board(path)
    first._owners[0] = first._busy[0] = 2**22 + 12345  # a pid above pid_max: dead
    first._overlap[0] = 0
    second = Board(path)
    assert second.claim() == 0
    assert second.busy_children() == 0
    assert len(second._owners) == SLOTS


def test_a_failed_error_reply_for_a_dropped_slice_does_not_break_the_reconnect():
    import redis

    from inference.dispatch.fair import Limits, Work

    task = _dispatcher(children=1)
    task.limits = lambda model: Limits(max_texts=1, max_tokens=1 << 62, contended_tokens=1 << 62)
    task.work_for = lambda request, received_s: Work(request, "router", "c", [1] * 2, received_s)

    def on_lost(requests, reason):
        raise redis.ConnectionError("the failover is not over")

    task.on_lost = on_lost
    _queue(task, _Request("a", 2))
    ((job, sent),) = task._pool.jobs
    assert sent[0].kwargs["part"] == [0, 1, 2]
    task._pool.flush()
    try:
        task._after_reconnect()
    except redis.ConnectionError:
        pytest.fail("the consumer's Strategy raised: the reconnect fails")
    task._timer.run()
    assert len(task.policy) == 0, "the rest of a request whose first part was lost is still queued"
