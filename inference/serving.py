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

from inference import runtime
from inference.batching import group_by
from inference.replies import push_replies
from inference.workers import WorkerState, record_batch

logger = logging.getLogger(__name__)


def _timing(request: Any, passes: list[runtime.Pass], group_size: int) -> dict[str, Any]:
    first = min(p.start for p in passes)
    last = max(p.end for p in passes)
    return {
        "queue_wait_ms": round((request.received_at - request.kwargs["enqueued_at"]) * 1000, 3),
        "batch_wait_ms": round((first - request.received_at) * 1000, 3),
        "inference_ms": round((last - first) * 1000, 3),
        "batch_size": max(p.size for p in passes),
        "batch_requests": group_size,
        "inference_end": last,
    }


def serve_online(requests: list[Any], client: redis.Redis, state: WorkerState | None = None) -> None:
    """Answer each request in `requests` (celery-batches SimpleRequests stamped by AdaptiveBatches)."""
    for model, group in group_by(requests, lambda r: r.kwargs["model"]).items():
        _serve_model(model, group, client, state)


class _Answers:
    """Pushes each request's reply as soon as the last pass holding one of its texts is done."""

    def __init__(self, live: list[Any], client: redis.Redis, worker: str) -> None:
        self.live, self.client, self.worker = live, client, worker
        self.owner: list[int] = [n for n, r in enumerate(live) for _ in r.kwargs["inputs"]]
        self.first_text = [0] * len(live)
        for n in range(1, len(live)):
            self.first_text[n] = self.first_text[n - 1] + len(live[n - 1].kwargs["inputs"])
        self.remaining = [len(r.kwargs["inputs"]) for r in live]
        self.answered: set[int] = set()

    def pass_done(self, indices: list[int], outputs: list[Any], passes: list[runtime.Pass]) -> None:
        replies = {}
        for index in indices:
            n = self.owner[index]
            self.remaining[n] -= 1
            if self.remaining[n] == 0:
                request = self.live[n]
                own = slice(self.first_text[n], self.first_text[n] + len(request.kwargs["inputs"]))
                replies[request.id] = {
                    "ok": True,
                    "outputs": outputs[own],
                    "timing": _timing(request, passes[own], len(self.live)),
                    "worker": self.worker,
                }
                self.answered.add(n)
        push_replies(self.client, replies)

    def fail_the_rest(self, error: str) -> int:
        failed = {
            r.id: {"ok": False, "error": error, "worker": self.worker}
            for n, r in enumerate(self.live)
            if n not in self.answered
        }
        push_replies(self.client, failed)
        return len(failed)


def _serve_model(model: str, group: list[Any], client: redis.Redis, state: WorkerState | None) -> None:
    started = time.time()
    live = [r for r in group if r.kwargs["deadline"] > started]
    expired = len(group) - len(live)
    if not live:
        record_batch(client, model, done=0, texts=0, busy_s=0.0, expired=expired)
        return
    texts = [text for r in live for text in r.kwargs["inputs"]]
    answers = _Answers(live, client, state.worker_id if state else "")
    try:
        _, passes = runtime.run(model, texts, on_pass=answers.pass_done)
    except Exception as exc:  # every caller must hear about it; nothing else would tell them
        logger.exception("inference failed for %d requests on %s", len(live), model)
        failed = answers.fail_the_rest(f"inference failed: {exc}")
        done = len(live) - failed
        record_batch(client, model, done=done, texts=0, busy_s=time.time() - started, expired=expired, failed=failed)
        return
    distinct = list({id(p): p for p in passes}.values())
    record_batch(
        client,
        model,
        done=len(live),
        texts=len(texts),
        busy_s=time.time() - started,
        expired=expired,
        pass_sizes=[p.size for p in distinct],
        inference_s=sum(p.end - p.start for p in distinct),
        max_batch_size=runtime.spec(model).max_batch_size,
    )
