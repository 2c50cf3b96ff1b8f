"""Running one dispatched batch of online requests in a worker child, and answering every caller.

celery-batches swallows exceptions and ignores expiry, so this function owns both: a request whose
deadline has passed is skipped (never computed for nobody), and every other request gets an answer,
success or error, before the function returns.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from django.conf import settings

from inference.child import runtime
from inference.core.backlog import queue_release
from inference.core.planning import group_by
from inference.core.replies import queue_replies, route_of
from inference.core.workers import WorkerState, record_batch

logger = logging.getLogger(__name__)


def _timing(request: Any, passes: list[runtime.Pass], group_size: int, dispatch_start: float) -> dict[str, Any]:
    """Where a request's time went in the worker. batch_wait ends when its dispatch's first pass starts;
    pass_wait is the time its texts then waited behind the dispatch's earlier passes (a dispatch is cut
    into passes of similar length by max_padding_fraction): that is batching working, not a request
    waiting for company, and the diagnosis must not read it as "batches not filling" (issue 23)."""
    first = min(p.start for p in passes)
    last = max(p.end for p in passes)
    return {
        "queue_wait_ms": round((request.received_at - request.kwargs["enqueued_at"]) * 1000, 3),
        "batch_wait_ms": round((min(dispatch_start, first) - request.received_at) * 1000, 3),
        "pass_wait_ms": round(max(0.0, first - dispatch_start) * 1000, 3),
        "inference_ms": round((last - first) * 1000, 3),
        "batch_size": max(p.size for p in passes),
        "batch_requests": group_size,
        "inference_end": last,
    }


def serve_online(requests: list[Any], client: redis.Redis, state: WorkerState | None = None) -> None:
    """Answer each request in `requests` (celery-batches SimpleRequests stamped by AdaptiveBatches).

    Requests run on the model version the web tier stamped them with (`version`; none: this child's
    default), so one version's requests share passes and a swap never mixes versions in an answer.
    """
    for (model, version), group in group_by(requests, lambda r: (r.kwargs["model"], r.kwargs.get("version"))).items():
        _serve_model(model, group, client, state, version)


def _is_last_part(request: Any) -> bool:
    part = request.kwargs.get("part")
    return not part or part[1] == part[2]


def _offset(request: Any) -> int:
    part = request.kwargs.get("part")
    return part[0] if part else 0


# A pass shorter than this (an identity model, or a GPU's pass of a few short texts) does not get its
# replies written at once: they wait for the next slow pass or the batch's end and go out in one round
# trip with the rest. Per pass, the Redis write cost more than the model on such passes.
_EARLY_REPLY_PASS_S = 0.001


class _Answers:
    """Replies to a batch's requests, written as the passes holding their texts end.

    Each written reply is queued with the release of its request from the admission backlog (on its
    last part), and the last write carries the batch's statistics: one round trip per batch when passes
    are quick, one per slow pass otherwise.
    """

    def __init__(self, model: str, live: list[Any], client: redis.Redis, worker: str, version: str = "") -> None:
        self.model, self.live, self.client, self.worker = model, live, client, worker
        self.version = version  # every answer says which model version produced it
        self.owner: list[int] = [n for n, r in enumerate(live) for _ in r.kwargs["inputs"]]
        self.first_text = [0] * len(live)
        for n in range(1, len(live)):
            self.first_text[n] = self.first_text[n - 1] + len(live[n - 1].kwargs["inputs"])
        self.remaining = [len(r.kwargs["inputs"]) for r in live]
        self.answered: set[int] = set()
        self.dispatch_start: float | None = None  # when the dispatch's first pass started
        # Time spent writing answers to Redis: not busy time. A write that waited out a frozen primary
        # (5 s) once made a 55-token batch read as an 11 tokens/s drain rate, and admission then refused
        # the model's requests as unable to meet their deadlines long after the failover.
        self.writing_s = 0.0
        self._replies: dict[str, dict[str, Any]] = {}
        self._finished: list[str] = []  # requests whose last part is answered: released from admission

    def pass_done(self, indices: list[int], outputs: list[Any], passes: list[runtime.Pass]) -> None:
        if self.dispatch_start is None:  # passes run one after another: the first to end started first
            self.dispatch_start = passes[indices[0]].start
        for index in indices:
            n = self.owner[index]
            self.remaining[n] -= 1
            if self.remaining[n] == 0:
                request = self.live[n]
                own = slice(self.first_text[n], self.first_text[n] + len(request.kwargs["inputs"]))
                self._add(
                    request,
                    {
                        "ok": True,
                        "outputs": outputs[own],
                        "timing": _timing(request, passes[own], len(self.live), self.dispatch_start),
                        "worker": self.worker,
                        "model_version": self.version,
                    },
                )
                self.answered.add(n)
        done = passes[indices[0]]
        if done.end - done.start >= _EARLY_REPLY_PASS_S:
            self.flush()

    def fail(self, requests: list[Any], error: str, code: str) -> None:
        for request in requests:
            self._add(request, {"ok": False, "error": error, "code": code, "worker": self.worker})

    def _add(self, request: Any, reply: dict[str, Any]) -> None:
        self._replies[request.id] = {**reply, **route_of(request)}
        if _is_last_part(request):
            self._finished.append(request.id)

    def flush(self, **batch_stats: Any) -> None:
        """Write the replies not yet written, with `record_batch(**batch_stats)` when given."""
        if not (self._replies or batch_stats):
            return
        pipe = self.client.pipeline(transaction=False)
        queue_replies(pipe, self._replies)
        queue_release(pipe, self.model, self._finished)
        if batch_stats:
            record_batch(self.client, self.model, pipe=pipe, **batch_stats)
        self._replies, self._finished = {}, []
        started = time.time()
        try:
            pipe.execute()
        finally:
            self.writing_s += time.time() - started

    def unanswered(self) -> list[Any]:
        return [r for n, r in enumerate(self.live) if n not in self.answered]


def _culprit(model: str, request: Any, version: str | None = None) -> str:
    """Which of a failing request's texts the model cannot take, said without internals."""
    for index, text in enumerate(request.kwargs["inputs"]):
        try:
            runtime.run(model, [text], version=version)
        except Exception as exc:
            reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            return f"model {model!r} could not process inputs[{_offset(request) + index}]: {reason}"
    return f"model {model!r} could not process this request's texts together; send them in smaller requests"


