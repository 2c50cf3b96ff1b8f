"""Usage metering: requests, inputs, tokens and job rows per user, key, model and day (UTC).

The hot path adds to per-process sums (`record`, after the answer is computed) that a task writes to Redis
every USAGE_WRITE_S in one pipeline (a Redis failure delays the counts, never the call); the sampler's housekeeping moves the counters into
`Usage` rows every USAGE_FLUSH_S (`flush`). Per-model totals also go to the lifetime metrics hash, so
/metrics shows tokens and inputs per model (never per key or user: unbounded label values).

A flush renames the day's hash before reading it, so increments made meanwhile land in a fresh hash
and none is lost; a flusher that dies between its database commit and deleting the renamed hash would
count that batch twice on the next run (it picks up left-over renamed hashes), a minute of usage at most.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections import defaultdict
from datetime import UTC, date, datetime
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import F

from accounts.keys import USAGE_FLUSHING_PREFIX, day_tokens_key, usage_day_key
from observability.keys import TOTAL_KEY
from platform_.redis import get_async_redis, get_redis

logger = logging.getLogger(__name__)

METRICS = ("requests", "inputs", "tokens", "job_rows")
NO_KEY = "-"
# The lifetime metrics hash's fields: /metrics reads them (accounts/apps.py registers the families).
MODEL_TOKENS_PREFIX, MODEL_INPUTS_PREFIX = "usage_tokens|", "usage_inputs|"
DAY_KEY_TTL_S = 8 * 24 * 3600  # a day's counters outlive a flusher that is down for a week


def _today() -> date:
    return datetime.now(UTC).date()


def field(user_id: int, key_id: int | None, model: str, metric: str) -> str:
    return f"{user_id}|{key_id if key_id is not None else NO_KEY}|{model}|{metric}"


def _queue(pipe: Any, user_id: int, key_id: int | None, model: str, counts: dict[str, int]) -> None:
    day_key = usage_day_key(_today())
    for metric, value in counts.items():
        if value:
            pipe.hincrby(day_key, field(user_id, key_id, model, metric), value)
    pipe.expire(day_key, DAY_KEY_TTL_S)


DAY_TOKENS_TTL_S = 2 * 24 * 3600


class _Pending:
    """One event loop's counts not yet in Redis: (hash, field) -> increment, and each hash's TTL."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        self.ttl_s: dict[str, int] = {}

    def add(self, key: str, name: str, value: int, ttl_s: int = 0) -> None:
        if value:
            self.counts[key, name] += value
            if ttl_s:
                self.ttl_s[key] = ttl_s

    async def write(self) -> None:
        """Everything counted so far, in one pipeline; on a Redis failure the counts wait for the next try."""
        if not self.counts:
            return
        counts, ttl_s = self.counts, self.ttl_s
        self.counts, self.ttl_s = defaultdict(int), {}
        pipe = get_async_redis().pipeline(transaction=False)
        for (key, name), value in counts.items():
            pipe.hincrby(key, name, value)
        for key, seconds in ttl_s.items():
            pipe.expire(key, seconds)
        try:
            await pipe.execute()
        except redis.RedisError:
            logger.warning("usage counts kept in this process until Redis answers")
            for (key, name), value in counts.items():
                self.add(key, name, value, ttl_s.get(key, 0))


# One per event loop (uvicorn runs one loop per process; tests may run more), with its writer task.
_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_writers: set[asyncio.Task] = set()


async def _write_forever(pending: _Pending) -> None:
    while True:
        await asyncio.sleep(settings.USAGE_WRITE_S)
        await pending.write()


def _pending_here() -> _Pending:
    loop = asyncio.get_running_loop()
    pending = _pending.get(loop)
    if pending is None:
        pending = _pending[loop] = _Pending()
        task = loop.create_task(_write_forever(pending))
        _writers.add(task)
        task.add_done_callback(_writers.discard)
    return pending


async def write_pending() -> None:
    """Write this event loop's counts now (tests; the writer task does it every USAGE_WRITE_S)."""
    await _pending_here().write()


async def record(user_id: int, key_id: int | None, model: str, *, inputs: int, tokens: int) -> None:
    """Count one answered online call, and its tokens against the daily limits.

    Summed in the process and written to Redis every USAGE_WRITE_S in one pipeline: a call pays a few
    dictionary additions, not a Redis command (one command per call cost the web process about 10% of
    its throughput where it is the bottleneck, docs/benchmarks.md "Usage metering"). What this trades:
    a process that dies loses up to USAGE_WRITE_S of counts, and the daily token limits see a call's
    tokens up to that much later.
    """
    if not settings.USAGE_METERING:
        return
    today = _today()
    pending = _pending_here()
    day_key, tokens_key = usage_day_key(today), day_tokens_key(today)
    prefix = field(user_id, key_id, model, "")
    pending.add(day_key, prefix + "requests", 1, DAY_KEY_TTL_S)
    pending.add(day_key, prefix + "inputs", inputs, DAY_KEY_TTL_S)
    pending.add(day_key, prefix + "tokens", tokens, DAY_KEY_TTL_S)
    pending.add(tokens_key, f"user:{user_id}", tokens, DAY_TOKENS_TTL_S)
    if key_id is not None:
        pending.add(tokens_key, f"key:{key_id}", tokens, DAY_TOKENS_TTL_S)
    pending.add(TOTAL_KEY, MODEL_TOKENS_PREFIX + model, tokens)
    pending.add(TOTAL_KEY, MODEL_INPUTS_PREFIX + model, inputs)


