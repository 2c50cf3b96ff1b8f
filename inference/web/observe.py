"""What the web tier records about each online request: outcome and stage metrics, and the slow-request log.

Neither delays an answer. Metrics are summed in the process and written by a background task every
FLUSH_S (so Redis work does not grow with the request rate); the slow log is written in the
background and rate-limited per process, so a jam (when every request is slow) does not add a
database write per request to the overload.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

from django.conf import settings

from inference.core.task_io import input_chars
from inference.models import SlowRequest
from observability import metrics
from platform_.db import run_db
from platform_.redis import get_async_redis

logger = logging.getLogger(__name__)
_background: set[asyncio.Task] = set()
_slow_log_second = 0
_slow_logged_this_second = 0


def outcome_label(status: int, code: str | None) -> str:
    if status == 200:
        return "ok"
    if status == 503 and code:
        return f"503_{code}"
    return str(status)


def _slow_row_allowed() -> bool:
    global _slow_log_second, _slow_logged_this_second
    now_s = int(time.time())
    if now_s != _slow_log_second:
        _slow_log_second, _slow_logged_this_second = now_s, 0
    _slow_logged_this_second += 1
    return _slow_logged_this_second <= settings.SLOW_REQUEST_LOG_MAX_PER_S


FLUSH_S = 0.25
# One accumulator and one flusher per event loop (uvicorn runs one loop per process; tests may run more).
_accumulators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def _flush_forever(accumulator: metrics.Accumulator) -> None:
    failing = False
    while True:
        await asyncio.sleep(FLUSH_S)
        try:
            await accumulator.aflush(get_async_redis())
            failing = False
        except Exception:  # observability must never break serving; log once per outage
            if not failing:
                logger.exception("writing request metrics failed; their sums are dropped until Redis answers")
            failing = True


def _accumulator() -> metrics.Accumulator:
    loop = asyncio.get_running_loop()
    accumulator = _accumulators.get(loop)
    if accumulator is None:
        accumulator = _accumulators[loop] = metrics.Accumulator()
        _keep(loop.create_task(_flush_forever(accumulator)))
    return accumulator


def _keep(task: asyncio.Task) -> None:
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _log_slow(slow: dict[str, Any]) -> None:
    try:
        await run_db(SlowRequest.objects.create, **slow)
    except Exception:
        logger.exception("writing the slow-request log failed")


def observe(
    *,
    model: str,
    status: int,
    code: str | None,
    timing: dict[str, Any],
    request_id: str,
    texts: list[Any],
    worker: str = "",
) -> None:
    """Record one finished online request (metrics now, in memory; the slow log in the background)."""
    total_ms = timing.get("total_ms", 0.0)
    slow = None
    if (total_ms >= settings.SLOW_REQUEST_MS or status == 504) and model != "-" and _slow_row_allowed():
        slow = {
            "request_id": request_id,
            "model": model,
            "status": status,
            "inputs": len(texts),
            # Strings, or objects counted by their fields (a question plus its context).
            "input_chars": sum(input_chars(item) for item in texts),
            "total_ms": total_ms,
            "worker": worker,
            "batch_size": timing.get("batch_size"),
            **{f"{stage}_ms": timing.get(f"{stage}_ms") for stage in metrics.STAGES if stage != "total"},
        }
    _accumulator().add(metrics.request_fields(model, outcome_label(status, code), timing))
    if slow is not None:
        _keep(asyncio.get_running_loop().create_task(_log_slow(slow)))