def _isolate(
    model: str, requests: list[Any], client: redis.Redis, worker: str, version: str | None = None
) -> tuple[int, int]:
    """Run each request alone after a batch failed, so only a request whose own input fails gets an
    error and its neighbours get their answers. Returns (answered, failed)."""
    answered = failed = 0
    for request in requests:
        if request.kwargs["deadline"] <= time.time():
            continue  # its caller has been answered 504 already
        alone = _Answers(model, [request], client, worker, runtime.spec(model, version).version)
        try:
            runtime.run(model, request.kwargs["inputs"], on_pass=alone.pass_done, version=version)
            answered += 1
        except Exception:
            logger.warning("request %s fails on model %s on its own", request.id, model, exc_info=True)
            alone.fail([request], _culprit(model, request, version), "input_rejected")
            failed += 1
        alone.flush()
    return answered, failed


def _serve_model(
    model: str, group: list[Any], client: redis.Redis, state: WorkerState | None, version: str | None = None
) -> None:
    started = time.time()
    live = [r for r in group if r.kwargs["deadline"] > started]
    expired = len(group) - len(live)
    if not live:
        record_batch(client, model, done=0, texts=0, busy_s=0.0, expired=expired)
        return
    texts = [text for r in live for text in r.kwargs["inputs"]]
    worker = state.worker_id if state else ""
    try:
        served = runtime.spec(model, version).version
    except runtime.VersionNotLoaded as missing:
        # Pinned to a version this child lacks (the web tier checks pins against heartbeats, which lag):
        # a clear refusal, not a load on the request's time.
        answers = _Answers(model, live, client, worker)
        answers.fail(live, str(missing), "version_not_loaded")
        answers.flush(done=0, texts=0, busy_s=0.0, expired=expired, failed=len(live))
        return
    answers = _Answers(model, live, client, worker, served)
    try:
        _, passes = runtime.run(model, texts, on_pass=answers.pass_done, version=version)
    except Exception:
        # One request's input can fail a whole pass; its neighbours must not pay for it.
        logger.warning("a batch of %d requests failed on %s; running them one by one", len(live), model, exc_info=True)
        answers.flush()  # those answered before the failing pass
        rest = answers.unanswered()
        done, failed = _isolate(model, rest, client, worker, version)
        done += len(live) - len(rest)
        # No busy time: the re-runs would read as a slow drain rate (tokens per busy second) and make
        # admission refuse everyone for a poisoned request.
        record_batch(client, model, done=done, texts=0, busy_s=0.0, expired=expired, failed=failed)
        return
    distinct = list({id(p): p for p in passes}.values())
    answers.flush(
        done=len(live),
        texts=len(texts),
        busy_s=max(0.0, time.time() - started - answers.writing_s),
        # Priced as admission prices them: tokens plus a fixed overhead per request, counted on its last slice.
        tokens=sum(sum(r.kwargs.get("tokens") or ()) for r in live)
        + settings.ONLINE_REQUEST_OVERHEAD_TOKENS * sum(1 for r in live if _is_last_part(r)),
        expired=expired,
        pass_sizes=[p.size for p in distinct],
        inference_s=sum(p.end - p.start for p in distinct),
        max_batch_size=runtime.spec(model, version).max_batch_size,
    )