def record_job_rows(client: Any, rows_by_owner: dict[tuple[int, int | None], int], model: str) -> None:
    """Count offline rows done, per (job owner, the API key the job was made with), once per forward pass."""
    if not rows_by_owner or not settings.USAGE_METERING:
        return
    pipe = client.pipeline(transaction=False)
    for (owner_id, key_id), rows in rows_by_owner.items():
        _queue(pipe, owner_id, key_id, model, {"job_rows": rows})
    pipe.execute()


def _parse(counters: dict[str, str]) -> dict[tuple[int, int | None, str], dict[str, int]]:
    totals: dict[tuple[int, int | None, str], dict[str, int]] = defaultdict(dict)
    for name, value in counters.items():
        user_id, key_id, rest = name.split("|", 2)
        model, _, metric = rest.rpartition("|")
        if metric not in METRICS:
            continue
        group = (int(user_id), None if key_id == NO_KEY else int(key_id), model)
        totals[group][metric] = totals[group].get(metric, 0) + int(value)
    return totals


def _write(day: date, counters: dict[str, str]) -> int:
    from django.contrib.auth import get_user_model

    from accounts.models import ApiKey, Usage

    groups = _parse(counters)
    users = set(get_user_model().objects.filter(pk__in={g[0] for g in groups}).values_list("pk", flat=True))
    keys = set(ApiKey.objects.filter(pk__in={g[1] for g in groups if g[1]}).values_list("pk", flat=True))
    written = 0
    with transaction.atomic():
        for (user_id, key_id, model), counts in groups.items():
            if user_id not in users:
                continue  # the user was deleted meanwhile, and their usage with them
            key_id = key_id if key_id in keys else None
            row, _ = Usage.objects.get_or_create(day=day, user_id=user_id, api_key_id=key_id, model=model)
            Usage.objects.filter(pk=row.pk).update(**{m: F(m) + counts.get(m, 0) for m in METRICS})
            written += 1
    return written


def flush() -> int:
    """Move every day's Redis counters into Usage rows; the number of rows written."""
    client = get_redis()
    written = 0
    for name in client.scan_iter(match=usage_day_key("*"), count=100):
        client.rename(name, f"{USAGE_FLUSHING_PREFIX}{name.rpartition(':')[2]}:{uuid.uuid4().hex}")
    for name in client.scan_iter(match=f"{USAGE_FLUSHING_PREFIX}*", count=100):
        day = date.fromisoformat(name[len(USAGE_FLUSHING_PREFIX) :].split(":")[0])
        written += _write(day, client.hgetall(name))
        client.delete(name)
    return written


def metric_families(totals: dict[str, float], gauges: dict[str, float]) -> Any:
    """/metrics: tokens and inputs of answered online calls per model (registered in accounts/apps.py)."""
    from prometheus_client.core import CounterMetricFamily

    for metric, help_text, prefix in (
        ("platform_usage_tokens_total", "Tokens of answered online calls (metered usage).", MODEL_TOKENS_PREFIX),
        ("platform_usage_inputs_total", "Inputs of answered online calls (metered usage).", MODEL_INPUTS_PREFIX),
    ):
        family = CounterMetricFamily(metric, help_text, labels=["model"])
        for name, value in sorted(totals.items()):
            if name.startswith(prefix):
                family.add_metric([name[len(prefix) :]], value)
        yield family


def summary(user: Any, start: date, end: date) -> dict[str, Any]:
    """The user's usage from `start` to `end` (inclusive): a row per day, model and key, and totals."""
    from accounts.models import Usage

    rows = (
        Usage.objects.filter(user=user, day__gte=start, day__lte=end)
        .select_related("api_key")
        .order_by("-day", "model", "api_key_id")
    )
    listed = [
        {
            "day": row.day.isoformat(),
            "model": row.model,
            "key_id": row.api_key_id,
            "key_name": row.api_key.name if row.api_key else None,
            "key_prefix": row.api_key.prefix if row.api_key else None,
            **{metric: getattr(row, metric) for metric in METRICS},
        }
        for row in rows
    ]
    totals = {metric: sum(row[metric] for row in listed) for metric in METRICS}
    return {"start": start.isoformat(), "end": end.isoformat(), "totals": totals, "rows": listed}
