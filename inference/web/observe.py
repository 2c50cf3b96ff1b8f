"""What the web tier records about each online request: outcome and stage metrics, per-version figures
(latency, errors, scores: issue 21's canaries), and the slow-request log.

Neither delays an answer. Metrics are summed in the process and written by a background task every
FLUSH_S (so Redis work does not grow with the request rate); the slow log is written in the
background and rate-limited per process, so a jam (when every request is slow) does not add a
database write per request to the overload.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import weakref
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any

from django.conf import settings

from inference.core.registry import get_registry
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


# Per-version series are bounded (observability's label discipline: a hostile or buggy `model_version` in a
# reply must not create series without end). A version gets its own series only when it is a sane token,
# is one the models file names for its model (once it names any), and is among the first
# MAX_VERSIONS_PER_MODEL versions this process saw for the model; anything else is counted as OTHER_VERSION.
MAX_VERSIONS_PER_MODEL = 8
OTHER_VERSION = "other"
_VERSION_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")  # fullmatch: no trailing newline
_versions_seen: dict[str, set[str]] = {}


# The version a request was admitted to (online.predict sets it), for the answers that carry none: a
# deadline passed or a worker failure after admission still counts against that version.
_admitted_to: ContextVar[str | None] = ContextVar("admitted_to_version", default=None)
# Refusals (too large, over a rate or share, admission): the request never reached a version.
REFUSAL_STATUSES = frozenset({413, 429, 503})


def admitted_to_version(version: str | None) -> None:
    """Note the version this request (the running task's) was admitted to."""
    _admitted_to.set(version)


def version_admitted() -> str | None:
    """The version this request was admitted to, if it was (see admitted_to_version)."""
    return _admitted_to.get()


def known_versions(model: str) -> frozenset[str] | None:
    """The versions the models file names for `model` (`Registry.versions_of`); None for a model it does
    not name (then any sane token is taken, up to the cap)."""
    return frozenset(get_registry().versions_of(model)) or None


def version_label(
    version: object, known: frozenset[str] | None, seen: set[str], cap: int = MAX_VERSIONS_PER_MODEL
) -> str | None:
    """The label a reply's `model_version` is counted under: None when no version was chosen (nothing is
    counted per version), the version itself when it is allowed (and then remembered in `seen`), else
    OTHER_VERSION."""
    if version is None or version == "":
        return None
    if not isinstance(version, str) or not _VERSION_TOKEN.fullmatch(version) or version == OTHER_VERSION:
        return OTHER_VERSION
    if known is not None and version not in known:
        return OTHER_VERSION
    if version not in seen:
        if len(seen) >= cap:
            return OTHER_VERSION
        seen.add(version)
    return version


def output_scores(outputs: Iterable[Any] | None) -> list[float]:
    """The top-level numeric `score` of each output that has one (router, text-classification, QA); none
    for outputs without (embeddings, identity, token-classification's scores are per entity)."""
    scores = []
    for output in outputs or ():
        score = output.get("score") if isinstance(output, dict) else None
        if isinstance(score, int | float) and not isinstance(score, bool) and math.isfinite(score):
            scores.append(float(score))
    return scores


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
    version: object = None,
    outputs: list[Any] | None = None,
) -> None:
    """Record one finished online request (metrics now, in memory; the slow log in the background).

    `version` is the model version the request was given to (the reply's `model_version`, or the version
    it was admitted to when no answer came); None when it was refused before one was chosen, and a
    refusal (REFUSAL_STATUSES) is counted per model only, whatever version had been picked for it. `outputs` are its answers, whose scores go into the version's
    score histogram.
    """
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
    outcome = outcome_label(status, code)
    fields = metrics.request_fields(model, outcome, timing)
    if version is not None and model != "-" and status not in REFUSAL_STATUSES:
        label = version_label(version, known_versions(model), _versions_seen.setdefault(model, set()))
        if label is not None:
            scores = output_scores(outputs) if status == 200 else []  # an error's outputs were not answered
            fields.update(metrics.version_fields(model, label, outcome, timing.get("total_ms"), scores))
    _accumulator().add(fields)
    if slow is not None:
        _keep(asyncio.get_running_loop().create_task(_log_slow(slow)))
