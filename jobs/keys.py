"""Names the offline jobs write to Redis, in one place.

Jobs keep their state in the database (the record of truth); in Redis they only add to the shared
metrics (fields of observability's per-second hashes) and hold the reconciler's run lock.
"""

from __future__ import annotations

# The reconciler's Periodic name: its lock is `periodic:<name>:lock` (platform_/periodic.py).
RECONCILER = "jobs-reconciler"
# Seconds offline children spent yielding to online work (all models).
OFFLINE_YIELD_FIELD = "oyield_s|all"


def offline_rows_field(model: str) -> str:
    """Rows an offline job wrote for `model` (metric field; /metrics: offline_rows_total)."""
    return f"orows|{model}"


def offline_inference_field(model: str) -> str:
    """Seconds offline children spent in forward passes for `model` (/metrics: offline_inference_seconds_total)."""
    return f"oinfer_s|{model}"


# Rows an offline job wrote, per owner and priority: `ousr|<username>|<priority>` (metric field; /metrics:
# offline_user_rows_total{user,priority}; the dashboard's rows/s per user). A username never holds "|"
# (Django's validator allows letters, digits and @.+-_), and the priority is parsed from the right anyway.
OFFLINE_USER_ROWS_PREFIX = "ousr|"
# Rows of live jobs not yet done or failed, per owner and priority: a gauge, sampled for users with live
# jobs only (/metrics: offline_queued_rows{user,priority}).
OFFLINE_QUEUED_ROWS_PREFIX = "gauge|oqrows|"


def offline_user_rows_field(username: str, priority: str) -> str:
    return f"{OFFLINE_USER_ROWS_PREFIX}{username}|{priority}"


def offline_queued_rows_field(username: str, priority: str) -> str:
    return f"{OFFLINE_QUEUED_ROWS_PREFIX}{username}|{priority}"


def user_and_priority(field: str, prefix: str) -> tuple[str, str] | None:
    """(username, priority) of a per-user field with this prefix; None for any other field."""
    if not field.startswith(prefix):
        return None
    username, _, priority = field[len(prefix) :].rpartition("|")
    return (username, priority) if username and priority else None
