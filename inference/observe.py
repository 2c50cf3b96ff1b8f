"""What the web tier records about each online request: outcome and stage metrics, and the slow-request log.

Both are written after the answer is ready, in a background task, so a slow Redis or database never
delays an answer; the slow log is rate-limited per process, so a jam (when every request is slow)
does not add a database write per request to the overload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from django.conf import settings

from inference.models import SlowRequest
from platform_ import metrics
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


async def _record(model: str, outcome: str, timing: dict[str, Any], slow: dict[str, Any] | None) -> None:
    try:
        await metrics.arecord(get_async_redis(), metrics.request_fields(model, outcome, timing))
        if slow is not None:
            await run_db(SlowRequest.objects.create, **slow)
    except Exception:  # observability must never break serving
        logger.exception("recording request metrics failed")


def observe(
    *,
    model: str,
    status: int,
    code: str | None,
    timing: dict[str, Any],
    request_id: str,
    texts: list[str],
    worker: str = "",
) -> None:
    """Schedule the recording of one finished online request."""
    total_ms = timing.get("total_ms", 0.0)
    slow = None
    if (total_ms >= settings.SLOW_REQUEST_MS or status == 504) and model != "-" and _slow_row_allowed():
        slow = {
            "request_id": request_id,
            "model": model,
            "status": status,
            "inputs": len(texts),
            "input_chars": sum(len(t) for t in texts),
            "total_ms": total_ms,
            "worker": worker,
            "batch_size": timing.get("batch_size"),
            **{f"{stage}_ms": timing.get(f"{stage}_ms") for stage in metrics.STAGES if stage != "total"},
        }
    task = asyncio.get_running_loop().create_task(_record(model, outcome_label(status, code), timing, slow))
    _background.add(task)
    task.add_done_callback(_background.discard)
