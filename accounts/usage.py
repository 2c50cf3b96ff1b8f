"""Usage metering: requests, inputs, tokens and job rows per user, key, model and day (UTC).

The hot path adds to Redis in one pipelined round trip (`record`, after the answer is computed; a
Redis failure loses the count, never the call); the sampler's housekeeping moves the counters into
`Usage` rows every USAGE_FLUSH_S (`flush`). Per-model totals also go to the lifetime metrics hash, so
/metrics shows tokens and inputs per model (never per key or user: unbounded label values).

A flush renames the day's hash before reading it, so increments made meanwhile land in a fresh hash
and none is lost; a flusher that dies between its database commit and deleting the renamed hash would
count that batch twice on the next run (it picks up left-over renamed hashes), a minute of usage at most.
"""

from __future__ import annotations

import logging
import uuid
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


# One command for the whole count: a pipeline of the same nine writes cost the web process about 3 x
# the CPU of a bare round trip in redis-py (packing and parsing each), this about 1.3 x
# (docs/benchmarks.md, "Usage metering"). KEYS: the day's usage, the day's tokens, the lifetime totals.
# ARGV: the field prefix (user|key|model|), inputs, tokens, the user's and the key's token field ('' for
# no key), the model, the two TTLs in seconds, and the totals' field prefixes.
_RECORD_LUA = """
local p = ARGV[1]
redis.call('HINCRBY', KEYS[1], p .. 'requests', 1)
redis.call('HINCRBY', KEYS[1], p .. 'inputs', ARGV[2])
redis.call('HINCRBY', KEYS[1], p .. 'tokens', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('HINCRBY', KEYS[2], ARGV[4], ARGV[3])
if ARGV[5] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[5], ARGV[3]) end
redis.call('EXPIRE', KEYS[2], ARGV[8])
redis.call('HINCRBY', KEYS[3], ARGV[9] .. ARGV[6], ARGV[3])
redis.call('HINCRBY', KEYS[3], ARGV[10] .. ARGV[6], ARGV[2])
"""
DAY_TOKENS_TTL_S = 2 * 24 * 3600


async def record(user_id: int, key_id: int | None, model: str, *, inputs: int, tokens: int) -> None:
    """Count one answered online call, and its tokens against the daily limits (one Redis command)."""
    if not settings.USAGE_METERING:
        return
    today = _today()
    keys = [usage_day_key(today), day_tokens_key(today), TOTAL_KEY]
    args = [
        field(user_id, key_id, model, ""),
        inputs,
        tokens,
        f"user:{user_id}",
        f"key:{key_id}" if key_id is not None else "",
        model,
        DAY_KEY_TTL_S,
        DAY_TOKENS_TTL_S,
        MODEL_TOKENS_PREFIX,
        MODEL_INPUTS_PREFIX,
    ]
    try:
        await get_async_redis().register_script(_RECORD_LUA)(keys=keys, args=args)
    except redis.RedisError:
        logger.warning("usage of user %s on %s not counted: Redis unavailable", user_id, model)


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
