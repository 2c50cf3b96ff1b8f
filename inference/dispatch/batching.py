"""Batching, in both places it happens.

1. In the worker's main process, `AdaptiveBatches` hands buffered requests to a child when one is
   free, in the order and amounts the dispatch policy (`inference/dispatch/fair.py`) decides.
   celery-batches flushes on a fixed timer or a count; measured on 2 CPU cores, a fixed timer hands
   small batches to children that are still busy, where they queue, and batches never grow. Here a
   batch is dispatched only when a child is free: a lone request goes at once (after at most
   `batch_wait_s`), and under load requests pile up while the children work, so each dispatch takes
   what has accumulated. Batch size follows load, with no window to tune.
2. In the child, `plan_batches` (inference/core/planning.py) cuts a dispatched batch into forward passes
   of similar length under a padded-token budget, because on a CPU a mixed-length batch is slower than
   single requests.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery_batches import Batches, SimpleRequest, consume_queue

from inference.core.workers import start_dispatcher_heartbeat
from inference.dispatch.events import BatchEvents, apply_batch
from inference.dispatch.fair import FairDispatcher, Limits, Slice, Work
from platform_.celery import worker_role

logger = logging.getLogger(__name__)


class _NoFixedTimer:
    """Stands in for celery-batches' flush timer so its message handler never starts one."""

    def cancel(self) -> None:
        pass


