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
    started = time.time()
    if state:
        state.state, state.batches = "busy", state.batches + 1
    try:
        for model, group in group_by(requests, lambda r: r.kwargs["model"]).items():
            _serve_model(model, group, client, started, state)
    finally:
        if state:
            state.state = "idle"


def _serve_model(model: str, group: list[Any], client: redis.Redis, started: float, state: WorkerState | None) -> None:
    group_started = time.time()
    live = [r for r in group if r.kwargs["deadline"] > group_started]
    expired = len(group) - len(live)
    if not live:
        record_batch(client, model, done=0, texts=0, busy_s=0.0, expired=expired)
        return
    texts = [text for r in live for text in r.kwargs["inputs"]]
    worker = state.worker_id if state else ""
    try:
        outputs, passes = runtime.run(model, texts)
    except Exception as exc:  # every caller must hear about it; nothing else would tell them
        logger.exception("inference failed for %d requests on %s", len(live), model)
        push_replies(client, {r.id: {"ok": False, "error": f"inference failed: {exc}", "worker": worker} for r in live})
        record_batch(
            client, model, done=0, texts=0, busy_s=time.time() - group_started, expired=expired, failed=len(live)
        )
        return
    replies: dict[str, dict[str, Any]] = {}
    offset = 0
    for request in live:
        count = len(request.kwargs["inputs"])
        own = slice(offset, offset + count)
        offset += count
        replies[request.id] = {
            "ok": True,
            "outputs": outputs[own],
            "timing": _timing(request, passes[own], len(live)),
            "worker": worker,
        }
    push_replies(client, replies)
    sizes = list({id(p): p.size for p in passes}.values())
    record_batch(
        client,
        model,
        done=len(live),
        texts=len(texts),
        busy_s=time.time() - group_started,
        expired=expired,
        batch_sizes=sizes,
    )