class AdaptiveBatches(Batches):
    """A celery-batches task whose dispatch policy is `inference.dispatch.fair.FairDispatcher`.

    This class is the thin adapter: it turns buffered Celery requests into `Work`, asks the policy
    for a plan whenever something changes (a message arrives, a child frees up, a wake-up timer
    fires), and sends each planned dispatch to the pool. A slice of a request travels as a copy of
    its SimpleRequest with the sliced inputs and `part = [start, end, total]`. Note what
    celery-batches does not do (the batch task must): honour `expires`, revocation and time limits,
    and report errors to callers.
    """

    abstract = True
    # The base class's count trigger; dispatch is decided here instead.
    flush_every = 1 << 30
    #: How long a free child waits for company before it takes a lone request.
    batch_wait_s = 0.0
    #: Hard limit on one dispatched batch: the pool kills a child that runs longer (celery-batches
    #: itself ignores task time limits, so this is where the queue's limit is enforced).
    batch_time_limit_s: float | None = None

    def __init__(self) -> None:
        super().__init__()
        self._policy: FairDispatcher | None = None
        # Requests received and not yet wholly dispatched, by task id (their arrival time).
        self._received_at: dict[str, float] = {}
        # Dispatches with the pool and not yet finished (their count is how many children are busy).
        self._sent: dict[int, _Sent] = {}
        self._next_token = 0
        self._wake: Any = None
        self._timer: Any = None
        self._unacked_queues: frozenset[str] = frozenset()
        self._max_held = 0
        self._gate: Callable[[], bool] | None = None
        self._closing = False
        self._dispatch_due = False
        self._bursting = False
        self._burst_supported = True
        self._events = BatchEvents(None, self)  # Flower's task events per batch, once the consumer exists

    # Hooks for the concrete task -------------------------------------------------------------
    def max_texts(self, model: str) -> int:
        """Most texts one dispatch may hold for this model."""
        return 32

    def request_texts(self, request: Any) -> int:
        """How many texts a request brings (online: its inputs; offline: its chunk's rows)."""
        return len(request.kwargs["inputs"])

    def limits(self, model: str) -> Limits:
        """Dispatch limits for this model (by default a text budget only)."""
        return Limits(max_texts=self.max_texts(model), max_tokens=1 << 62, contended_tokens=1 << 62)

    def work_for(self, request: Any, received_s: float) -> Work:
        """How the policy sees a request: model, client, cost per text, deadline, and whether it may be
        sliced (by default: one client, a cost of 1 per text, whole, no deadline)."""
        texts = self.request_texts(request)
        return Work(request, request.kwargs["model"], "", [1] * texts, received_s, divisible=False)

    def on_lost(self, requests: list[SimpleRequest], reason: str) -> None:
        """A child died running these requests: tell their callers (acks_late ones are also requeued)."""

    def on_expired(self, requests: list[Any]) -> None:
        """Requests dropped before dispatch because their deadline passed."""

    # Main-process machinery ------------------------------------------------------------------
    def Strategy(self, task: Batches, app: Any, consumer: Any) -> Callable[..., None]:
        handle = super().Strategy(task, app, consumer)
        # Called again after a broker reconnect, whose event loop cleared every timer: wake-ups and the
        # heartbeat are armed anew on the new timer.
        self._timer = consumer.timer
        self._events = BatchEvents(consumer, task)
        self._tref = _NoFixedTimer()
        self._wake = None
        # Queues consumed without acknowledgements (kombu `Queue(no_ack=True)`; the online queue, see
        # platform_/celery.py): their messages are never acked, and nothing but this task bounds how
        # many the worker pulls, so it holds at most what its prefetch would have allowed.
        consumed = app.amqp.queues.consume_from or app.amqp.queues  # the queues this worker's -Q selects
        self._unacked_queues = frozenset(name for name, queue in consumed.items() if queue.no_ack)
        self._max_held = consumer.initial_prefetch_count or 4 * self._children()
        self._gate = None
        self.on_consumer_ready(consumer)
        self._after_reconnect()

        def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any) -> None:
            task_id = (message.headers or {}).get("id")
            if task_id:
                self._received_at[task_id] = time.time()
            handle(message, body, ack, reject, callbacks, **kw)
            if self._bursting:
                return  # taken in a burst (below): dispatched once, at its end
            queue = (message.delivery_info or {}).get("routing_key")
            if queue in self._unacked_queues:
                if self._gate is None:
                    self._install_gate(consumer)
                self._take_burst(consumer, queue)
            self._dispatch()

        return on_message

    #: Most messages taken from a no-ack queue in one round trip after a BRPOP wakes the worker.
    burst_max = 64

    def _take_burst(self, consumer: Any, queue: str) -> None:
        """Take what else waits in `queue`, up to the gate's credit, in one RPOP, and hand each message
        to the consumer as kombu would have.

        kombu's Redis transport takes one message per BRPOP round trip: under load that round trip and
        its event-loop turn were most of the worker's main-process CPU per request. Only for no-ack
        queues, where nothing per message has to be recorded in Redis on receipt.
        """
        credit = min(self.burst_max, self._credit())
        if credit <= 0 or not self._burst_supported:
            return
        channel = consumer.task_consumer.channel
        try:
            raw = channel.client.rpop(queue, credit)  # the BRPOP connection, idle while its reply is handled
        except redis.ResponseError:  # a Redis before 6.2 has no count argument: one message per wake-up
            self._burst_supported = False
            return
        except redis.RedisError:
            logger.warning("could not take a burst from %s", queue, exc_info=True)
            return
        self._bursting = True
        try:
            for item in raw or ():
                channel.connection._deliver(json.loads(item), queue)
        finally:
            self._bursting = False

    def _install_gate(self, consumer: Any) -> None:
        """Stop pulling messages while `_max_held` requests are waiting here.

        With acknowledgements, kombu's prefetch count bounds what a worker takes; without them it
        BRPOPs as fast as messages come. Its Redis transport asks the channel's `qos.can_consume()`
        before each BRPOP and pauses the socket while it says no: this task answers that question.
        (Installed on the first message, as the task consumer's channel does not exist yet when the
        strategy is built; a reconnect builds a new strategy, so a new channel gets its own gate.)
        """
        qos = consumer.task_consumer.channel.qos
        prefetch_allows = qos.can_consume  # still counts the acknowledged queues' messages, if any
        self._gate = lambda: self._credit() > 0 and prefetch_allows()
        qos.can_consume = self._gate

    def _credit(self) -> int:
        """How many more requests this worker may take from a no-ack queue: its prefetch, less what it holds."""
        return self._max_held - len(self._received_at)

    def _acks(self, request: Any) -> bool:
        """Whether the message was consumed with an acknowledgement to send (see `_unacked_queues`)."""
        return (request.delivery_info or {}).get("routing_key") not in self._unacked_queues

    def on_consumer_ready(self, consumer: Any) -> None:
        """Called in the worker's main process when this task's strategy is built (at start and after
        each broker reconnect): (re)starts the dispatcher heartbeat on the consumer's timer."""
        start_dispatcher_heartbeat(consumer.timer, worker_role())

    @property
    def policy(self) -> FairDispatcher:
        if self._policy is None:
            self._policy = FairDispatcher(_LimitsOf(self), self.batch_wait_s)
        return self._policy

    def _children(self) -> int:
        return getattr(self._pool, "num_processes", None) or self._pool.limit or 1

    def _dispatch(self) -> None:
        now = time.time()
        for request in consume_queue(self._buffer):
            self.policy.add(self.work_for(request, self._received_at.get(request.id, now)))
        if self._closing:
            return
        self._reclaim_discarded()
        plan = self.policy.plan(self._children() - len(self._sent), self._children(), now)
        for dispatch in plan.dispatches:
            self._send(dispatch, now)
        if plan.wake_in_s is not None and self._wake is None:
            self._wake = self._timer.call_after(plan.wake_in_s, self._on_wake)
        if plan.expired:
            expired = [w.key for w in plan.expired]
            for request in expired:
                self._received_at.pop(request.id, None)
                if self._acks(request):
                    request.acknowledge()  # never computed, never redelivered: its deadline has passed
            try:
                self.on_expired(expired)
            except Exception:  # counting them must not stop dispatching
                logger.warning("could not record %d expired requests", len(expired), exc_info=True)

    def stop_dispatching(self) -> None:
        """The worker is shutting down: batches still running finish, no new one starts.

        Also arranges for `_settle_dropped` to run once the pool has stopped: the worker's Hub step stops
        (and closes the event loop, running its on_close callbacks) after the Pool step has joined the
        children, and before the consumer's channel closes and kombu restores what is unacknowledged.
        """
        from kombu.asynchronous import get_event_loop

        self._closing = True
        hub = get_event_loop()
        if hub is not None:
            hub.on_close.add(self._settle_dropped)

    def ran_anyway(self, requests: list[Any]) -> list[Any]:
        """Of these acks_late requests, in dispatches the pool dropped at shutdown, those whose work a child
        took anyway: their messages are acknowledged instead of restored. By default none is known (kombu
        restores them all)."""
        return []

    def _settle_dropped(self, *_: Any) -> None:
        """Settle the acks_late messages of dispatches the pool never reported on (called as the event loop
        closes at shutdown, after the pool's children have exited).

        Celery's consumer flushes the pool as it stops (Consumer.on_close -> AsynPool.flush), and the flush
        drops every job whose acceptance the main process has not read yet, with its callbacks. A job already
        in a child's pipe is run by that child all the same: when the shutdown lands between a dispatch and
        the child's acceptance, the child runs the batch to its end, `finished` never runs, its messages are
        never acknowledged, and kombu restores them when the channel closes, as copies of work that is done
        (issue 23: an offline chunk done on the stopping worker came back as a message). `ran_anyway` says
        which of them a child took; their messages are acknowledged here (the event loop runs the acks as
        it closes, before the channel does); the rest are left to kombu, which restores them.
        """
        dropped = [piece.work.key for sent in self._sent.values() for piece in sent.pieces]
        self._sent.clear()
        late = list({r.id: r for r in dropped if r.task.acks_late and not r.acknowledged}.values())
        if not late:
            return
        try:
            ran = self.ran_anyway(late)
        except Exception:  # then kombu restores them all: a copy of done work is harmless, a lost message is not
            logger.warning("could not tell which of %d dropped requests a child ran", len(late), exc_info=True)
            return
        for request in ran:
            request.acknowledge()
        logger.warning(
            "the pool dropped dispatches of %d acks_late requests at shutdown: %d taken by a child anyway "
            "(acknowledged), %d left to the broker",
            len(late),
            len(ran),
            len(late) - len(ran),
        )

    def hand_back(self, client: redis.Redis) -> int:
        """Put the requests this worker took from a no-ack queue but never started back at the head of
        their queue, for another worker (called at shutdown, after the pool has stopped).

        With acknowledgements kombu restores what a stopping worker prefetched; without them these
        messages exist nowhere else. A request already partly dispatched is answered with an error
        instead (its first parts went to its caller). Returns how many were handed back.
        """
        handed = 0
        pipe = client.pipeline(transaction=False)
        for work in self.policy.drain():
            request = work.key
            self._received_at.pop(request.id, None)
            if self._acks(request):
                continue  # kombu restores it
            if work.next_text == 0:
                # RPUSH: the end BRPOP takes next, so they are served before newer requests.
                pipe.rpush(request.delivery_info["routing_key"], json.dumps(request.message._raw))
                handed += 1
            else:
                self.on_lost([request], "the worker shut down before finishing this request")
        pipe.execute()
        return handed

    def _on_wake(self) -> None:
        self._wake = None
        self._dispatch()

    def _simple(self, piece: Slice, now: float) -> SimpleRequest:
        request = piece.work.key
        item = SimpleRequest.from_request(request)
        item.received_at = self._received_at.get(request.id, now)
        item.dispatched_at = now
        if not piece.whole:
            kwargs = dict(item.kwargs)
            kwargs["inputs"] = kwargs["inputs"][piece.start : piece.end]
            if "tokens" in kwargs:
                kwargs["tokens"] = kwargs["tokens"][piece.start : piece.end]
            kwargs["part"] = [piece.start, piece.end, len(piece.work.costs)]
            item.kwargs = kwargs
            # request_dict holds the whole message's kwargs too: without this, every slice would carry
            # all of the request's texts through the pool pipe.
            item.request_dict = {**(item.request_dict or {}), "kwargs": kwargs}
        if piece.last:
            self._received_at.pop(request.id, None)
        return item

    def _after_reconnect(self) -> None:
        """A reconnect flushed the pool (see `_reclaim_discarded`): dispatch now what it dropped and what
        waits, not when the next message happens to arrive (a waiting caller may be the only one), and not
        from inside the Strategy call."""
        written_off = self._reclaim_discarded()
        if written_off or len(self.policy):
            self._dispatch_soon()

    def _dispatch_soon(self) -> None:
        """Dispatch on the event loop's next turn (at once when there is no loop yet).

        The pool's callbacks (`finished`, `lost`) call this rather than `_dispatch`: AsynPool.flush runs
        them while it is flushing (joining a dead child), and a dispatch sent from there would land in the
        outbound buffer that the flush clears as it ends: that job would stay in the cache, never written
        and never dropped, its requests never run and its slot held for good.
        """
        if self._timer is None:
            self._dispatch()
            return
        if not self._dispatch_due:
            self._dispatch_due = True
            self._timer.call_after(0.0, self._dispatch_now)

    def _dispatch_now(self) -> None:
        self._dispatch_due = False
        self._dispatch()

    def _reclaim_discarded(self) -> int:
        """Take back dispatches the pool dropped without running them; returns how many it wrote off.

        When the broker connection is lost, Celery's consumer flushes the pool (`AsynPool.flush`): a job
        no child has accepted yet is discarded from the pool's cache and none of its callbacks ever runs.
        Counted as busy forever, such a dispatch held a child's slot for good: with one child, the worker
        never dispatched again after a Redis failover (every online call then ran out its deadline).

        - A job already written to a live child's pipe is run by that child: it is put back in the
          pool's cache, so the child's acceptance and result (or its death) reach the dispatcher as for
          any job, with the batch time limit armed, and its slot stays busy until then.
        - One that never reached a child (or whose child died): its online requests are dispatched again
          (their deadlines still hold); a slice of a request cut over several dispatches is answered with
          an error, as when a child dies (the request's other parts went to its caller); acks_late work
          (offline chunks) is left to the broker, which redelivers what was never acknowledged.
        """
        written_off = 0
        for token, sent in list(self._sent.items()):
            if not sent.discarded():
                continue
            child = getattr(sent.result, "_write_to", None)  # set by AsynPool as it writes the job
            is_alive = getattr(child, "_is_alive", None)
            if child is not None and (is_alive is None or is_alive()):
                sent.result._cache[sent.result._job] = sent.result
                logger.warning(
                    "the pool dropped a dispatch of %d requests when the broker connection was lost; it is in "
                    "a child's pipe and that child runs it: kept",
                    len(sent.pieces),
                )
                continue
            del self._sent[token]
            written_off += 1
            self._events.lost(sent.batch, "discarded by the pool when the broker connection was lost")
            again, failed = [], []
            for piece in sent.pieces:
                request = piece.work.key
                if request.task.acks_late:
                    continue
                if piece.whole:
                    again.append(piece.work)
                else:
                    failed.append(piece)
            for work in again:
                work.next_text = 0
                self._received_at.setdefault(work.key.id, work.arrived_s)
                self.policy.add(work)
            if failed:
                simple = [self._simple(piece, time.time()) for piece in failed]
                for piece in failed:  # forgotten first: a failed reply must not leave the rest queued
                    self.policy.discard(piece.work)
                    self._received_at.pop(piece.work.key.id, None)
                reason = "the worker lost its broker connection before a child took this part; try again"
                try:
                    self.on_lost(simple, reason)
                except Exception:  # right after a failover Redis may not answer yet: the callers time out
                    logger.warning("could not answer %d dropped parts", len(failed), exc_info=True)
            logger.warning(
                "the pool discarded a dispatch of %d requests when the broker connection was lost: %d "
                "dispatched again, %d answered with an error, %d left to the broker",
                len(sent.pieces),
                len(again),
                len(failed),
                len(sent.pieces) - len(again) - len(failed),
            )
        return written_off

    def _send(self, pieces: list[Slice], now: float) -> None:
        simple = [self._simple(piece, now) for piece in pieces]
        token = self._next_token = self._next_token + 1
        requests = [piece.work.key for piece in pieces]
        # Early-ack tasks (online: a caller with a deadline is answered, never redelivered) are acked
        # once a child has the batch (acknowledge() is idempotent, so a request sliced over several
        # dispatches is acked once); acks_late tasks (offline) when it is done, or requeued if the
        # child died, as celery-batches itself does for acks_late.
        late = [r for r in requests if r.task.acks_late]
        early = [r for r in requests if not r.task.acks_late and self._acks(r)]
        batch = self._events.dispatched(simple)

        def accepted(pid: int, time_accepted: float) -> None:
            self._events.started(batch, pid)
            for request in early:
                request.acknowledge()

        def finished(result: Any) -> None:
            if self._sent.pop(token, None) is None:
                return  # written off as discarded (see _reclaim_discarded)
            self._events.finished(batch, result)
            for request in late:
                request.acknowledge()
            self._dispatch_soon()

        def lost(exc: Any) -> None:
            if self._sent.pop(token, None) is None:
                return
            self._events.lost(batch, exc)
            logger.error("a worker child died running %d requests: %r", len(simple), exc)
            self.on_lost(simple, f"the worker process died: {exc!r}")
            for request in early:  # their callers were told; a redelivery would be computed for nobody
                request.acknowledge()
            for request in late:
                request.reject(requeue=True)
            for piece in pieces:  # what is left of a sliced request: its caller has its error already
                self.policy.discard(piece.work)
                self._received_at.pop(piece.work.key.id, None)
            self._dispatch_soon()

        sent = self._sent[token] = _Sent(pieces, batch)
        sent.result = self._pool.apply_async(
            apply_batch,
            (self, (simple,), 0, None),
            accept_callback=accepted,
            callback=finished,
            error_callback=lost,
            timeout=self.batch_time_limit_s,
        )


@dataclass
class _Sent:
    """A dispatch handed to the pool: its slices, Flower's batch, and the pool's handle on the job."""

    pieces: list[Slice]
    batch: Any
    result: Any = None  # billiard's ApplyResult (prefork); other pools may return None

    def discarded(self) -> bool:
        """Whether the pool dropped the job without running it: gone from the pool's job cache with no
        result. (A finished job leaves the cache and runs its callback in one step of the event loop,
        so one that left the cache without a result was discarded.)"""
        cache = getattr(self.result, "_cache", None)
        if cache is None or not hasattr(self.result, "_job"):
            return False  # a pool this cannot see into: trust its callbacks
        return self.result._job not in cache and not self.result.ready()


class _LimitsOf:
    """The policy's view of a task's per-model limits (looked up on demand: models load lazily)."""

    def __init__(self, task: AdaptiveBatches) -> None:
        self.task = task
        self._cache: dict[str, Limits] = {}

    def __getitem__(self, model: str) -> Limits:
        if model not in self._cache:
            self._cache[model] = self.task.limits(model)
        return self._cache[model]
